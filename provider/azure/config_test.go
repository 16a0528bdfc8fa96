package azure

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/provider"
)

func TestSectionErrorsNameEachField(t *testing.T) {
	_, err := DecodeSection(mustJSON(t, `
subscription_id: nope
resource_group: "bad/group"
locations: [East US, westus2]
subnets: {westus2: /not/a/subnet}
subnet: x
endpoint: http://plain
image: ubuntu
vm_sizes: [D2s_v5]
disk: {size_gb: 10, type: ssd}
identity: me
max_price: 0.3
spot_fallback: on_demand
admin_user: root
tags: {runfleet-x: y}
idle_timeout: soon
poll_interval: 10ms
bogus: 1
`))
	if err == nil {
		t.Fatal("a bad section was taken")
	}
	for _, want := range []string{"subscription_id", "resource_group", "locations[0]", "subnets.westus2", "subnet:", "endpoint", "image",
		"vm_sizes[0]", "disk.size_gb", "disk.type", "identity", "max_price", "spot_fallback", "admin_user", "tags.runfleet-x", "idle_timeout",
		"poll_interval", "bogus"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not name %s:\n%v", want, err)
		}
	}
	s, err := DecodeSection(mustJSON(t, "resource_group: rg\nlocations: [eastus]\nsubnet: "+armsim.SubnetID("eastus")+"\nimage: "+image+"\nvm_sizes: [Standard_D2s_v5]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s.Subnets["eastus"] == "" || !*s.PublicIP || *s.MaxPrice != -1 || s.Disk.Type != DefaultDiskType || s.AdminUser != DefaultAdminUser {
		t.Errorf("defaults: %+v", s)
	}
}

// `--cloud=azure` as CML takes it: the region and size aliases, spot and
// its price, tags; what CML cannot say comes from runfleet's variables,
// and their absence is named.
func TestCMLSection(t *testing.T) {
	d, _ := provider.Lookup("azure")
	cml := d.(provider.CMLDriver)
	env := map[string]string{ResourceGroupEnv: armsim.Group, SubnetEnv: armsim.SubnetID("westeurope")}
	getenv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	raw, ok, err := cml.CMLSection(provider.CMLOptions{Getenv: getenv, Cloud: map[string]string{"cloud": "azure", "cloud-region": "eu-west",
		"cloud-type": "m+v100", "cloud-spot": "true", "cloud-spot-price": "0.9", "cloud-image": image, "cloud-hdd-size": "64"}, Metadata: map[string]string{"team": "ml"}})
	if !ok || err != nil {
		t.Fatalf("%v %v", ok, err)
	}
	s, err := DecodeSection(raw)
	if err != nil {
		t.Fatal(err)
	}
	if s.Locations[0] != "westeurope" || s.VMSizes[0] != "Standard_NC6s_v3" || !s.Spot || *s.MaxPrice != 0.9 || s.Tags["team"] != "ml" || s.Disk.SizeGB != 64 || s.Subnets["westeurope"] == "" {
		t.Errorf("section: %+v", s)
	}
	if _, ok, _ := cml.CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "gcp"}}); ok {
		t.Error("took --cloud=gcp")
	}
	_, _, err = cml.CMLSection(provider.CMLOptions{Getenv: func(string) (string, bool) { return "", false }, Cloud: map[string]string{"cloud": "azure", "cloud-spot-price": "cheap"}})
	for _, want := range []string{"--cloud-image", ResourceGroupEnv, SubnetEnv, "--cloud-spot-price"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %s", err, want)
		}
	}
}

