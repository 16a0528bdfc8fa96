package gcp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	billing "cloud.google.com/go/billing/apiv1"
	"cloud.google.com/go/billing/apiv1/billingpb"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// A Compute Engine instance's price is not listed by machine type: the
// Cloud Billing Catalog lists Compute Engine's SKUs, one for a family's
// vCPU by the hour in a region ("N2 Instance Core running in Americas"),
// one for its memory by the GiB-hour ("N2 Instance Ram ..."), one for
// each GPU ("Nvidia L4 GPU running in ..."), each again for Spot ("Spot
// Preemptible N2 Instance Core ..."), as Google's own pricing pages add
// them up (cloud.google.com/compute/vm-instance-pricing). The type's
// vCPUs, memory and GPUs come from machineTypes.get (sizes.go).

// ComputeService is Compute Engine's service in the catalog
// (cloud.google.com/billing/v1/how-tos/catalog-api).
const ComputeService = "services/6F81-5844-456A"

// BillingScope is the OAuth scope the catalog is read with.
const BillingScope = "https://www.googleapis.com/auth/cloud-billing.readonly"

// SourceCatalog is where a price comes from, as a record names it.
const SourceCatalog = "gcp billing catalog"

// catalogKeep is how long the SKUs read are kept: Google changes prices
// at most monthly, with notice.
const catalogKeep = 24 * time.Hour

// Catalog lists Compute Engine's SKUs (the Cloud Billing Catalog API's
// services.skus.list, in US dollars).
type Catalog interface {
	SKUs(ctx context.Context) ([]*billingpb.Sku, error)
}

// catalogClient is Catalog through the Cloud Billing client.
type catalogClient struct{ c *billing.CloudCatalogClient }

func (c catalogClient) SKUs(ctx context.Context) ([]*billingpb.Sku, error) {
	it := c.c.ListSkus(ctx, &billingpb.ListSkusRequest{Parent: ComputeService, CurrencyCode: "USD", PageSize: 5000})
	var out []*billingpb.Sku
	for {
		sku, err := it.Next()
		if err == iterator.Done {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, sku)
	}
}

// skuCache keeps the SKUs read.
type skuCache struct {
	mu   sync.Mutex
	skus []*billingpb.Sku
	read time.Time
}

func (c *skuCache) get(ctx context.Context, cat Catalog, now time.Time) ([]*billingpb.Sku, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.skus != nil && now.Sub(c.read) < catalogKeep {
		return c.skus, nil
	}
	skus, err := cat.SKUs(ctx)
	if err != nil {
		return nil, err
	}
	c.skus, c.read = skus, now
	return skus, nil
}

// Price is what an instance costs by the hour in its zone's region, on
// demand or Spot: its vCPUs, memory and GPUs at their SKUs' prices. A
// Spot instance is billed at the Spot price of the moment; the catalog
// gives only the current one, so at is not read.
func (p *Provider) Price(ctx context.Context, m record.Machine, _ time.Time) (record.Price, error) {
	if p.opt.Catalog == nil {
		return record.Price{}, fmt.Errorf("gcp billing catalog: not read for this pool: %w", provider.ErrNotPriced)
	}
	if m.InstanceType == "" || m.Zone == "" {
		return record.Price{}, fmt.Errorf("gcp billing catalog: no machine type or zone: %w", provider.ErrNotPriced)
	}
	region := m.Zone[:max(strings.LastIndex(m.Zone, "-"), 0)]
	cpus, mem, accel, gpus, err := p.machineOf(ctx, m.Zone, m.InstanceType)
	if err != nil {
		return record.Price{}, err
	}
	skus, err := p.skus.get(ctx, p.opt.Catalog, p.opt.now())
	if err != nil {
		return record.Price{}, catalogError(err)
	}
	family := strings.ToUpper(strings.SplitN(m.InstanceType, "-", 2)[0])
	if family == "CUSTOM" {
		family = "N1" // custom-CPUS-MEMORY is an N1 custom type
	}
	core, err := unitPrice(skus, region, m.Spot, partRE(family, "Core"))
	if err != nil {
		return record.Price{}, fmt.Errorf("gcp billing catalog: %s vCPU in %s: %w", family, region, err)
	}
	ram, err := unitPrice(skus, region, m.Spot, partRE(family, "Ram"))
	if err != nil {
		return record.Price{}, fmt.Errorf("gcp billing catalog: %s memory in %s: %w", family, region, err)
	}
	price := cpus*core + float64(mem)/(1<<30)*ram
	if gpus > 0 && accel != "" {
		g, err := unitPrice(skus, region, m.Spot, gpuRE(accel))
		if err != nil {
			return record.Price{}, fmt.Errorf("gcp billing catalog: %s in %s: %w", accel, region, err)
		}
		price += float64(gpus) * g
	}
	return record.Price{PerHour: price, Currency: "USD", Source: SourceCatalog}, nil
}

