package daemon_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/daemon"
)

const toyFleet = `
id: toy-manager
state_dir: %s
resync: 200ms
drain_timeout: 10s
forges:
  - name: playground
    type: toy
    url: http://toy.invalid
    token: ${TOY_FORGE_TOKEN}
    queue: q1
    poll_interval: 0s
pools:
  - name: toys
    labels: [toy]
    size: 1
    agent: {path: /opt/toy-agent}
    toy:
      flavour: small
`

// TestToyDrivers adds a forge and a provider in test files alone, builds
// a fleet from YAML through the path `runfleet serve` uses (config.Load's
// Parse, daemon.New, Fleet.Run), and runs its pool through a job to the
// runner's replacement.
func TestToyDrivers(t *testing.T) {
	t.Setenv("TOY_FORGE_TOKEN", "toy-forge-secret")
	fleet, f := toyFleetOn(t, t.TempDir())
	v, _ := toyProviders.Load("toys")
	p := v.(*toyProvider)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { fleet.Run(ctx); close(done) }()

	first := waitOne(t, p, "")
	if first.spec.Command != "/opt/toy-agent" || first.spec.Env["TOY_RUNNER_TOKEN"] == "" {
		t.Errorf("spec %+v: want the pool's agent with its runner's own credential", first.spec)
	}
	for _, v := range first.spec.Env {
		if strings.Contains(v, "toy-forge-secret") {
			t.Fatal("the forge's token reached a runner")
		}
	}
	// The agent connects, takes a job, finishes it and exits; the forge
	// drops its registration.
	f.set(first.inst.Name, forge.StatusIdle)
	waitState(t, fleet, "idle")
	f.set(first.inst.Name, forge.StatusBusy)
	waitState(t, fleet, "busy")
	f.end(first.inst.Name)
	p.exit(first.inst.Name)

	second := waitOne(t, p, first.inst.ID)
	if reg, issued := f.count(); reg != 1 || issued != 2 {
		t.Errorf("registrations %d, issued %d: want the replacement's alone, 2 in all", reg, issued)
	}
	if second.spec.Env["TOY_RUNNER_TOKEN"] == first.spec.Env["TOY_RUNNER_TOKEN"] {
		t.Error("the replacement reuses a credential")
	}
	cancel()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return")
	}
	// Drained: the idle replacement went, registration first.
	if reg, _ := f.count(); reg != 0 || len(p.running()) != 0 {
		t.Errorf("after the drain: %d registrations, machines %v", reg, p.running())
	}
}

// A re-run of a lost runner's job that an earlier manager on the same
// state owed (it drained, or died, before the job's run ended, and the
// forge then deleted the runner's registration, so that no pass finds
// the runner lost again) is taken up when the next manager starts, and
// is owed no more once done.
func TestOwedRerunTakenUp(t *testing.T) {
	t.Setenv("TOY_FORGE_TOKEN", "x")
	state := t.TempDir()
	owed := forge.LedgerDir{Dir: filepath.Join(state, "owed", "playground")}
	owed.Owe("name toys-9", forge.Runner{Name: "toys-9"})
	fleet, f := toyFleetOn(t, state)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { fleet.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Equal(f.reruns(), []string{"toys-9"}) || len(owed.Owed()) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("re-runs %v, still owed %+v: want toys-9's job re-run, nothing owed", f.reruns(), owed.Owed())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// toyFleetOn builds the toy fleet on a state directory, through the path
// `runfleet serve` uses (config.Load's Parse, daemon.New), and returns it
// with its forge.
func toyFleetOn(t testing.TB, state string) (*daemon.Fleet, *toyForge) {
	t.Helper()
	cfg, err := config.Parse([]byte(strings.Replace(toyFleet, "%s", state, 1)))
	if err != nil {
		t.Fatal(err)
	}
	fleet, err := daemon.New(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	toyMu.Lock()
	defer toyMu.Unlock()
	return fleet, toyForges["q1"]
}

// A toy section's problem is named by its full path, with the common
// fields' problems, in one error.
func TestToySectionErrors(t *testing.T) {
	t.Setenv("TOY_FORGE_TOKEN", "x")
	doc := strings.Replace(toyFleet, "%s", t.TempDir(), 1)
	doc = strings.Replace(doc, "flavour: small", "flavour: huge", 1)
	doc = strings.Replace(doc, "queue: q1", "queue: ''", 1)
	doc = strings.Replace(doc, "size: 1", "size: -1", 1)
	_, err := config.Parse([]byte(doc))
	for _, want := range []string{`pools[0].toy.flavour: "huge" is not small, large or handoff`, "forges[0].queue: is required", "pools[0].size: must not be negative"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %q", err, want)
		}
	}
}

// waitOne waits until the pool has exactly one running machine, other
// than the one with id not, and returns it.
func waitOne(t *testing.T, p *toyProvider, not string) toyMachine {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if ms := p.running(); len(ms) == 1 {
			for _, m := range ms {
				if m.inst.ID != not {
					return m
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no single new machine; running %v", p.running())
	return toyMachine{}
}

func waitState(t *testing.T, fleet *daemon.Fleet, state string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if rs := fleet.Pools[0].Runners(); len(rs) == 1 && string(rs[0].State) == state {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("runner not %s: %+v", state, fleet.Pools[0].Runners())
}

// A pool whose machines claim their assignment from the manager needs the
// webhook listener they reach it on: without listen the fleet does not
// start; with it, /handoff/<pool> is the pool's provider's desk.
func TestHandoffNeedsTheWebhookListener(t *testing.T) {
	t.Setenv("TOY_FORGE_TOKEN", "toy-forge-secret")
	doc := strings.Replace(strings.Replace(toyFleet, "%s", t.TempDir(), 1), "flavour: small", "flavour: handoff", 1)
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := daemon.New(t.Context(), cfg, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "pools[0]: its instances claim their assignment from this manager (handoff_url), which serves them on its webhook listener: listen is not set") {
		t.Fatalf("no listen: %v", err)
	}
	cfg, err = config.Parse([]byte("listen: 127.0.0.1:0\n" + doc))
	if err != nil {
		t.Fatal(err)
	}
	fleet, err := daemon.New(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer fleet.Close()
	w := httptest.NewRecorder()
	fleet.WebhookHandler().ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/handoff/toys", strings.NewReader("{}")))
	if w.Code != http.StatusTeapot {
		t.Errorf("POST /handoff/toys: %d, want the pool's desk", w.Code)
	}
	// What the desk refused is on the status page, with the pool.
	page := fleet.Page(context.Background())
	if len(page.Pools) != 1 || !slices.Contains(page.Pools[0].Words, "1 machine claims refused at http://m/handoff/toys: the proof does not verify") {
		t.Errorf("the page's pools: %+v, want the desk's refusals told", page.Pools)
	}
}
