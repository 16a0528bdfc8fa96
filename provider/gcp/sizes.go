package gcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/api/googleapi"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// What a dynamic pool's job may ask of its instance's size (cpu=, mem=,
// gpus=, gpu=) is met by choosing among the pool's machine_types those
// that have it, the smallest first (vm.Fit), from what Compute Engine
// says of each: machineTypes.get, read once per type, in the first of the
// pool's zones that offers it. A type that carries GPUs of its own (A2,
// A3, G2) has those; any other has the pool's accelerator, if any.

// customRE is a custom machine type's name, which says its size:
// [family-]custom-CPUS-MEMORY_MB[-ext] ("Create a VM with a custom
// machine type", docs.cloud.google.com/compute/docs/instances/creating-instance-with-custom-machine-type).
var customRE = lazyregexp.New(`^(?:[a-z0-9]+-)?custom-(\d+)-(\d+)(?:-ext)?$`)

// readSizes is what each of the pool's machine types has
// (vm.Catalogue.Read).
func (p *Provider) readSizes(ctx context.Context, types []string) ([]vm.Size, error) {
	s := p.opt.Section
	out := make([]vm.Size, 0, len(types))
	for _, t := range types {
		size, err := p.sizeOf(ctx, t)
		if err != nil {
			return nil, err
		}
		if a := s.Accelerator; size.GPUs == 0 && a.Type != "" {
			size.GPUs, size.GPU = a.Count, gpu.Model(a.Type)
		}
		out = append(out, size)
	}
	return out, nil
}

// sizeOf is what one machine type has: a custom type's from its name,
// a predefined one's as the first zone that offers it says.
func (p *Provider) sizeOf(ctx context.Context, typ string) (vm.Size, error) {
	if m := customRE.FindStringSubmatch(typ); m != nil {
		cpus, _ := strconv.Atoi(m[1])
		mb, _ := strconv.ParseInt(m[2], 10, 64)
		return vm.Size{Type: typ, CPUs: float64(cpus), Memory: mb << 20}, nil
	}
	zones := p.opt.Section.Zones
	mt, err := p.machineType(ctx, typ, zones)
	if err != nil || mt == nil {
		return vm.Size{}, err
	}
	size := vm.Size{Type: typ, CPUs: float64(mt.GetGuestCpus()), Memory: int64(mt.GetMemoryMb()) << 20}
	for _, a := range mt.GetAccelerators() {
		size.GPUs += int(a.GetGuestAcceleratorCount())
		size.GPU = gpu.Model(a.GetGuestAcceleratorType())
	}
	return size, nil
}

// machineType is machineTypes.get of a type in the first of zones that
// offers it, read once for the provider's life (a type has the same
// vCPUs, memory and GPUs in every zone): the catalogue and the prices
// share it. Nil, with no error, where none of the zones offers it.
func (p *Provider) machineType(ctx context.Context, typ string, zones []string) (*computepb.MachineType, error) {
	p.typesMu.Lock()
	mt, ok := p.types[typ]
	p.typesMu.Unlock()
	if ok {
		return mt, nil
	}
	for _, zone := range zones {
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		mt, err := p.opt.API.MachineType(cctx, p.opt.Project, zone, typ)
		cancel()
		var ge *googleapi.Error
		if errors.As(err, &ge) && ge.Code == http.StatusNotFound {
			continue // not offered in this zone
		}
		if err != nil {
			switch kind, _ := kindOf(err); kind {
			case errFatal:
				return nil, provider.Rejected(fmt.Errorf("get machine type %s in %s: %w", typ, zone, err))
			}
			return nil, fmt.Errorf("get machine type %s in %s: %w", typ, zone, err)
		}
		p.typesMu.Lock()
		if p.types == nil {
			p.types = map[string]*computepb.MachineType{}
		}
		p.types[typ] = mt
		p.typesMu.Unlock()
		return mt, nil
	}
	return nil, provider.Rejected(fmt.Errorf("machine type %s is offered in none of the zones %s", typ, strings.Join(zones, ", ")))
}

// CheckShapes refuses at start a dynamic pool whose limits let a job ask
// for GPUs that none of its machine types has (provider.ShapeChecker).
func (p *Provider) CheckShapes(ctx context.Context, l dynamic.Limits) error {
	return p.catalogue.Check(ctx, l, p.opt.Logger)
}