// machineOf is what a machine type has in a zone: its vCPUs, memory, and
// GPUs, those it carries (G2's L4, A2's A100) or the pool's accelerator.
func (p *Provider) machineOf(ctx context.Context, zone, typ string) (cpus float64, mem int64, accel string, gpus int, err error) {
	if m := customRE.FindStringSubmatch(typ); m != nil {
		size, _ := p.sizeOf(ctx, typ)
		cpus, mem = size.CPUs, size.Memory
	} else {
		mt, err := p.machineType(ctx, typ, []string{zone})
		if err != nil || mt == nil {
			return 0, 0, "", 0, fmt.Errorf("gcp price: machine type %s in %s: %w", typ, zone, cmp.Or(err, provider.ErrNotPriced))
		}
		cpus, mem = float64(mt.GetGuestCpus()), int64(mt.GetMemoryMb())<<20
		for _, a := range mt.GetAccelerators() {
			accel, gpus = a.GetGuestAcceleratorType(), gpus+int(a.GetGuestAcceleratorCount())
		}
	}
	if a := p.opt.Section.Accelerator; gpus == 0 && a.Type != "" {
		accel, gpus = a.Type, a.Count
	}
	return cpus, mem, accel, gpus, nil
}

// partRE matches a family's vCPU or memory SKU: "N2 Instance Core running
// in Americas", "N1 Predefined Instance Ram running in Belgium", "Spot
// Preemptible E2 Instance Core running in Americas".
func partRE(family, part string) *regexp.Regexp {
	return regexp.MustCompile(`^(Spot Preemptible )?` + regexp.QuoteMeta(family) + ` (Predefined )?Instance ` + part + ` running in `)
}

// gpuRE matches a GPU's SKU from its accelerator type, as the catalog
// names it with the VMs it is attached to: nvidia-tesla-t4 is "Nvidia
// Tesla T4 GPU attached to VMs running in ..." and "... attached to Spot
// Preemptible VMs running in ..." (the Cloud Billing API reference's
// example), nvidia-l4 "Nvidia L4 GPU ...", nvidia-a100-80gb "Nvidia Tesla
// A100 80GB GPU ..."; older SKUs say only "GPU running in".
func gpuRE(accel string) *regexp.Regexp {
	words := strings.Split(strings.TrimPrefix(accel, "nvidia-"), "-")
	name := `(Tesla )?`
	if words[0] == "tesla" {
		name, words = `Tesla `, words[1:]
	}
	for i, w := range words {
		if i > 0 {
			name += " "
		}
		name += regexp.QuoteMeta(w)
	}
	return regexp.MustCompile(`(?i)^(Spot Preemptible )?Nvidia ` + name + ` GPU (?:attached to (Spot Preemptible )?VMs )?running in `)
}

// unitPrice is the price of the SKU in region whose description matches,
// on demand or Spot ("Preemptible" usage): its first tier's rate that is
// not free.
func unitPrice(skus []*billingpb.Sku, region string, spot bool, desc *regexp.Regexp) (float64, error) {
	usage := "OnDemand"
	if spot {
		usage = "Preemptible"
	}
	for _, s := range skus {
		c := s.GetCategory()
		m := desc.FindStringSubmatch(s.GetDescription())
		if m == nil || c.GetResourceFamily() != "Compute" || c.GetUsageType() != usage || spotSKU(m) != spot ||
			!slices.Contains(s.GetServiceRegions(), region) {
			continue
		}
		for _, info := range s.GetPricingInfo() {
			for _, r := range info.GetPricingExpression().GetTieredRates() {
				if u := r.GetUnitPrice(); u.GetUnits() > 0 || u.GetNanos() > 0 {
					return float64(u.GetUnits()) + float64(u.GetNanos())/1e9, nil
				}
			}
		}
	}
	return 0, provider.ErrNotPriced
}

// spotSKU says whether a matched description is a Spot one: "Spot
// Preemptible" leading it, or the VMs a GPU is attached to.
func spotSKU(m []string) bool {
	for _, g := range m[1:] {
		if strings.HasPrefix(g, "Spot Preemptible") {
			return true
		}
	}
	return false
}

// catalogError wraps a catalog call's error: a refusal (the API not
// enabled in the project, a token without the billing scope) as one no
// retry fixes.
func catalogError(err error) error {
	var ge *googleapi.Error
	if errors.As(err, &ge) && (ge.Code == http.StatusForbidden || ge.Code == http.StatusUnauthorized || ge.Code == http.StatusNotFound) {
		return fmt.Errorf("gcp billing catalog: %w", provider.Rejected(err))
	}
	return fmt.Errorf("gcp billing catalog: %w", err)
}
