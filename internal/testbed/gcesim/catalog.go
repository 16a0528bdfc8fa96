package gcesim

import (
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"cloud.google.com/go/billing/apiv1/billingpb"
	"google.golang.org/genproto/googleapis/type/money"
	"google.golang.org/protobuf/encoding/protojson"
)

// The Cloud Billing Catalog API's services.skus.list for Compute Engine
// (cloud.google.com/billing/v1/how-tos/catalog-api; the Sku schema of
// cloud.google.com/billing/docs/reference/rest/v1/services.skus), on the
// stand-in's endpoint: GET /v1/services/6F81-5844-456A/skus, paged by
// pageSize (5000 at most) and pageToken, with the bearer token of a
// service account whose scopes allow billing (cloud-billing.readonly,
// cloud-billing or cloud-platform; another token is refused 403
// ACCESS_TOKEN_SCOPE_INSUFFICIENT, as Google does). A machine type is
// not a SKU: its price is its vCPUs' and memory's SKUs by the hour, and
// its GPUs' ("VM instance pricing", cloud.google.com/compute/vm-instance-pricing).
// The descriptions are Google's: "N2 Instance Core running in Americas",
// "Spot Preemptible N2 Instance Ram running in Belgium", "Nvidia Tesla T4
// GPU attached to Spot Preemptible VMs running in Americas" (the Cloud
// Billing API reference's own example of a SKU's name).
// Beside each family's SKUs the catalog lists the ones a reader must pass
// over: custom, sole-tenancy and committed-use ones, licences.

// ComputeService is Compute Engine's service id in the catalog.
const ComputeService = "6F81-5844-456A"

// partPrice is a family's vCPU and memory (GiB) price by the hour in
// us-central1, on demand and Spot: Google's published ones.
type partPrice struct{ core, ram, spotCore, spotRAM float64 }

var familyPrices = map[string]partPrice{
	"E2": {0.021811, 0.002923, 0.006543, 0.000877},
	"N1": {0.031611, 0.004237, 0.006655, 0.000892},
	"N2": {0.031611, 0.004237, 0.007650, 0.001025},
	"G2": {0.024988, 0.002927, 0.009995, 0.001171},
	"A2": {0.031611, 0.004237, 0.012644, 0.001695},
	"A3": {0.031611, 0.004237, 0.012644, 0.001695},
}

// gpuPrices are each GPU's price by the hour in us-central1, on demand
// and Spot, with the name its SKU gives it.
var gpuPrices = map[string]struct {
	name       string
	price, spt float64
}{
	"nvidia-l4":         {"Nvidia L4", 0.5600, 0.2240},
	"nvidia-tesla-t4":   {"Nvidia Tesla T4", 0.35, 0.14},
	"nvidia-tesla-a100": {"Nvidia Tesla A100", 2.933908, 1.173563},
	"nvidia-a100-80gb":  {"Nvidia Tesla A100 80GB", 3.92848, 1.571392},
	"nvidia-h100-80gb":  {"Nvidia H100 80GB", 11.061250, 4.424500},
}

// regionFactor is what a region costs against us-central1.
var regionFactor = map[string]float64{"us-central1": 1, "us-east1": 1, "us-west1": 1, "europe-west1": 1.1, "europe-north1": 1.1}

// regionName is the place the SKUs of a region name ("running in
// Americas" for every American region, as Google's do).
func regionName(region string) string {
	switch {
	case strings.HasPrefix(region, "us-"):
		return "Americas"
	case region == "europe-west1":
		return "Belgium"
	case region == "europe-north1":
		return "Finland"
	}
	return region
}

// MachinePrice is what the stand-in's catalog adds up to for a machine
// type in a zone, with gpus of accelerator attached (an N1 type's; a type
// that carries its own ignores them): for a test to check a price
// against.
func MachinePrice(typ, zone string, spot bool, accelerator string, gpus int) float64 {
	region := zone[:strings.LastIndex(zone, "-")]
	f := regionFactor[region]
	mi := machineInfos[typ]
	fp := familyPrices[strings.ToUpper(strings.SplitN(typ, "-", 2)[0])]
	core, ram := fp.core, fp.ram
	if spot {
		core, ram = fp.spotCore, fp.spotRAM
	}
	p := float64(mi.cpus)*round6(core*f) + float64(mi.memoryMB)/1024*round6(ram*f)
	if mi.gpus > 0 {
		accelerator, gpus = mi.gpuType, int(mi.gpus)
	}
	if g, ok := gpuPrices[accelerator]; ok && gpus > 0 {
		gp := g.price
		if spot {
			gp = g.spt
		}
		p += float64(gpus) * round6(gp*f)
	}
	return p
}

func round6(v float64) float64 { return math.Round(v*1e6) / 1e6 }

