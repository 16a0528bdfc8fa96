package azure

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// What a dynamic pool's job may ask of its VM's size (cpu=, mem=, gpus=,
// gpu=) is met by choosing among the pool's vm_sizes those that have it,
// the smallest first (vm.Fit), from what Azure says of each: the resource
// SKUs of the pool's first location that offers it (its vCPUs, MemoryGB
// and GPUs capabilities), read once. The SKUs do not name a size's GPU
// model: its name does (gpuOf).

// readSizes is what each of the pool's VM sizes has (vm.Catalogue.Read).
func (p *Provider) readSizes(ctx context.Context, sizes []string) ([]vm.Size, error) {
	want := map[string]bool{}
	for _, s := range sizes {
		want[strings.ToLower(s)] = true
	}
	var out []vm.Size
	for _, loc := range p.opt.Section.Locations {
		if len(want) == 0 {
			break
		}
		skus, err := p.opt.API.SKUs(ctx, loc)
		if err != nil {
			err = fmt.Errorf("list resource SKUs of %s: %w", loc, briefError{err})
			if kind, _ := kindOf(err); kind == errFatal {
				return nil, provider.Rejected(err)
			}
			return nil, err
		}
		for _, sku := range skus {
			name := deref(sku.Name)
			if deref(sku.ResourceType) != "virtualMachines" || !want[strings.ToLower(name)] || restricted(sku, loc) {
				continue
			}
			delete(want, strings.ToLower(name))
			// The pool's spelling, which Fit and the placement use.
			i := slices.IndexFunc(sizes, func(s string) bool { return strings.EqualFold(s, name) })
			out = append(out, sizeOf(sizes[i], sku))
		}
	}
	if len(want) > 0 {
		var missing []string
		for _, s := range sizes {
			if want[strings.ToLower(s)] {
				missing = append(missing, s)
			}
		}
		return nil, provider.Rejected(fmt.Errorf("Azure offers %s in none of the locations %s (resource SKUs)", strings.Join(missing, ", "), strings.Join(p.opt.Section.Locations, ", ")))
	}
	return out, nil
}

// restricted says whether a SKU may not be deployed in a location by
// this subscription (a Location restriction, NotAvailableForSubscription).
func restricted(sku *armcompute.ResourceSKU, loc string) bool {
	for _, r := range sku.Restrictions {
		if r == nil || r.Type == nil || *r.Type != armcompute.ResourceSKURestrictionsTypeLocation {
			continue
		}
		for _, v := range r.Values {
			if strings.EqualFold(deref(v), loc) {
				return true
			}
		}
	}
	return false
}

// sizeOf reads a SKU's capabilities.
func sizeOf(name string, sku *armcompute.ResourceSKU) vm.Size {
	s := vm.Size{Type: name}
	for _, c := range sku.Capabilities {
		if c == nil {
			continue
		}
		v, err := strconv.ParseFloat(deref(c.Value), 64)
		if err != nil {
			continue
		}
		switch deref(c.Name) {
		case "vCPUs":
			s.CPUs = v
		case "MemoryGB": // GiB, possibly fractional (0.5 for a B1ls)
			s.Memory = int64(v * (1 << 30))
		case "GPUs":
			s.GPUs = int(v)
		}
	}
	if s.GPUs > 0 {
		s.GPU = gpuOf(name)
	}
	return s
}

// seriesGPU is the GPU model of the N-series whose size names do not
// give it, by the series' letters and version ("Sizes for virtual
// machines in Azure", learn.microsoft.com/azure/virtual-machines/sizes):
// later series name it (NC4as_T4_v3, NC24ads_A100_v4, NC40ads_H100_v5).
var seriesGPU = map[string]string{
	"NC": "k80", "NC_v2": "p100", "NC_v3": "v100",
	"ND": "p40", "ND_v2": "v100", "ND_v4": "a100",
	"NV": "m60", "NV_v3": "m60",
}

// gpuOf is the model of a size's GPUs, as hardware labels name it: the
// accelerator part of its name ("[Family][Sub-family][vCPUs][Additive
// features]_[Accelerator]_[Version]", Azure's naming conventions), or its
// series'. "" where neither says.
func gpuOf(size string) string {
	parts := strings.Split(strings.TrimPrefix(size, "Standard_"), "_")
	if len(parts) == 3 {
		return gpu.Model(parts[1])
	}
	// The family's letters, up to its vCPUs: NC6s is NC, ND96asr ND.
	series := strings.ToUpper(parts[0])
	if i := strings.IndexFunc(series, unicode.IsDigit); i >= 0 {
		series = series[:i]
	}
	if len(parts) == 2 {
		series += "_" + strings.ToLower(parts[1])
	}
	return seriesGPU[series]
}

// CheckShapes refuses at start a dynamic pool whose limits let a job ask
// for GPUs that none of its VM sizes has (provider.ShapeChecker).
func (p *Provider) CheckShapes(ctx context.Context, l dynamic.Limits) error {
	return p.catalogue.Check(ctx, l, p.opt.Logger)
}
