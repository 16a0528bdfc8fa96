package gcp_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/gcp"
	"github.com/runfleet/runfleet/provider/vm"
)

const image = "projects/runfleet-e2e/global/images/runner-1"

// newProvider is a pool's provider on the stand-in, with instances that
// run nothing, its credentials in CML's variable.
func newProvider(t *testing.T, section string) (*gcp.Provider, *gcesim.Server) {
	t.Helper()
	sim, err := gcesim.New(gcesim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	t.Setenv(gcp.CredentialsDataEnv, string(sim.Credentials()))
	return open(t, "m1", sim, section), sim
}

func open(t *testing.T, manager string, sim *gcesim.Server, section string) *gcp.Provider {
	t.Helper()
	d, ok := provider.Lookup("gcp")
	if !ok {
		t.Fatal("gcp is not registered")
	}
	raw := mustJSON(t, "endpoint: "+sim.URL+"\nbilling_endpoint: "+sim.URL+"\nimage: "+image+"\npoll_interval: 1s\n"+section)
	p, err := d.Open(t.Context(), provider.PoolConfig{Manager: manager, Pool: "gpu", Section: raw, MaxLifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	gp := p.(*gcp.Provider)
	t.Cleanup(func() { gp.Close() })
	return gp
}

func spec(name string) provider.Spec {
	return provider.Spec{Name: name, Manager: "m1", Pool: "gpu", Command: "gitea-runner", Args: []string{"daemon"},
		Env: map[string]string{"A": "b"}, Files: map[string][]byte{".runner": []byte(`{"token":"single-use"}`)}, BusyMarker: " repo is "}
}

func TestCreateListDelete(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\naccelerator: {type: nvidia-tesla-t4}\nspot: true\nlabels: {team: ml}\ndisk: {size_gb: 100}\n")
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := p.Create(ctx, spec("gpu-1"))
	if err != nil || again.ID != inst.ID {
		t.Fatalf("a second Create of gpu-1 made %s (%v), want %s again", again.ID, err, inst.ID)
	}
	all := sim.Instances()
	if len(all) != 1 {
		t.Fatalf("%d instances, want 1", len(all))
	}
	in := all[0]
	for k, v := range map[string]string{gcp.LabelManager: "m1", gcp.LabelPool: "gpu", gcp.LabelRunner: "gpu-1", "team": "ml"} {
		if in.Labels[k] != v {
			t.Errorf("label %s = %q, want %q (labels %v)", k, in.Labels[k], v, in.Labels)
		}
	}
	if in.Model != "SPOT" || in.Type != "n1-standard-8" || in.Accelerators != 1 || !strings.HasPrefix(in.Name, "gpu-1-") {
		t.Errorf("instance %s: model %s type %s accelerators %d", in.Name, in.Model, in.Type, in.Accelerators)
	}
	if d := sim.Disks(); len(d) != 1 || !d[0].AutoDelete || d[0].Labels[gcp.LabelRunner] != "gpu-1" {
		t.Errorf("disks %+v, want one auto-deleted boot disk labelled with the runner", d)
	}
	script := in.Metadata["startup-script"]
	if !strings.HasPrefix(script, "#!/bin/sh\n") || !strings.Contains(script, "exec 'runfleet' agent --plan "+vm.PlanPath) {
		t.Errorf("startup-script:\n%s", script)
	}
	other := open(t, "m2", sim, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\n")
	if l, err := other.List(ctx, "m2"); err != nil || len(l) != 0 {
		t.Errorf("manager m2 lists %v (%v), want nothing", l, err)
	}
	if l, err := other.List(ctx, "m1"); err != nil || len(l) != 1 || l[0].Name != "gpu-1" {
		t.Errorf("manager m2 listing m1's (gc) = %v (%v)", l, err)
	}
	eventually(t, "running", func() bool {
		l, _ := p.List(ctx, "m1")
		return len(l) == 1 && l[0].State == provider.StateRunning && l[0].Name == "gpu-1"
	})
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if l, _ := p.List(ctx, "m1"); len(l) != 0 {
		t.Errorf("after Delete, List = %v", l)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Errorf("deleting a gone runner: %v", err)
	}
	eventually(t, "deleted with its disk", func() bool { return !sim.Instances()[0].Deleted.IsZero() && len(sim.Disks()) == 0 })
	t.Logf("calls: %v", sim.Calls())
}

// A stockout falls through the zones, then the types, then to a
// standard instance; a spent regional quota to the next zone's region.
func TestCapacityFallsThroughZonesTypesThenStandard(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a, us-east1-c]\nmachine_types: [g2-standard-4, n1-standard-8]\nspot: true\nspot_fallback: on_demand\n")
	sim.NoCapacity("SPOT", "g2-standard-4", "")
	sim.NoCapacity("SPOT", "", "us-central1-a")
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	list := sim.Instances()
	if in := list[len(list)-1]; in.Type != "n1-standard-8" || in.Zone != "us-east1-c" || in.Model != "SPOT" {
		t.Errorf("got %s in %s (%s), want n1-standard-8 in us-east1-c, spot", in.Type, in.Zone, in.Model)
	}
	sim.NoCapacity("SPOT", "", "")
	sim.NoQuota("us-central1")
	if _, err := p.Create(context.Background(), spec("gpu-2")); err != nil {
		t.Fatal(err)
	}
	list = sim.Instances()
	if in := list[len(list)-1]; in.Type != "g2-standard-4" || in.Zone != "us-east1-c" || in.Model != "STANDARD" {
		t.Errorf("got %s in %s (%s), want g2-standard-4 in us-east1-c, standard", in.Type, in.Zone, in.Model)
	}
	t.Logf("calls: %v", sim.Calls())
}

func TestNoCapacityWithoutFallback(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a, us-central1-b]\nmachine_types: [g2-standard-4]\nspot: true\n")
	sim.NoCapacity("SPOT", "", "")
	_, err := p.Create(context.Background(), spec("gpu-1"))
	if err == nil || errors.Is(err, provider.ErrRejected) {
		t.Fatalf("err = %v, want a retryable capacity error", err)
	}
	for _, want := range []string{"no capacity", "g2-standard-4 in us-central1-a: ZONE_RESOURCE_POOL_EXHAUSTED", "in us-central1-b", "spot_fallback: on_demand"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
	if n := sim.Calls()["instances.insert"]; n != 2 {
		t.Errorf("%d inserts, want 2", n)
	}
	if w := sim.Calls()["zoneOperations.wait"]; w < 2 || w > 4 {
		t.Errorf("%d operation waits for 2 inserts, want 2 to 4 (a wait holds until done)", w)
	}
}

func TestFatalErrorsAreRejected(t *testing.T) {
	_, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\n")
	for _, c := range []struct{ section, want string }{
		{"zones: [us-central1-a]\nmachine_types: [n1-standard-8]\nimage: projects/runfleet-e2e/global/images/gone\n", "was not found"},
		{"zones: [us-central1-a, us-central1-b]\nmachine_types: [n1-standard-8]\nproject: other-project\n", "projects/other-project"},
	} {
		p := open(t, "m1", sim, c.section)
		before := sim.Calls()["instances.insert"]
		_, err := p.Create(context.Background(), spec("gpu-1"))
		if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("err = %v, want ErrRejected naming %q", err, c.want)
		}
		if n := sim.Calls()["instances.insert"] - before; n != strings.Count(c.section, "us-central1-") {
			t.Errorf("%d calls, want one per zone, no retry", n)
		}
	}
}

func TestRateLimitBacksOff(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a, us-central1-b]\nmachine_types: [n1-standard-8]\n")
	sim.Fail("instances.insert", http.StatusForbidden, "rateLimitExceeded")
	_, err := p.Create(context.Background(), spec("gpu-1"))
	if err == nil || errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "request quota") {
		t.Fatalf("err = %v, want a retryable quota error", err)
	}
	if n := sim.Calls()["instances.insert"]; n != 1 {
		t.Errorf("%d inserts, want 1: the pool backs off, the next zone is not tried", n)
	}
	if p.Calls() != 1 {
		t.Errorf("counted %d calls, want 1", p.Calls())
	}
}

