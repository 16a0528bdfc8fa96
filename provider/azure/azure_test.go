package azure

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore/arm"
	azfake "github.com/Azure/azure-sdk-for-go/sdk/azcore/fake"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
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
	vms, err := armcompute.NewVirtualMachinesClient(armsim.Subscription, &azfake.TokenCredential{},
		&arm.ClientOptions{ClientOptions: policy.ClientOptions{Transport: sim.Transport()}})
	if err != nil {
		t.Fatal(err)
	}
	s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\npoll_interval: 1s\n"+section))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{API: sdkAPI{vms}, Manager: "m1", Pool: "gpu", Section: s,
		IdleTimeout: time.Minute, Lifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, sim
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
	sim, err := armsim.New(armsim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	listing := &Listing{}
	var pools []*Provider
	for i := range 4 {
		vms, err := armcompute.NewVirtualMachinesClient(armsim.Subscription, &azfake.TokenCredential{},
			&arm.ClientOptions{ClientOptions: policy.ClientOptions{Transport: sim.Transport()}})
		if err != nil {
			t.Fatal(err)
		}
		s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\npoll_interval: 1s\n"+subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n"))
		if err != nil {
			t.Fatal(err)
		}
		p, err := New(Options{API: sdkAPI{vms}, Manager: "m1", Pool: fmt.Sprintf("pool%d", i), Section: s, Listing: listing,
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
