package daemon_test

import (
	"context"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/record"
)

// A pool that names no price has its runners' records priced from its
// provider's price list (provider.Pricer), in the background, once for
// every machine of a kind (a price in the pool's config comes first:
// pricing's TestRecordsPricedOnceForEachMachineKind).
func TestCloudPricesFillRecords(t *testing.T) {
	t.Setenv("TOY_FORGE_TOKEN", "x")
	fleet, f := toyFleetOn(t, t.TempDir())
	v, _ := toyProviders.Load("toys")
	p := v.(*toyProvider)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { fleet.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	// Two runners in turn: the second is priced from the answer kept.
	first := waitOne(t, p, "")
	f.set(first.inst.Name, forge.StatusBusy)
	waitState(t, fleet, "busy")
	f.end(first.inst.Name)
	p.exit(first.inst.Name)
	waitOne(t, p, first.inst.ID)

	deadline := time.Now().Add(10 * time.Second)
	var recs []record.Record
	for {
		var err error
		recs, err = fleet.Jobs(history.Query{All: true})
		if err != nil {
			t.Fatal(err)
		}
		priced := 0
		for _, r := range recs {
			if r.Price != nil {
				priced++
			}
		}
		if len(recs) == 2 && priced == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("records %+v: want 2, both priced", recs)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, r := range recs {
		if pr := *r.Price; pr.PerHour != toyPricePerHour || pr.Currency != "USD" || pr.Source != "toy price list" {
			t.Errorf("record of %s priced %+v, want %v USD from the toy price list", r.Runner, pr, toyPricePerHour)
		}
		if r.Machine.InstanceType != "toy.small" {
			t.Errorf("record of %s: machine %+v", r.Runner, r.Machine)
		}
	}
	p.mu.Lock()
	calls := p.priced
	p.mu.Unlock()
	if calls != 1 {
		t.Errorf("the price list was asked %d times for two machines of one kind, want once", calls)
	}
}