func TestSpotPreemptionNotice(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\nspot: true\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	notices := make(chan provider.Notice, 4)
	p.WatchPreemption(ctx, func(n provider.Notice) { notices <- n })
	var changes atomic.Int32
	p.Watch(ctx, func(string) { changes.Add(1) })
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "running", func() bool { return sim.Instances()[0].Status == "RUNNING" })
	before := sim.Calls()["globalOperations.aggregatedList"]
	if err := sim.Preempt(inst.ID, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-notices:
		if n.ID != inst.ID || n.Name != "gpu-1" || !strings.Contains(n.Reason, "preempt") {
			t.Errorf("notice %+v", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no notice within 10s")
	}
	eventually(t, "the instance gone", func() bool {
		l, _ := p.List(ctx, "m1")
		return len(l) == 0 && !sim.Instances()[0].Deleted.IsZero()
	})
	if changes.Load() == 0 {
		t.Error("Watch reported no change")
	}
	if n := sim.Calls()["globalOperations.aggregatedList"] - before; n < 1 || n > 2 {
		t.Errorf("%d reads of the operations for one preemption", n)
	}
	select {
	case n := <-notices:
		t.Errorf("a second notice: %+v", n)
	default:
	}
}

// A Spot instance that powers itself off is not preempted: no notice,
// and in the steady state no operations are read at all.
func TestPowerOffIsNoPreemption(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\nspot: true\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	notices := make(chan provider.Notice, 4)
	p.WatchPreemption(ctx, func(n provider.Notice) { notices <- n })
	if _, err := p.Create(ctx, spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "running", func() bool { return sim.Instances()[0].Status == "RUNNING" })
	time.Sleep(2500 * time.Millisecond)
	if n := sim.Calls()["globalOperations.aggregatedList"]; n != 0 {
		t.Errorf("%d reads of the operations while nothing stopped", n)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	select {
	case n := <-notices:
		t.Errorf("a notice for a deleted instance: %+v", n)
	default:
	}
}

func mustJSON(t *testing.T, y string) json.RawMessage {
	t.Helper()
	b, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not %s within 15s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The machine's side holds one request on instance/preempted until it
// turns TRUE (wait_for_change), instead of asking every few seconds: the
// notice reaches the agent as it comes.
func TestWatchInterruption(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\nspot: true\n")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "running", func() bool { return sim.Instances()[0].Status == "RUNNING" })
	var requests atomic.Int32
	h := sim.MetadataHandler(inst.ID)
	md := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		h.ServeHTTP(w, r)
	}))
	defer md.Close()
	t.Setenv("GCE_METADATA_HOST", strings.TrimPrefix(md.URL, "http://"))
	got := make(chan error, 1)
	go func() {
		_, err := gcp.NewMetadata().WatchInterruption(ctx)
		got <- err
	}()
	time.Sleep(3 * time.Second)
	select {
	case err := <-got:
		t.Fatalf("the watch ended before any preemption: %v", err)
	default:
	}
	if n := requests.Load(); n > 2 {
		t.Errorf("%d requests in 3 s before any preemption: polled, not held", n)
	}
	if err := sim.Preempt(inst.ID, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the preemption did not end the watch")
	}
}

