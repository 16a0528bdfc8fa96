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

// Shorter than Azure's minutes: the stand-in makes a VM in 200 ms.
func init() { PollInterval, DeallocateGather = 100*time.Millisecond, 200*time.Millisecond }

// newSim is the stand-in, with the test image.
func newSim(t *testing.T) *armsim.Server {
	t.Helper()
	sim, err := armsim.New(armsim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	return sim
}

// newProvider is a pool's provider on armcompute's fake server (the
// stand-in's), wired in-process through the client's options.
func newProvider(t *testing.T, section string) (*Provider, *armsim.Server) {
	t.Helper()
	sim := newSim(t)
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
	skus, err := armcompute.NewResourceSKUsClient(armsim.Subscription, &azfake.TokenCredential{}, opts)
	if err != nil {
		t.Fatal(err)
	}
	armc, err := arm.NewClient("computeschedule.ScheduledActionsClient", "v1.0.0", &azfake.TokenCredential{}, opts)
	if err != nil {
		t.Fatal(err)
	}
	return sdkAPI{vms: vms, skus: skus, sched: sched, arm: armc, sub: armsim.Subscription}
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
	if left := sim.Leftovers(); len(left) != 3 {
		t.Errorf("left: %v, want only the live VM's disk, NIC and address", left)
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
	sim := newSim(t)
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

// A VM's deallocation at its deadline is submitted to Compute Schedule
// once it is made (Azure's own, no credential on the VM): with no manager
// left to delete it, Azure deallocates it then, which ends its compute
// cost, where a VM powered off from inside stays allocated and billed.
// Its creation is one call: its operation is not polled.
func TestDeallocatedAtTheDeadline(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	ctx := context.Background()
	made := time.Now()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	d := waitDeallocations(t, sim, 1)[0]
	want := made.Add(time.Hour).UTC().Truncate(time.Minute).Add(time.Minute)
	if !strings.HasSuffix(d.VM, "/virtualMachines/"+inst.ID) || d.Location != "eastus" || !d.Deadline.Equal(want) || d.State != "Scheduled" {
		t.Errorf("deallocation %+v, want %s's at %s", d, inst.ID, want)
	}
	calls := sim.Calls()
	if calls["VirtualMachinesClient.BeginCreateOrUpdate"] != 1 || calls["VirtualMachinesClient.BeginCreateOrUpdate poll"] != 0 {
		t.Errorf("calls %v: want one creation, its operation not polled", calls)
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
}

func waitDeallocations(t *testing.T, sim *armsim.Server, n int) []armsim.Deallocation {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if d := sim.Deallocations(); len(d) >= n {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("deallocations submitted: %+v, want %d", sim.Deallocations(), n)
		}
	}
}

// A burst's VMs share their deallocations' calls: 30 VMs made at once
// cost 30 creations, a listing or so a PollInterval while they are made,
// and a deallocation call or two (their deadlines may straddle a
// minute), no creation polled.
func TestBurstSharesItsCalls(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	// Longer than the burst takes here, under the race detector too.
	p.deadlines.gather = 5 * time.Second
	var wg sync.WaitGroup
	for i := range 30 {
		wg.Go(func() {
			if _, err := p.Create(context.Background(), spec(fmt.Sprintf("gpu-%d", i))); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for deadline := time.Now().Add(10 * time.Second); len(sim.Deallocations()) < 30 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	ds := waitDeallocations(t, sim, 30)
	calls := sim.Calls()
	t.Logf("30 VMs: %v", calls)
	if n := calls["ScheduledActionsClient.VirtualMachinesSubmitDeallocate"]; n > 2 {
		t.Errorf("%d deallocation calls for 30 VMs made at once, want 1 or 2", n)
	}
	if calls["VirtualMachinesClient.BeginCreateOrUpdate poll"] != 0 || calls["VirtualMachinesClient.NewListAllPager"] > 10 {
		t.Errorf("calls %v: want no creation polled, and the VMs to share their listings", calls)
	}
	seen := map[string]bool{}
	for _, d := range ds {
		seen[d.VM] = true
	}
	if len(seen) != 30 {
		t.Errorf("%d VMs' deallocations, want 30", len(seen))
	}
}

// A lifetime past what Compute Schedule takes (14 days) gets no
// deallocation, and the log says what that costs.
func TestNoDeallocationPast14Days(t *testing.T) {
	var log syncBuffer
	p, sim := loggedProvider(t, 15*24*time.Hour, &log)
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	p.Close()
	if d := sim.Deallocations(); len(d) != 0 {
		t.Errorf("deallocations: %+v", d)
	}
	if !strings.Contains(log.String(), "no deallocation at their deadline") {
		t.Errorf("the log does not say it:\n%s", log.String())
	}
}

// The stand-in refuses a submission as Azure's spec has it: another
// api-version, a deadline past or more than 14 days ahead, no VMs; a VM
// that is not there (or not in the location) is refused on its own.
func TestDeallocationRefused(t *testing.T) {
	p, _ := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	inst, err := p.Create(context.Background(), spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	id := vmID(armsim.Subscription, armsim.Group, inst.ID)
	api := p.opt.API
	ctx := context.Background()
	for name, tc := range map[string]struct {
		at  time.Time
		ids []string
	}{
		"a deadline past":    {time.Now().Add(-time.Minute), []string{id}},
		"a deadline too far": {time.Now().Add(15 * 24 * time.Hour), []string{id}},
		"no VMs":             {time.Now().Add(time.Hour), nil},
	} {
		_, err := api.Deallocate(ctx, "eastus", tc.at, tc.ids)
		if k, _ := kindOf(err); k != errFatal {
			t.Errorf("%s: %v, want a 400", name, err)
		}
	}
	refused, err := api.Deallocate(ctx, "eastus", time.Now().Add(time.Hour), []string{id, vmID(armsim.Subscription, armsim.Group, "gone")})
	if err != nil || len(refused) != 1 || refused[vmID(armsim.Subscription, armsim.Group, "gone")] != "ResourceNotFound" {
		t.Errorf("a VM gone: %v, %v", refused, err)
	}
	if refused, err := api.Deallocate(ctx, "westus2", time.Now().Add(time.Hour), []string{id}); err != nil || len(refused) != 1 {
		t.Errorf("a VM of another location: %v, %v", refused, err)
	}
}

// A submission that fails for a while is sent again, backing off; one
// Azure refuses for good (a role without Compute Schedule's action) is
// not, and the log says what it costs and what to check. Neither keeps
// the VM from being made.
func TestDeallocationRetriedOrReported(t *testing.T) {
	var log syncBuffer
	p, sim := loggedProvider(t, time.Hour, &log)
	const api = "ScheduledActionsClient.VirtualMachinesSubmitDeallocate"
	sim.Fail(api, 2, http.StatusServiceUnavailable, "ServiceUnavailable")
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	waitDeallocations(t, sim, 1)
	if n := sim.Calls()[api]; n != 3 {
		t.Errorf("%d submissions, want 2 failed and 1 taken", n)
	}
	sim.Fail(api, 1, http.StatusForbidden, "AuthorizationFailed")
	if _, err := p.Create(context.Background(), spec("gpu-2")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(log.String(), "could not submit"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no error logged:\n%s", log.String())
		}
	}
	time.Sleep(3 * p.deadlines.gather)
	if n := sim.Calls()[api]; n != 4 {
		t.Errorf("%d submissions, want the refused one sent once", n)
	}
	if !strings.Contains(log.String(), "AuthorizationFailed") || !strings.Contains(log.String(), "Microsoft.ComputeSchedule") {
		t.Errorf("the log does not say why, or what to check:\n%s", log.String())
	}
}

// loggedProvider is a pool's provider, its VMs living lifetime, its log
// written to log.
func loggedProvider(t *testing.T, lifetime time.Duration, log *syncBuffer) (*Provider, *armsim.Server) {
	t.Helper()
	sim := newSim(t)
	s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\n"+subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{API: simAPI(t, sim), Subscription: armsim.Subscription, Manager: "m1", Pool: "gpu", Section: s,
		IdleTimeout: time.Minute, Lifetime: lifetime, Logger: slog.New(slog.NewTextHandler(log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, sim
}

// syncBuffer is a log written by several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// An auto-shutdown schedule that an earlier runfleet made for a VM now
// gone (nothing deletes one with its VM) is found and deleted by gc
// (Leftovers, Sweep); a live VM's is left.
func TestEarlierSchedulesSwept(t *testing.T) {
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
	opts := &arm.ClientOptions{ClientOptions: policy.ClientOptions{Transport: sim.Transport()}}
	sched, err := armdevtestlabs.NewGlobalSchedulesClient(armsim.Subscription, &azfake.TokenCredential{}, opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []provider.Instance{inst, other} {
		sc := armdevtestlabs.Schedule{Location: to.Ptr("eastus"), Tags: map[string]*string{TagManager: to.Ptr("m1"), TagPool: to.Ptr("gpu"), TagRunner: to.Ptr(v.Name)},
			Properties: &armdevtestlabs.ScheduleProperties{Status: to.Ptr(armdevtestlabs.EnableStatusEnabled), TaskType: to.Ptr("ComputeVmShutdownTask"),
				DailyRecurrence: &armdevtestlabs.DayDetails{Time: to.Ptr("1900")}, TimeZoneID: to.Ptr("UTC"),
				TargetResourceID: to.Ptr(vmID(armsim.Subscription, armsim.Group, v.ID))}}
		if _, err := sched.CreateOrUpdate(ctx, armsim.Group, ScheduleName(v.ID), sc, nil); err != nil {
			t.Fatal(err)
		}
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
