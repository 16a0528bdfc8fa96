package gcp_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/internal/testbed/vmboot"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/gcp"
	"github.com/runfleet/runfleet/provider/vm"
)

// handoffPool is a pool with handoff_url in the zones given
// (us-central1-a when none), its desk served as the manager serves it,
// and the stand-in's keys as Google's.
func handoffPool(t *testing.T, zones ...string) (*gcp.Provider, *gcesim.Server, string) {
	t.Helper()
	if len(zones) == 0 {
		zones = []string{"us-central1-a"}
	}
	manager := vmboot.NewManager(t, "gpu")
	sim, err := gcesim.New(gcesim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	t.Setenv(gcp.CredentialsDataEnv, string(sim.Credentials()))
	p := open(t, "m1", sim, "zones: ["+strings.Join(zones, ", ")+"]\nmachine_types: [n1-standard-8]\nservice_account: runner@runfleet-e2e.iam.gserviceaccount.com\n"+
		"handoff_url: "+manager.URL+"\nidentity_certs: "+sim.CertsURL()+"\n")
	manager.Serve(t, p.HandoffHandler())
	return p, sim, manager.URL + "/handoff/gpu"
}

// onInstance points the metadata client at the instance's stand-in
// metadata server and returns the plan its startup-script holds, with a
// power-off that leaves a mark.
func onGCEInstance(t *testing.T, sim *gcesim.Server, name string) (bootstrap.Plan, string) {
	t.Helper()
	md := httptest.NewServer(sim.MetadataHandler(name))
	t.Cleanup(md.Close)
	t.Setenv("GCE_METADATA_HOST", strings.TrimPrefix(md.URL, "http://"))
	var in gcesim.Instance
	for _, i := range sim.Instances() {
		if i.Name == name {
			in = i
		}
	}
	plan, err := vmboot.PlanOf(in.Metadata["startup-script"])
	if err != nil || plan.Handoff == nil {
		t.Fatalf("no plan with a handoff in the startup-script (%v):\n%s", err, in.Metadata["startup-script"])
	}
	dir := t.TempDir()
	off := filepath.Join(dir, "off")
	plan.Workdir, plan.Poweroff = filepath.Join(dir, "work"), []string{"/bin/sh", "-c", "touch " + off}
	return plan, off
}

// Nothing secret in an instance's metadata: each instance proves who it
// is with its identity token and takes its own runner's assignment, once;
// a job step that asks again, with a token of its own, gets nothing.
func TestInstanceClaimsItsAssignment(t *testing.T) {
	p, sim, desk := handoffPool(t)
	ctx := context.Background()
	insts := map[string]provider.Instance{}
	for _, name := range []string{"gpu-1", "gpu-2"} {
		s := spec(name)
		s.Command, s.Args = "/bin/sh", []string{"-c", "cat .runner"}
		s.Files = map[string][]byte{".runner": []byte(`{"token":"single-use-` + name + `"}`)}
		inst, err := p.Create(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		insts[name] = inst
	}
	for _, in := range sim.Instances() {
		for k, v := range in.Metadata {
			for _, secret := range []string{"single-use", base64.StdEncoding.EncodeToString([]byte(`{"token":"single-use`))[:20], ".runner"} {
				if strings.Contains(v, secret) {
					t.Errorf("instance %s's metadata %s holds %q", in.Name, k, secret)
				}
			}
		}
		if s := in.Metadata["startup-script"]; strings.Contains(s, "gpu-1") || strings.Contains(s, "gpu-2") {
			t.Errorf("instance %s's startup-script names a runner:\n%s", in.Name, s)
		}
	}

	plan, off := onGCEInstance(t, sim, insts["gpu-1"].ID)
	if plan.Handoff.Source != gcp.SourceIdentity || plan.Handoff.Params["url"] != desk {
		t.Fatalf("handoff %+v, want %s at %s", plan.Handoff, gcp.SourceIdentity, desk)
	}
	var out bytes.Buffer
	why, err := bootstrap.Run(ctx, plan, bootstrap.Options{Output: &out, Tick: 50 * time.Millisecond})
	if err != nil || why != bootstrap.EndAgent || !strings.Contains(out.String(), "single-use-gpu-1") {
		t.Fatalf("why %q (%v), output %q: want gpu-1's agent run with gpu-1's credential", why, err, out.String())
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}

	identity := func(ctx context.Context, audience string) (string, error) {
		return metadataGet(ctx, "instance/service-accounts/default/identity?format=full&audience="+url.QueryEscape(audience))
	}
	t.Run("asked again", func(t *testing.T) {
		_, err := vm.ClaimFrom(ctx, http.DefaultClient, desk, identity)
		if !errors.Is(err, vm.ErrTaken) {
			t.Fatalf("a second claim by gpu-1's instance: %v, want %v", err, vm.ErrTaken)
		}
	})
	t.Run("each its own", func(t *testing.T) {
		onGCEInstance(t, sim, insts["gpu-2"].ID)
		a, err := vm.ClaimFrom(ctx, http.DefaultClient, desk, identity)
		if err != nil || a.Runner != "gpu-2" || !strings.Contains(string(a.Files[".runner"]), "single-use-gpu-2") {
			t.Fatalf("gpu-2's instance got %q %q (%v), want gpu-2's assignment", a.Runner, a.Files[".runner"], err)
		}
	})
}

// A token is good only for the key its audience binds, and only Google's
// signature counts: a token seen on its way, sent with another key, and
// one signed by anyone else are refused.
func TestClaimsThatDoNotProve(t *testing.T) {
	p, sim, desk := handoffPool(t)
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	onGCEInstance(t, sim, inst.ID)
	claim := func(token string, key []byte) int {
		body, _ := json.Marshal(vm.Claim{Token: token, Key: base64.StdEncoding.EncodeToString(key)})
		resp, err := http.Post(desk, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	seen := bytes.Repeat([]byte{7}, 32) // an X25519 public key
	other := bytes.Repeat([]byte{9}, 32)
	tok, err := metadataGet(ctx, "instance/service-accounts/default/identity?format=full&audience="+url.QueryEscape(vm.Audience(desk, seen)))
	if err != nil {
		t.Fatal(err)
	}
	if code := claim(tok, other); code != http.StatusForbidden {
		t.Errorf("a token bound to another key: %d, want 403", code)
	}
	parts := strings.Split(tok, ".")
	forged := parts[0] + "." + parts[1] + "." + base64.RawURLEncoding.EncodeToString(bytes.Repeat([]byte{1}, 256))
	if code := claim(forged, seen); code != http.StatusForbidden {
		t.Errorf("a token not signed by Google: %d, want 403", code)
	}
	if code := claim("not a token", seen); code != http.StatusForbidden {
		t.Errorf("no token at all: %d, want 403", code)
	}
	if !strings.Contains(p.HandoffHandler().(*vm.Desk).URL, "/handoff/gpu") {
		t.Error("the desk is not at /handoff/<pool>")
	}

}

// A pool cannot hand off without an identity to prove.
func TestHandoffNeedsAServiceAccount(t *testing.T) {
	_, err := gcp.DecodeSection(mustJSON(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\nimage: "+image+"\nhandoff_url: http://10.0.0.2:8080\n"))
	if err == nil || !strings.Contains(err.Error(), "gcp.handoff_url: needs service_account") {
		t.Errorf("handoff_url without service_account: %v", err)
	}
	_, err = gcp.DecodeSection(mustJSON(t, "zones: [us-central1-a]\nmachine_types: [n1-standard-8]\nimage: "+image+"\nservice_account: default\nhandoff_url: 10.0.0.2:8080\n"))
	if err == nil || !strings.Contains(err.Error(), "gcp.handoff_url: \"10.0.0.2:8080\" is not an http(s) URL") {
		t.Errorf("handoff_url without a scheme: %v", err)
	}
}

// metadataGet asks the metadata server GCE_METADATA_HOST names, as any
// process on the instance can.
func metadataGet(ctx context.Context, path string) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+os.Getenv("GCE_METADATA_HOST")+"/computeMetadata/v1/"+path, nil)
	req.Header.Set("Metadata-Flavor", "Google")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", errors.New(resp.Status + ": " + string(b))
	}
	return string(b), nil
}