// A boot disk set to be kept (instances.setDiskAutoDelete false) outlives
// its instance, billed: Leftovers lists it with its runner, while the
// instance runs (as one to be kept) and once no instance uses it; Sweep
// refuses while the instance runs, naming it, and deletes it once the
// instance is deleted. A second sweep finds it gone.
func TestKeptDiskIsSwept(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\n")
	ctx := context.Background()
	if _, err := p.Create(ctx, spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	name := sim.Instances()[0].Name
	if left, err := p.Leftovers(ctx, "m1"); err != nil || len(left) != 0 {
		t.Fatalf("leftovers %+v (%v) of an instance whose disk goes with it, want none", left, err)
	}
	if err := sim.KeepDisk(name); err != nil {
		t.Fatal(err)
	}
	left, err := p.Leftovers(ctx, "m1")
	if err != nil || len(left) != 1 || left[0].Kind != gcp.DiskKind || left[0].Name != "gpu-1" || left[0].ID != "zones/us-central1-a/disks/"+name || left[0].State == "" {
		t.Fatalf("leftovers %+v (%v), want gpu-1's disk, said to be kept", left, err)
	}
	eventually(t, "running", func() bool {
		l, _ := p.List(ctx, "m1")
		return len(l) == 1 && l[0].State == provider.StateRunning
	})
	if err := p.Sweep(ctx, left[0]); err == nil || !strings.Contains(err.Error(), "used by instance "+name+", which is running") {
		t.Errorf("sweeping a running instance's disk: %v, want it refused, naming the instance", err)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if err := p.Sweep(ctx, left[0]); err != nil {
		t.Fatalf("sweep after the instance was deleted: %v", err)
	}
	if d := sim.Disks(); len(d) != 0 {
		t.Errorf("disks left after the sweep: %+v", d)
	}
	if err := p.Sweep(ctx, left[0]); err != nil {
		t.Errorf("sweeping a disk already gone: %v", err)
	}
	other := open(t, "m2", sim, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\n")
	if l, err := other.Leftovers(ctx, "m2"); err != nil || len(l) != 0 {
		t.Errorf("manager m2's leftovers %+v (%v), want none", l, err)
	}
	if err := p.Sweep(ctx, provider.Resource{Kind: gcp.DiskKind, ID: "zones/us-central1-a/instances/x"}); err == nil {
		t.Error("a sweep of what is not a disk was taken")
	}
}

// A project's quota spent by another client is answered 403
// rateLimitExceeded until the minute ends; runfleet sends no more of that
// group's requests before then (each would be refused and counted), while
// the other groups and regions go on: a region's inserts, the listings.
func TestSpentQuotaHoldsOnlyItsGroup(t *testing.T) {
	if left := time.Until(time.Now().Truncate(time.Minute).Add(time.Minute)); left < 5*time.Second {
		time.Sleep(left + 100*time.Millisecond) // the test's few seconds within one minute
	}
	central, sim := newProvider(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\n")
	europe := open(t, "m1", sim, "zones: [europe-west1-d]\nmachine_types: [n1-standard-8]\n")
	sim.SpendQuota(gcesim.QuotaWritesPerRegion, "us-central1")
	ctx := context.Background()
	if _, err := central.Create(ctx, spec("gpu-1")); err == nil || !strings.Contains(err.Error(), "request quota") {
		t.Fatalf("err = %v, want the request quota", err)
	}
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err := central.Create(short, spec("gpu-1"))
	var held *gcp.QuotaHeldError
	if !errors.As(err, &held) || held.Quota != "writes_per_region in us-central1" {
		t.Errorf("a second insert in us-central1: %v, want it held until the minute ends", err)
	}
	if n := sim.Calls()["instances.insert"]; n != 1 {
		t.Errorf("%d inserts sent, want 1: the one refused", n)
	}
	if _, err := europe.Create(ctx, spec("gpu-2")); err != nil {
		t.Errorf("an insert in europe-west1 while us-central1's writes are spent: %v", err)
	}
	if _, err := central.List(ctx, "m1"); err != nil {
		t.Errorf("listing while us-central1's writes are spent: %v", err)
	}
}

func TestRequestQuotasChecked(t *testing.T) {
	_, err := gcp.DecodeSection(mustJSON(t, "zones: [us-central1-a]\nimage: "+image+"\nmachine_types: [n1-standard-8]\nrequest_quotas: {reads_per_region: 3000, writes: 10, global_reads: 0}\n"))
	for _, want := range []string{`"writes" is not a quota group`, "global_reads: 0 requests a minute"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("err = %v, want it to say %s", err, want)
		}
	}
	if _, err := gcp.DecodeSection(mustJSON(t, "zones: [us-central1-a]\nimage: "+image+"\nmachine_types: [n1-standard-8]\nrequest_quotas: {reads_per_region: 3000}\n")); err != nil {
		t.Error(err)
	}
}
