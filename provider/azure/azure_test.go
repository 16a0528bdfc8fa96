package azure

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore/arm"
	azfake "github.com/Azure/azure-sdk-for-go/sdk/azcore/fake"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/devtestlabs/armdevtestlabs"
	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/provider"
)

const image = "Canonical:ubuntu-24_04-lts:server:latest"

func init() { PollInterval = 100 * time.Millisecond }

// newProvider is a pool's provider on armcompute's fake server (the
// stand-in's), wired in-process through the client's options.
func newProvider(t *testing.T, section string) (*Provider, *armsim.Server) {
	t.Helper()
	sim, err := armsim.New(armsim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\npoll_interval: 1s\n"+section))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{API: simAPI(t, sim), Subscription: armsim.Subscription, Manager: "m1", Pool: "gpu", Section: s,
		IdleTimeout: time.Minute, Lifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, sim
}

// simAPI is API on the stand-in, in-process.
func simAPI(t *testing.T, sim *armsim.Server) sdkAPI {
	t.Helper()
	opts := &arm.ClientOptions{ClientOptions: policy.ClientOptions{Transport: sim.Transport()}}
	vms, err := armcompute.NewVirtualMachinesClient(armsim.Subscription, &azfake.TokenCredential{}, opts)
	if err != nil {
		t.Fatal(err)
	}
	sched, err := armdevtestlabs.NewGlobalSchedulesClient(armsim.Subscription, &azfake.TokenCredential{}, opts)
	if err != nil {
		t.Fatal(err)
	}
	return sdkAPI{vms: vms, sched: sched}
}

func mustJSON(t *testing.T, y string) json.RawMessage {
	t.Helper()
	b, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func subnets(locs ...string) string {
	s := "locations: [" + strings.Join(locs, ", ") + "]\nsubnets:\n"
	for _, l := range locs {
		s += "  " + l + ": " + armsim.SubnetID(l) + "\n"
	}
	return s
}

func spec(name string) provider.Spec {
	return provider.Spec{Name: name, Manager: "m1", Pool: "gpu", Command: "gitea-runner", Args: []string{"daemon"},
		Env: map[string]string{"A": "b"}, Files: map[string][]byte{".runner": []byte(`{"token":"single-use"}`)}, BusyMarker: " repo is "}
}

// A Spot VM, tagged, its NIC, public address and disk made with it and
// deleted with it; listed as running; deleted.
func TestCreateListDelete(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_NC4as_T4_v3]\nspot: true\nmax_price: 0.5\ntags: {team: ml}\ndisk: {size_gb: 100}\n")
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := p.Create(ctx, spec("gpu-1"))
	if err != nil || again.ID != inst.ID {
		t.Fatalf("a second Create of gpu-1 made %s (%v), want %s again", again.ID, err, inst.ID)
	}
	all := sim.VMs()
	if len(all) != 1 {
		t.Fatalf("%d VMs, want 1", len(all))
	}
	v := all[0]
	for k, want := range map[string]string{TagManager: "m1", TagPool: "gpu", TagRunner: "gpu-1", "team": "ml"} {
		if v.Tags[k] != want {
			t.Errorf("tag %s = %q, want %q (tags %v)", k, v.Tags[k], want, v.Tags)
		}
	}
	if v.Priority != "Spot" || v.MaxPrice != 0.5 || v.Size != "Standard_NC4as_T4_v3" || v.Location != "eastus" || !strings.HasPrefix(v.Name, "gpu-1-") {
		t.Errorf("VM %s: %s %g %s %s", v.Name, v.Priority, v.MaxPrice, v.Size, v.Location)
	}
	if len(v.Resources) != 3 {
		t.Errorf("made with the VM: %v, want its disk, NIC and public address", v.Resources)
	}
	for r, goes := range v.Resources {
		if !goes {
			t.Errorf("%s is not deleted with the VM", r)
		}
	}
	_, plan, _ := strings.Cut(v.CustomData, "<<'RUNFLEET_EOF'\n")
	plan, _, _ = strings.Cut(plan, "RUNFLEET_EOF")
	pj, _ := base64.StdEncoding.DecodeString(strings.ReplaceAll(plan, "\n", ""))
	if !strings.Contains(v.CustomData, "runfleet' agent --plan") || !strings.Contains(string(pj), `"notices":"azure"`) || !strings.Contains(string(pj), `".runner":`) {
		t.Errorf("custom data:\n%s\nplan: %s", v.CustomData, pj)
	}
	time.Sleep(1100 * time.Millisecond)
	list, err := p.List(ctx, "m1")
	if err != nil || len(list) != 1 || list[0].State != provider.StateRunning || list[0].Name != "gpu-1" {
		t.Fatalf("list: %+v %v", list, err)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if list, _ := p.List(ctx, "m1"); len(list) != 0 {
		t.Errorf("listed after delete: %+v", list)
	}
	time.Sleep(time.Second)
	if left := sim.Leftovers(); len(left) != 0 || sim.VMs()[0].Deleted.IsZero() {
		t.Errorf("after delete: left %v", left)
	}
}

// No SKU in the first location, no Spot capacity in the second: the
// regular fallback in the first; the failed Spot VM is deleted. None
// anywhere: an error naming each; an image no location has: rejected.
func TestCapacityFallsBack(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus", "westus2")+"vm_sizes: [Standard_NC6s_v3]\nspot: true\nspot_fallback: on_demand\n")
	sim.NoSKU("Standard_NC6s_v3", "eastus")
	sim.NoCapacity("Spot", "", "westus2")
	ctx := context.Background()
	if _, err := p.Create(ctx, spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	var live []armsim.VM
	for _, v := range sim.VMs() {
		if v.Deleted.IsZero() && v.Provisioning != "Deleting" {
			live = append(live, v)
		}
	}
	if len(live) != 1 || live[0].Priority != "Regular" || live[0].Location != "westus2" {
		t.Fatalf("live VMs: %+v, want one regular in westus2", live)
	}
	time.Sleep(time.Second)
	if left := sim.Leftovers(); len(left) != 4 {
		t.Errorf("left: %v, want only the live VM's disk, NIC, address and auto-shutdown schedule", left)
	}

	sim.NoQuota("westus2")
	_, err := p.Create(ctx, spec("gpu-2"))
	for _, want := range []string{"no capacity", "spot Standard_NC6s_v3 in eastus: SkuNotAvailable", "spot Standard_NC6s_v3 in westus2: OperationNotAllowed"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %q", err, want)
		}
	}
	if errors.Is(err, provider.ErrRejected) {
		t.Error("no capacity is not a rejection")
	}

	q, _ := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	q.image = Image{Publisher: "Nobody", Offer: "x", SKU: "y", Version: "latest"}
	if _, err := q.Create(ctx, spec("gpu-3")); !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "PlatformImageNotFound") {
		t.Errorf("an image nowhere: %v", err)
	}
}

// A Spot VM that Azure deleted while it ran is reported as evicted;
// one deleted here, or that stopped itself first, is not.
func TestEvictionReported(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\nspot: true\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	notices := make(chan provider.Notice, 4)
	go p.WatchPreemption(ctx, func(n provider.Notice) { notices <- n })
	a, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Create(ctx, spec("gpu-2")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if err := sim.Evict(a.ID, 500*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, "gpu-2"); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-notices:
		if n.Name != "gpu-1" || n.ID != a.ID || !strings.Contains(n.Reason, "spot eviction") {
			t.Errorf("notice %+v", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no eviction notice")
	}
	select {
	case n := <-notices:
		t.Errorf("a second notice: %+v", n)
	case <-time.After(3 * time.Second):
	}
}

func TestErrorKinds(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	sim.Fail("VirtualMachinesClient.BeginCreateOrUpdate", 1, 403, "AuthorizationFailed")
	_, err := p.Create(context.Background(), spec("gpu-1"))
	if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "AuthorizationFailed") {
		t.Errorf("forbidden: %v", err)
	}
	if k, _ := kindOf(errors.New("dial tcp: refused")); k != errOther {
		t.Errorf("a refused connection: kind %d, want errOther", k)
	}
}

// The pools of one subscription share its listing (Compute's "High Cost
// Get VM" policy meters it): four pools that each list every poll
// interval list the subscription about once an interval, not four times,
// and each still sees its own VMs.
func TestPoolsShareTheListing(t *testing.T) {
	sim, err := armsim.New(armsim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	listing := &Listing{}
	var pools []*Provider
	for i := range 4 {
		s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\npoll_interval: 1s\n"+subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n"))
		if err != nil {
			t.Fatal(err)
		}
		p, err := New(Options{API: simAPI(t, sim), Subscription: armsim.Subscription, Manager: "m1", Pool: fmt.Sprintf("pool%d", i), Section: s, Listing: listing,
			IdleTimeout: time.Minute, Lifetime: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		if _, err := p.Create(context.Background(), provider.Spec{Name: fmt.Sprintf("pool%d-1", i), Manager: "m1", Pool: fmt.Sprintf("pool%d", i), Command: "x"}); err != nil {
			t.Fatal(err)
		}
		pools = append(pools, p)
	}
	before := sim.Calls()["VirtualMachinesClient.NewListAllPager"]
	start := time.Now()
	var wg sync.WaitGroup
	for _, p := range pools {
		wg.Go(func() {
			for time.Since(start) < 3500*time.Millisecond {
				l, err := p.List(context.Background(), "m1")
				if err != nil || len(l) != 1 || l[0].Name != p.opt.Pool+"-1" {
					t.Errorf("pool %s listed %+v, %v", p.opt.Pool, l, err)
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	// An interval of 1s over 3.5s: 4 listings at most, where four pools
	// of their own would send 16.
	if n := sim.Calls()["VirtualMachinesClient.NewListAllPager"] - before; n > 5 {
		t.Errorf("%d listings of the subscription by 4 pools in 3.5 s at a 1 s interval", n)
	}
}

// A VM gets an auto-shutdown schedule at its deadline (Azure's own, no
// credential on the VM): with no manager left to delete it, Azure
// deallocates it then, which ends its compute cost, where a VM powered
// off from inside stays allocated and billed. The schedule goes with the
// VM's deletion, and an evicted VM's too.
func TestAutoShutdownAtTheDeadline(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	ctx := context.Background()
	made := time.Now()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	scheds := sim.Schedules()
	if len(scheds) != 1 {
		t.Fatalf("schedules: %+v, want the VM's one", scheds)
	}
	sc := scheds[0]
	deadline := made.Add(time.Hour)
	if sc.Name != "shutdown-computevm-"+inst.ID || sc.TimeZone != "UTC" || !sc.Enabled || !strings.HasSuffix(sc.Target, "/virtualMachines/"+inst.ID) ||
		sc.Tags[TagManager] != "m1" || sc.Tags[TagRunner] != "gpu-1" {
		t.Errorf("schedule %+v", sc)
	}
	if want := shutdownTime(made, deadline).Format("1504"); sc.Time != want {
		t.Errorf("schedule at %s, want %s (the deadline %s)", sc.Time, want, deadline.UTC().Format("15:04:05"))
	}
	time.Sleep(300 * time.Millisecond) // the VM is running
	sim.Advance(58 * time.Minute)
	if v := sim.VMs()[0]; v.Power == "deallocated" {
		t.Fatalf("deallocated %s before its deadline", time.Hour-58*time.Minute)
	}
	sim.Advance(3 * time.Minute)
	if v := sim.VMs()[0]; v.Power != "deallocated" {
		t.Errorf("at its deadline, with no manager to delete it, the VM is %s, want deallocated", v.Power)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if s := sim.Schedules(); len(s) != 0 {
		t.Errorf("schedules left after the VM's deletion: %+v", s)
	}
}

// The first time the schedule fires after the VM is made is its
// deadline's minute, or the minute before it, never a day early or late,
// for every lifetime up to a day.
func TestShutdownTime(t *testing.T) {
	now := time.Date(2026, 11, 27, 10, 15, 30, 0, time.UTC)
	for _, life := range []time.Duration{2 * time.Minute, 40 * time.Minute, 12 * time.Hour, 23*time.Hour + 59*time.Minute, 23*time.Hour + 59*time.Minute + 45*time.Second, 24 * time.Hour} {
		deadline := now.Add(life)
		at := shutdownTime(now, deadline)
		// The schedule's first firing after now: its time of day, today
		// or tomorrow.
		first := time.Date(now.Year(), now.Month(), now.Day(), at.Hour(), at.Minute(), 0, 0, time.UTC)
		if !first.After(now) {
			first = first.AddDate(0, 0, 1)
		}
		if d := first.Sub(deadline); d <= -time.Minute || d >= time.Minute {
			t.Errorf("lifetime %s: fires first at %s, %s from the deadline %s", life, first.Format("Jan 2 15:04"), d, deadline.Format("Jan 2 15:04:05"))
		}
	}
}

// A lifetime over a day gets no schedule (it is daily, and would end the
// VM on its first day), and the log says what that costs.
func TestNoScheduleOverADay(t *testing.T) {
	sim, err := armsim.New(armsim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\n"+subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n"))
	if err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer // written by this goroutine only: New and Create
	p, err := New(Options{API: simAPI(t, sim), Subscription: armsim.Subscription, Manager: "m1", Pool: "gpu", Section: s,
		IdleTimeout: time.Minute, Lifetime: 48 * time.Hour, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	if s := sim.Schedules(); len(s) != 0 {
		t.Errorf("schedules: %+v", s)
	}
	if !strings.Contains(log.String(), "no auto-shutdown schedule") {
		t.Errorf("the log does not say it:\n%s", log.String())
	}
}

// The stand-in refuses a schedule as Azure does: a name other than
// shutdown-computevm-<VM>, another task type, a time that is not HHmm, a
// target that is not there.
func TestScheduleRefused(t *testing.T) {
	p, _ := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	inst, err := p.Create(context.Background(), spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	good := func() armdevtestlabs.Schedule {
		return armdevtestlabs.Schedule{Location: to.Ptr("eastus"), Properties: &armdevtestlabs.ScheduleProperties{
			Status: to.Ptr(armdevtestlabs.EnableStatusEnabled), TaskType: to.Ptr("ComputeVmShutdownTask"),
			DailyRecurrence: &armdevtestlabs.DayDetails{Time: to.Ptr("1900")}, TimeZoneID: to.Ptr("UTC"),
			TargetResourceID: to.Ptr(vmID(armsim.Subscription, armsim.Group, inst.ID))}}
	}
	for name, tc := range map[string]struct {
		vm     string
		change func(*armdevtestlabs.Schedule)
	}{
		"another VM's name": {"other", func(*armdevtestlabs.Schedule) {}},
		"task type":         {inst.ID, func(s *armdevtestlabs.Schedule) { s.Properties.TaskType = to.Ptr("LabVmsShutdownTask") }},
		"time":              {inst.ID, func(s *armdevtestlabs.Schedule) { s.Properties.DailyRecurrence.Time = to.Ptr("7pm") }},
		"target": {"gone", func(s *armdevtestlabs.Schedule) {
			s.Properties.TargetResourceID = to.Ptr(vmID(armsim.Subscription, armsim.Group, "gone"))
		}},
	} {
		s := good()
		tc.change(&s)
		err := p.opt.API.Schedule(context.Background(), armsim.Group, tc.vm, s)
		if k, _ := kindOf(err); k != errFatal {
			t.Errorf("%s: %v, want a 400", name, err)
		}
	}
	if err := p.opt.API.Schedule(context.Background(), armsim.Group, inst.ID, good()); err != nil {
		t.Errorf("a good schedule: %v", err)
	}
}

// A VM deleted by Azure (an eviction) leaves its auto-shutdown schedule;
// a manager that saw it go deletes it, and gc (Leftovers, Sweep) finds and
// deletes one whose VM went while no manager ran.
func TestEvictedVMsScheduleSwept(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\nspot: true\n")
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := p.Create(ctx, spec("gpu-2"))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := sim.Evict(inst.ID, 0); err != nil {
		t.Fatal(err)
	}
	waitEvicted(t, sim, inst.ID)
	left, err := p.Leftovers(ctx, "m1")
	if err != nil || len(left) != 1 || left[0].Kind != ScheduleKind || left[0].Name != "gpu-1" || !strings.HasSuffix(left[0].ID, "/shutdown-computevm-"+inst.ID) {
		t.Fatalf("leftovers %+v, %v: want gpu-1's schedule only", left, err)
	}
	if err := p.Sweep(ctx, left[0]); err != nil {
		t.Fatal(err)
	}
	if s := sim.Schedules(); len(s) != 1 || strings.Contains(s[0].Name, inst.ID) {
		t.Errorf("schedules after the sweep: %+v, want gpu-2's", s)
	}
	if left, err := p.Leftovers(ctx, "m1"); err != nil || len(left) != 0 {
		t.Errorf("leftovers after the sweep: %+v, %v", left, err)
	}
	// A manager that sees the eviction deletes the schedule itself.
	if err := p.poll(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sim.Evict(other.ID, 0); err != nil {
		t.Fatal(err)
	}
	waitEvicted(t, sim, other.ID)
	time.Sleep(time.Second) // the poll interval
	if err := p.poll(ctx); err != nil {
		t.Fatal(err)
	}
	if s := sim.Schedules(); len(s) != 0 {
		t.Errorf("schedules after the manager saw the eviction: %+v", s)
	}
	if err := p.Sweep(ctx, provider.Resource{Kind: ScheduleKind, ID: "/subscriptions/x/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/v"}); err == nil {
		t.Error("Sweep took an ID that is not a schedule's")
	}
}

func waitEvicted(t *testing.T, sim *armsim.Server, name string) {
	t.Helper()
	gone := func() bool {
		return slices.ContainsFunc(sim.VMs(), func(v armsim.VM) bool { return v.Name == name && !v.Deleted.IsZero() })
	}
	for deadline := time.Now().Add(5 * time.Second); !gone(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("VM %s was not evicted", name)
		}
	}
}

// A schedule the manager may not delete (a role without
// Microsoft.DevTestLab/schedules/delete) does not keep its VM, which is
// what costs: the VM goes, the schedule is left for gc.
func TestVMGoesWhenItsScheduleCannot(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	sim.Fail("GlobalSchedulesClient.Delete", 1, http.StatusForbidden, "AuthorizationFailed")
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatalf("delete with the schedule refused: %v", err)
	}
	time.Sleep(time.Second)
	if v := sim.VMs()[0]; v.Deleted.IsZero() {
		t.Errorf("VM %s kept because its schedule could not be deleted", inst.ID)
	}
	if left, err := p.Leftovers(ctx, "m1"); err != nil || len(left) != 1 {
		t.Errorf("gc's leftovers: %+v, %v, want the schedule", left, err)
	}
}