// The registered driver over HTTPS with CML's service principal: its
// token from Entra ID's endpoint, every ARM call counted; a wrong secret
// is an error no retry fixes, and the secret is in no error.
func TestDriverWithServicePrincipal(t *testing.T) {
	sim, err := armsim.New(armsim.Options{PollAfter: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	for _, kv := range sim.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	d, _ := provider.Lookup("azure")
	raw := mustJSON(t, "endpoint: "+sim.URL+"\nresource_group: "+armsim.Group+"\nimage: "+image+"\n"+subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	p, err := d.Open(t.Context(), provider.PoolConfig{Manager: "m1", Pool: "gpu", Section: raw, MaxLifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer p.(*Provider).Close()
	ctx := context.Background()
	if _, err := p.Create(ctx, spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	calls := sim.Calls()
	if n := p.(provider.CallCounter).Calls(); n < 3 || calls["token"] != 1 {
		t.Errorf("%d calls counted; the stand-in's: %v", n, calls)
	}
	t.Logf("one VM made and deleted: %d calls (%v)", p.(provider.CallCounter).Calls(), calls)

	t.Setenv(ClientSecretEnv, "wrong-secret-value")
	q, err := d.Open(t.Context(), provider.PoolConfig{Manager: "m1", Pool: "gpu", Section: raw, MaxLifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer q.(*Provider).Close()
	_, err = q.Create(ctx, spec("gpu-2"))
	if err == nil || strings.Contains(err.Error(), "wrong-secret-value") || strings.Contains(err.Error(), sim.Secret()) {
		t.Errorf("a wrong secret: %v", err)
	}
	t.Setenv(ClientSecretEnv, "x")
	t.Setenv(TenantIDEnv, "")
	if _, err := d.Open(t.Context(), provider.PoolConfig{Manager: "m1", Pool: "gpu", Section: raw}); err == nil || !strings.Contains(err.Error(), TenantIDEnv) {
		t.Errorf("no tenant: %v", err)
	}
}

// The VM side: a Preempt event for this VM is an interruption at its
// NotBefore; the event is approved once the agent stopped; maintenance
// asks to move off; another VM's events are not this one's.
func TestScheduledEvents(t *testing.T) {
	var approved []string
	events := []map[string]any{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Metadata") != "true" {
			http.Error(w, "no header", http.StatusBadRequest)
			return
		}
		switch {
		case r.URL.Path == "/metadata/instance/compute":
			_ = json.NewEncoder(w).Encode(map[string]string{"name": "vm-1"})
		case r.Method == http.MethodGet:
			_ = json.NewEncoder(w).Encode(map[string]any{"DocumentIncarnation": 1, "Events": events})
		default:
			var body struct{ StartRequests []struct{ EventId string } }
			_ = json.NewDecoder(r.Body).Decode(&body)
			for _, sr := range body.StartRequests {
				approved = append(approved, sr.EventId)
			}
		}
	}))
	defer srv.Close()
	t.Setenv(IMDSEnv, strings.TrimPrefix(srv.URL, "http://"))
	se := NewScheduledEvents()
	ctx := context.Background()
	if _, ok, err := se.Interruption(ctx); ok || err != nil {
		t.Fatalf("no events: %v %v", ok, err)
	}
	at := time.Now().Add(30 * time.Second).UTC().Truncate(time.Second)
	events = []map[string]any{
		{"EventId": "other", "EventType": "Preempt", "Resources": []string{"vm-2"}, "NotBefore": at.Format(http.TimeFormat)},
		{"EventId": "E1", "EventType": "Preempt", "Resources": []string{"vm-1"}, "EventStatus": "Scheduled", "NotBefore": at.Format(http.TimeFormat)},
	}
	got, ok, err := se.Interruption(ctx)
	if !ok || err != nil || !got.Equal(at) {
		t.Fatalf("interruption at %s (%v %v), want %s", got, ok, err, at)
	}
	if err := se.Release(ctx); err != nil || len(approved) != 1 || approved[0] != "E1" {
		t.Errorf("approved %v (%v)", approved, err)
	}
	events = []map[string]any{{"EventId": "M1", "EventType": "Redeploy", "Resources": []string{"vm-1"}, "EventSource": "Platform"}}
	if re, err := se.Rebalance(ctx); !re || err != nil {
		t.Errorf("maintenance: %v %v", re, err)
	}
}

// Compute's own throttling (429, OperationNotAllowed, a Retry-After that
// can be twenty minutes): an error that waiting fixes, not one that halts
// the pool; and the manager sends nothing of that policy until the
// Retry-After has passed, for every pool of the subscription, instead of
// spending the policy's next token on a request bound to be refused. The
// policy is made to run out after one listing here (Azure's allows 900,
// then 300 a minute), and to refill only after two minutes, longer than
// the SDK waits for itself.
func TestComputeThrottleWaits(t *testing.T) {
	sim, err := armsim.New(armsim.Options{PollAfter: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	for _, kv := range sim.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	sim.SetComputePolicy("HighCostGetVM", 0.5, 1)
	d, _ := provider.Lookup("azure")
	raw := mustJSON(t, "endpoint: "+sim.URL+"\nresource_group: "+armsim.Group+"\nimage: "+image+"\n"+subnets("eastus")+"vm_sizes: [Standard_D2s_v5]\n")
	var pools []*Provider
	for _, name := range []string{"gpu", "cpu"} {
		p, err := d.Open(t.Context(), provider.PoolConfig{Manager: "m1", Pool: name, Section: raw, MaxLifetime: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.(*Provider).Close() })
		pools = append(pools, p.(*Provider))
	}
	ctx := context.Background()
	if _, _, err := pools[0].list(ctx, "m1", "gpu", "", 0); err != nil {
		t.Fatal(err)
	}
	_, _, err = pools[0].list(ctx, "m1", "gpu", "", 0)
	if k, code := kindOf(err); err == nil || k != errThrottle {
		t.Fatalf("a listing Compute throttles: %v (kind %d, %s), want a throttle", err, k, code)
	}
	throttled := sim.Calls()["VirtualMachinesClient.NewListAllPager (throttled by Compute)"]
	start := time.Now()
	_, _, err = pools[1].list(ctx, "m1", "cpu", "", 0)
	if k, _ := kindOf(err); err == nil || k != errThrottle || time.Since(start) > time.Second || !strings.Contains(err.Error(), "HighCostGetVM") {
		t.Errorf("another pool's listing within the Retry-After: %v after %s, want a throttle at once, naming the policy", err, time.Since(start))
	}
	if n := sim.Calls()["VirtualMachinesClient.NewListAllPager (throttled by Compute)"]; n != throttled {
		t.Errorf("%d more listings sent within the Retry-After", n-throttled)
	}
	// Creating a VM is another policy: it goes on.
	if _, err := pools[1].Create(ctx, spec("cpu-1")); err != nil {
		t.Errorf("a creation while listings are throttled: %v", err)
	}
}
