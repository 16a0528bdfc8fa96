package gcp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/gcp"
	"github.com/runfleet/runfleet/provider/vm"
)

// createAll asks for the runners' instances at once, as a pool's burst
// does, and returns them by runner.
func createAll(t *testing.T, p *gcp.Provider, names ...string) map[string]provider.Instance {
	t.Helper()
	insts := make([]provider.Instance, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() { insts[i], errs[i] = p.Create(context.Background(), spec(name)) })
	}
	wg.Wait()
	out := map[string]provider.Instance{}
	for i, name := range names {
		if errs[i] != nil {
			t.Fatalf("%s: %v", name, errs[i])
		}
		out[name] = insts[i]
	}
	return out
}

func runners(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("gpu-%d", i+1)
	}
	return out
}

// With handoff_url a burst goes out in bulk inserts, not an insert a
// runner. The instances carry only the pool's labels and metadata; each
// is still listed as its runner's (from its name), also by a manager
// started afresh, and claims its own runner's assignment.
func TestBurstGoesOutInBulk(t *testing.T) {
	p, sim, desk := handoffPool(t)
	insts := createAll(t, p, runners(12)...)
	calls := sim.Calls()
	// The first Create may go alone, before the others arrive.
	if calls["instances.insert"] != 0 || calls["instances.bulkInsert"] < 1 || calls["instances.bulkInsert"] > 2 {
		t.Errorf("calls %v: want one or two bulk inserts for 12 runners, and no insert", calls)
	}
	for _, in := range sim.Instances() {
		if in.Labels[gcp.LabelRunner] != "" || in.Metadata[gcp.LabelRunner] != "" {
			t.Errorf("instance %s names its runner in its labels or metadata, which a bulk insert's instances share", in.Name)
		}
	}
	fresh := open(t, "m1", sim, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\n")
	listed, err := fresh.List(context.Background(), "m1")
	if err != nil {
		t.Fatal(err)
	}
	if len(listed) != len(insts) {
		t.Errorf("a fresh manager lists %d instances, want %d", len(listed), len(insts))
	}
	for _, l := range listed {
		if insts[l.Name].ID != l.ID {
			t.Errorf("instance %s is listed as runner %q's, whose instance is %s", l.ID, l.Name, insts[l.Name].ID)
		}
	}

	onGCEInstance(t, sim, insts["gpu-7"].ID)
	a, err := vm.ClaimFrom(context.Background(), http.DefaultClient, desk, func(ctx context.Context, audience string) (string, error) {
		return metadataGet(ctx, "instance/service-accounts/default/identity?format=full&audience="+url.QueryEscape(audience))
	})
	if err != nil || a.Runner != "gpu-7" {
		t.Fatalf("gpu-7's instance got %q (%v), want gpu-7's assignment", a.Runner, err)
	}
}

// A bulk insert makes what fits; the rest are asked of the next zone,
// and every runner gets one instance.
func TestBulkInsertTakesWhatFitsThenTheNextZone(t *testing.T) {
	p, sim, _ := handoffPool(t, "us-central1-a", "us-central1-b")
	sim.LimitCapacity("STANDARD", "n1-standard-8", "us-central1-a", 3)
	// gpu-1 goes alone; the other four wait behind it and go together,
	// and only 2 of them fit where 3 did.
	open := make(chan struct{})
	held := gcp.HoldLaunches(p, open)
	var first provider.Instance
	var firstErr error
	done := make(chan struct{})
	go func() { first, firstErr = p.Create(context.Background(), spec("gpu-1")); close(done) }()
	if n := <-held; n != 1 {
		t.Fatalf("the first launch holds %d runners, want 1", n)
	}
	time.AfterFunc(500*time.Millisecond, func() { close(open) })
	insts := createAll(t, p, runners(5)[1:]...)
	<-done
	if firstErr != nil {
		t.Fatalf("gpu-1: %v", firstErr)
	}
	insts["gpu-1"] = first
	if n := <-held; n != 4 {
		t.Errorf("the second launch held %d runners, want 4", n)
	}
	zones := map[string]int{}
	for _, in := range sim.Instances() {
		if in.Deleted.IsZero() {
			zones[in.Zone]++
		}
	}
	if zones["us-central1-a"] != 3 || zones["us-central1-b"] != 2 || len(insts) != 5 {
		t.Errorf("instances by zone %v, want 3 in us-central1-a (its room) and 2 in us-central1-b", zones)
	}
	if c := sim.Calls(); c["instances.insert"] != 0 || c["instances.aggregatedList"] < 1 {
		t.Errorf("calls %v: want bulk inserts, and a listing of what the short one made", c)
	}
}

// A runner whose name an instance name cannot give back (a pool named
// with a digit first) is inserted alone.
func TestRunnerNotNameableIsInsertedAlone(t *testing.T) {
	p, sim, _ := handoffPool(t)
	inst, err := p.Create(context.Background(), spec("9gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	if c := sim.Calls(); c["instances.insert"] != 1 || c["instances.bulkInsert"] != 0 {
		t.Errorf("calls %v: want one insert", c)
	}
	listed, err := p.List(context.Background(), "m1")
	if err != nil || len(listed) != 1 || listed[0].Name != "9gpu-1" || listed[0].ID != inst.ID {
		t.Errorf("listed %+v (%v), want 9gpu-1's instance", listed, err)
	}
}

// The desk holds an assignment by the instance's zone and name, so it
// drops it when the instance is deleted: another instance given that
// name later, whose token names the same zone and name, gets nothing.
func TestDeletedInstanceNameClaimsNothing(t *testing.T) {
	p, sim, desk := handoffPool(t)
	inst := createAll(t, p, "gpu-1")["gpu-1"]
	onGCEInstance(t, sim, inst.ID) // its metadata server, kept past the deletion
	if err := p.Delete(context.Background(), "gpu-1"); err != nil {
		t.Fatal(err)
	}
	_, err := vm.ClaimFrom(context.Background(), http.DefaultClient, desk, func(ctx context.Context, audience string) (string, error) {
		return metadataGet(ctx, "instance/service-accounts/default/identity?format=full&audience="+url.QueryEscape(audience))
	})
	if !errors.Is(err, bootstrap.ErrNotYet) {
		t.Fatalf("a claim naming a deleted instance: %v, want nothing held (%v)", err, bootstrap.ErrNotYet)
	}
}
