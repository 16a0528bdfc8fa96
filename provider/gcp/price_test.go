package gcp_test

import (
	"math"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/provider/gcp"
	"github.com/runfleet/runfleet/record"
)

// TestPriceFromTheCatalog: an instance's price is its vCPUs', memory's
// and GPUs' SKUs in its region, on demand or Spot: a G2 type with the L4s
// it carries, an N1 type with the pool's T4s attached, in a European
// region at its own prices; the catalog (thousands of SKUs on Google) is
// read once for all of them.
func TestPriceFromTheCatalog(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\naccelerator: {type: nvidia-tesla-t4, count: 2}\n")
	ctx := t.Context()
	for _, c := range []struct {
		typ, zone string
		spot      bool
	}{
		{"g2-standard-48", "us-central1-a", false},
		{"g2-standard-4", "us-central1-b", true},
		{"n1-standard-8", "us-central1-a", false},
		{"n1-standard-8", "europe-west1-d", true},
		{"e2-standard-4", "us-east1-c", false},
	} {
		pr, err := p.Price(ctx, record.Machine{InstanceType: c.typ, Zone: c.zone, Spot: c.spot}, time.Now())
		want := gcesim.MachinePrice(c.typ, c.zone, c.spot, "nvidia-tesla-t4", 2)
		if err != nil || math.Abs(pr.PerHour-want) > 1e-9 || pr.Currency != "USD" || pr.Source != gcp.SourceCatalog {
			t.Errorf("%s in %s (spot %v): %+v, %v; want %.6f USD from %q", c.typ, c.zone, c.spot, pr, err, want, gcp.SourceCatalog)
		}
	}
	if n := sim.Calls()["services.skus.list"]; n != 1 {
		t.Errorf("%d catalog reads, want 1", n)
	}
	if _, err := p.Price(ctx, record.Machine{InstanceType: "c3-standard-4", Zone: "us-central1-a"}, time.Now()); err == nil {
		t.Error("a type the stand-in does not have was priced")
	}
}