// skus makes the catalog: every family's and GPU's SKUs in each region
// of the stand-in's zones, and the ones to pass over.
func skus() []*billingpb.Sku {
	var regions []string
	for _, z := range Zones {
		regions = append(regions, z[:strings.LastIndex(z, "-")])
	}
	slices.Sort(regions)
	regions = slices.Compact(regions)
	var out []*billingpb.Sku
	n := 0
	sku := func(desc, group, usage, unit string, regions []string, price float64, family string) {
		n++
		id := fmt.Sprintf("%04X-%04X-%04X", n, n*7%65536, n*13%65536)
		units, nanos := math.Modf(round6(price))
		out = append(out, &billingpb.Sku{
			Name: "services/" + ComputeService + "/skus/" + id, SkuId: id, Description: desc,
			Category:       &billingpb.Category{ServiceDisplayName: "Compute Engine", ResourceFamily: family, ResourceGroup: group, UsageType: usage},
			ServiceRegions: regions,
			PricingInfo: []*billingpb.PricingInfo{{
				Summary: "", CurrencyConversionRate: 1,
				PricingExpression: &billingpb.PricingExpression{
					UsageUnit: unit, BaseUnit: "s", DisplayQuantity: 1,
					TieredRates: []*billingpb.PricingExpression_TierRate{
						{StartUsageAmount: 0, UnitPrice: &money.Money{CurrencyCode: "USD", Units: int64(units), Nanos: int32(math.Round(nanos * 1e9))}},
					},
				},
			}},
			ServiceProviderName: "Google",
		})
	}
	for _, region := range regions {
		f, at := regionFactor[region], " running in "+regionName(region)
		for _, fam := range slices.Sorted(maps.Keys(familyPrices)) {
			fp := familyPrices[fam]
			name := fam + " Instance"
			if fam == "N1" {
				name = "N1 Predefined Instance"
			}
			// Passed over: custom, sole tenancy, commitments, a licence.
			sku(fam+" Custom Instance Core"+at, "CPU", "OnDemand", "h", []string{region}, fp.core*1.05*f, "Compute")
			sku(fam+" Sole Tenancy Instance Core"+at, "CPU", "OnDemand", "h", []string{region}, fp.core*1.1*f, "Compute")
			sku("Commitment v1: "+fam+" Cpu in "+regionName(region)+" for 1 Year", "CPU", "Commit1Yr", "h", []string{region}, fp.core*0.63*f, "Compute")
			sku(name+" Core"+at, "CPU", "OnDemand", "h", []string{region}, fp.core*f, "Compute")
			sku(name+" Ram"+at, "RAM", "OnDemand", "GiBy.h", []string{region}, fp.ram*f, "Compute")
			sku("Spot Preemptible "+name+" Core"+at, "CPU", "Preemptible", "h", []string{region}, fp.spotCore*f, "Compute")
			sku("Spot Preemptible "+name+" Ram"+at, "RAM", "Preemptible", "GiBy.h", []string{region}, fp.spotRAM*f, "Compute")
		}
		sku("Licensing Fee for Ubuntu Pro on VM with 4 VCPU", "Ubuntu", "OnDemand", "h", []string{region}, 0.01, "License")
		for _, g := range slices.Sorted(maps.Keys(gpuPrices)) {
			gp := gpuPrices[g]
			sku("Commitment v1: "+gp.name+" GPU in "+regionName(region)+" for 1 Year", "GPU", "Commit1Yr", "h", []string{region}, gp.price*0.63*f, "Compute")
			// A GPU's SKUs name the VMs it is attached to.
			sku(gp.name+" GPU attached to VMs"+at, "GPU", "OnDemand", "h", []string{region}, gp.price*f, "Compute")
			sku(gp.name+" GPU attached to Spot Preemptible VMs"+at, "GPU", "Preemptible", "h", []string{region}, gp.spt*f, "Compute")
		}
	}
	return out
}

// billingScopes are the scopes that may read the catalog.
var billingScopes = []string{
	"https://www.googleapis.com/auth/cloud-billing.readonly", "https://www.googleapis.com/auth/cloud-billing",
	"https://www.googleapis.com/auth/cloud-platform",
}

// listSKUs answers services.skus.list.
func (s *Server) listSKUs(w http.ResponseWriter, r *http.Request) {
	scopes, ok := s.tokenScopes(r)
	if !ok {
		(&apiError{http.StatusUnauthorized, "authError", "Request had invalid authentication credentials."}).write(w)
		return
	}
	allowed := false
	for _, sc := range strings.Fields(scopes) {
		allowed = allowed || slices.Contains(billingScopes, sc)
	}
	if !allowed {
		(&apiError{http.StatusForbidden, "ACCESS_TOKEN_SCOPE_INSUFFICIENT", "Request had insufficient authentication scopes."}).write(w)
		return
	}
	s.mu.Lock()
	s.calls["services.skus.list"]++
	down := s.down
	s.mu.Unlock()
	if down {
		(&apiError{http.StatusServiceUnavailable, "backendError", "The service is currently unavailable."}).write(w)
		return
	}
	if r.PathValue("service") != ComputeService {
		notFound("services/" + r.PathValue("service")).write(w)
		return
	}
	if c := r.URL.Query().Get("currencyCode"); c != "" && c != "USD" {
		(&apiError{http.StatusBadRequest, "badRequest", "The stand-in prices in USD only: " + c}).write(w)
		return
	}
	all := skus()
	size := 5000
	if v := r.URL.Query().Get("pageSize"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			invalid("Invalid pageSize: %s", v).write(w)
			return
		}
		size = min(n, 5000)
	}
	start := 0
	if tok := r.URL.Query().Get("pageToken"); tok != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(tok, "skus-"))
		if err != nil || n < 0 || n > len(all) {
			invalid("Invalid page token").write(w)
			return
		}
		start = n
	}
	end := min(start+size, len(all))
	out := &billingpb.ListSkusResponse{Skus: all[start:end]}
	if end < len(all) {
		out.NextPageToken = "skus-" + strconv.Itoa(end)
	}
	b, _ := protojson.Marshal(out)
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	_, _ = w.Write(b)
}
