package azure

import (
	"errors"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// TestPriceFromRetailPrices: a VM is priced from its size's Linux meter
// in its location, its Spot meter when Spot; the stand-in lists Windows,
// Low Priority, Dev/Test and reservation meters of the size before them.
func TestPriceFromRetailPrices(t *testing.T) {
	p, sim := newProvider(t, "vm_sizes: [Standard_NC4as_T4_v3]\nlocations: [westeurope]\nsubnet: "+armsim.SubnetID("westeurope")+"\n")
	p.opt.Prices = &RetailPrices{URL: sim.URL + "/api/retail/prices", Client: sim.HTTPClient()}
	ctx := t.Context()
	for _, spot := range []bool{false, true} {
		m := record.Machine{InstanceType: "Standard_NC4as_T4_v3", Zone: "westeurope", Spot: spot}
		pr, err := p.Price(ctx, m, time.Now())
		want := armsim.RetailPrice(m.InstanceType, m.Zone, spot)
		if err != nil || pr.PerHour != want || pr.Currency != "USD" || pr.Source != SourceRetail {
			t.Errorf("spot=%v: %+v, %v; want %v USD from %q", spot, pr, err, want, SourceRetail)
		}
	}
	if _, err := p.Price(ctx, record.Machine{InstanceType: "Standard_NC12", Zone: "eastus"}, time.Now()); !errors.Is(err, provider.ErrNotPriced) {
		t.Errorf("a size without a meter: %v, want ErrNotPriced", err)
	}
}

// TestRetailPricesPaged: an answer over several pages is followed to the
// meter wanted; a filter the API refuses is an error no retry fixes.
func TestRetailPricesPaged(t *testing.T) {
	sim := newSim(t)
	rp := &RetailPrices{URL: sim.URL + "/api/retail/prices", Client: sim.HTTPClient()}
	page, err := rp.get(t.Context(), rp.URL+"?$filter=serviceName%20eq%20'Virtual%20Machines'")
	if err != nil || len(page.Items) != 100 || page.NextPageLink == "" {
		t.Fatalf("first page: %d items, next %q, %v; want 100 and a next page", len(page.Items), page.NextPageLink, err)
	}
	_, err = rp.get(t.Context(), rp.URL+"?$filter=nosuchfield%20eq%20'x'")
	if !errors.Is(err, provider.ErrRejected) {
		t.Errorf("a filter refused: %v, want ErrRejected", err)
	}
}
