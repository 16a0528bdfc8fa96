package azure

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/internal/testbed/vmboot"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// handoffPool is a pool with handoff_url, its desk served as the manager
// serves it, and the stand-in's root as Microsoft's.
func handoffPool(t *testing.T) (*Provider, *armsim.Server, string) {
	t.Helper()
	manager := vmboot.NewManager(t, "gpu")
	sim, err := armsim.New(armsim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	s, err := DecodeSection(mustJSON(t, "resource_group: "+armsim.Group+"\nimage: "+image+"\n"+subnets("eastus")+"vm_sizes: [Standard_NC4as_T4_v3]\n"+
		"handoff_url: "+manager.URL+"\nattested_roots: "+sim.AttestedRoots()+"\n"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{API: simAPI(t, sim), Subscription: armsim.Subscription, Manager: "m1", Pool: "gpu", Section: s, IdleTimeout: time.Minute, Lifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	manager.Serve(t, p.HandoffHandler())
	return p, sim, manager.URL + "/handoff/gpu"
}

// onVM points the VM side at the VM's stand-in IMDS and returns the plan
// its custom data holds, with a power-off that leaves a mark.
func onVM(t *testing.T, sim *armsim.Server, name string) (bootstrap.Plan, string) {
	t.Helper()
	md := httptest.NewServer(sim.IMDSHandler(name))
	t.Cleanup(md.Close)
	t.Setenv(IMDSEnv, strings.TrimPrefix(md.URL, "http://"))
	var data string
	for _, v := range sim.VMs() {
		if v.Name == name {
			data = v.CustomData
		}
	}
	plan, err := vmboot.PlanOf(data)
	if err != nil || plan.Handoff == nil {
		t.Fatalf("no plan with a handoff in the custom data (%v):\n%s", err, data)
	}
	dir := t.TempDir()
	off := filepath.Join(dir, "off")
	plan.Workdir, plan.Poweroff = filepath.Join(dir, "work"), []string{"/bin/sh", "-c", "touch " + off}
	return plan, off
}

func attestedOf(ctx context.Context, audience string) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+os.Getenv(IMDSEnv)+"/metadata/attested/document?api-version="+AttestedVersion+"&nonce="+Nonce(audience), nil)
	req.Header.Set("Metadata", "true")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b), nil
}

// Nothing secret in a VM's custom data: each VM proves who it is with its
// attested data and takes its own runner's assignment, once; a job step
// that asks again gets nothing, and a document for another key, one
// signed by anyone else or one of another VM's is refused.
func TestVMClaimsItsAssignment(t *testing.T) {
	p, sim, desk := handoffPool(t)
	ctx := context.Background()
	insts := map[string]provider.Instance{}
	for _, name := range []string{"gpu-1", "gpu-2"} {
		s := provider.Spec{Name: name, Manager: "m1", Pool: "gpu", Command: "/bin/sh", Args: []string{"-c", "cat .runner"},
			Files: map[string][]byte{".runner": []byte(`{"token":"single-use-` + name + `"}`)}}
		inst, err := p.Create(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		insts[name] = inst
	}
	for _, v := range sim.VMs() {
		if strings.Contains(v.CustomData, "single-use") || strings.Contains(v.CustomData, ".runner") || strings.Contains(v.CustomData, "gpu-1") || strings.Contains(v.CustomData, "gpu-2") {
			t.Errorf("VM %s's custom data holds a runner's credential or name:\n%s", v.Name, v.CustomData)
		}
	}
	plan, off := onVM(t, sim, insts["gpu-1"].ID)
	if plan.Handoff.Source != SourceAttested || plan.Handoff.Params["url"] != desk {
		t.Fatalf("handoff %+v, want %s at %s", plan.Handoff, SourceAttested, desk)
	}
	var out bytes.Buffer
	why, err := bootstrap.Run(ctx, plan, bootstrap.Options{Output: &out, Tick: 50 * time.Millisecond})
	if err != nil || why != bootstrap.EndAgent || !strings.Contains(out.String(), "single-use-gpu-1") {
		t.Fatalf("why %q (%v), output %q: want gpu-1's agent run with gpu-1's credential", why, err, out.String())
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}
	if _, err := vm.ClaimFrom(ctx, http.DefaultClient, desk, attestedOf); !errors.Is(err, vm.ErrTaken) {
		t.Errorf("a second claim by gpu-1's VM: %v, want %v", err, vm.ErrTaken)
	}

	onVM(t, sim, insts["gpu-2"].ID)
	claim := func(token string, key []byte) int {
		body, _ := json.Marshal(vm.Claim{Token: token, Key: base64.StdEncoding.EncodeToString(key)})
		resp, err := http.Post(desk, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	seen, other := bytes.Repeat([]byte{7}, 32), bytes.Repeat([]byte{9}, 32)
	doc, err := attestedOf(ctx, vm.Audience(desk, seen))
	if err != nil {
		t.Fatal(err)
	}
	if code := claim(doc, other); code != http.StatusForbidden {
		t.Errorf("attested data whose nonce binds another key: %d, want 403", code)
	}
	a, err := vm.ClaimFrom(ctx, http.DefaultClient, desk, attestedOf)
	if err != nil || a.Runner != "gpu-2" || !strings.Contains(string(a.Files[".runner"]), "single-use-gpu-2") {
		t.Fatalf("gpu-2's VM got %q (%v), want gpu-2's assignment", a.Runner, err)
	}

	t.Run("not proven", func(t *testing.T) {
		other, err := armsim.New(armsim.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		doc, _ := attestedOf(ctx, "aud")
		for _, tt := range []struct {
			what, roots, sub, aud, want string
		}{
			{"a chain to another root", other.AttestedRoots(), armsim.Subscription, "aud", "certificate"},
			{"a chain to no system root", "", armsim.Subscription, "aud", "certificate"},
			{"another subscription's VM", sim.AttestedRoots(), "00000000-0000-0000-0000-000000000000", "aud", "subscription"},
			{"another claim's nonce", sim.AttestedRoots(), armsim.Subscription, "other", "nonce"},
		} {
			a, err := newAttestation(tt.sub, tt.roots, time.Now)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := a.verify(ctx, doc, tt.aud); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("%s: %v, want refused (%s)", tt.what, err, tt.want)
			}
		}
		// The system's roots: a forged document names any URL for its
		// issuer, and the manager fetches only Microsoft's.
		before := sim.IssuerFetches()
		sys, _ := newAttestation(armsim.Subscription, "", time.Now)
		if _, err := sys.verify(ctx, doc, "aud"); err == nil || sim.IssuerFetches() != before {
			t.Errorf("with the system's roots: %v, and %d fetches of a stand-in's AIA URL, want refused and none", err, sim.IssuerFetches()-before)
		}
		a, _ := newAttestation(armsim.Subscription, sim.AttestedRoots(), time.Now)
		if id, err := a.verify(ctx, doc, "aud"); err != nil || id == "" {
			t.Errorf("the VM's own document: %q, %v", id, err)
		}
	})
}
