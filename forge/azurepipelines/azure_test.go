package azurepipelines

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/testbed/azsim"
)

const testPAT = "azsim-pat-that-must-not-leak"

func newSim(t *testing.T, opt azsim.Options) *azsim.Server {
	t.Helper()
	opt.Token = testPAT
	opt.Pools = append(opt.Pools, "gpu")
	sim := azsim.New(opt)
	t.Cleanup(sim.Close)
	return sim
}

func newDriver(t *testing.T, sim *azsim.Server, manager string, mod ...func(*Config)) *Forge {
	t.Helper()
	cfg := Config{URL: sim.URL, Token: testPAT, PoolName: "gpu", Manager: manager, CacheTTL: -1, Logger: slog.New(slog.DiscardHandler)}
	for _, m := range mod {
		m(&cfg)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// The files an agent starts with are the agent's own format: its
// settings, its OAuth client, and a private key whose public half the
// server got, with the lengths .NET's RSA takes. The PAT is in none.
func TestRegisterWritesTheAgentsFiles(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"cuda", "gpu=a100"}})
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range cred.Files {
		if strings.Contains(string(b), testPAT) {
			t.Errorf("%s holds the PAT", name)
		}
	}
	if len(cred.Env) != 0 {
		t.Errorf("credential environment %v, want none", cred.Env)
	}
	var settings map[string]any
	if err := json.Unmarshal(cred.Files[FileAgent], &settings); err != nil {
		t.Fatal(err)
	}
	agents := sim.Agents()
	if len(agents) != 1 {
		t.Fatalf("%d agents at the server, want 1", len(agents))
	}
	a := agents[0]
	want := map[string]any{"agentId": float64(a.ID), "agentName": "gpu-1", "poolId": float64(sim.PoolID("gpu")), "poolName": "gpu", "serverUrl": sim.URL + "/", "workFolder": "_work"}
	for k, v := range want {
		if settings[k] != v {
			t.Errorf(".agent %s = %v, want %v", k, settings[k], v)
		}
	}
	var creds struct {
		Scheme string
		Data   map[string]string
	}
	if err := json.Unmarshal(cred.Files[FileCredentials], &creds); err != nil {
		t.Fatal(err)
	}
	if creds.Scheme != "OAuth" || creds.Data["clientId"] != a.ClientID || creds.Data["authorizationUrl"] != sim.URL+"/_apis/oauth2/token" || creds.Data["oauthEndpointUrl"] == "" {
		t.Errorf(".credentials %+v, want OAuth with the server's client id %s and authorization URL", creds, a.ClientID)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(cred.Files[FileRSAParams], &raw); err != nil {
		t.Fatal(err)
	}
	if string(raw["ContainerName"]) != `""` || string(raw["UseCng"]) != "false" {
		t.Errorf("ContainerName %s, UseCng %s: want the agent's defaults", raw["ContainerName"], raw["UseCng"])
	}
	params := map[string][]byte{}
	for _, k := range []string{"d", "dp", "dq", "exponent", "inverseQ", "modulus", "p", "q"} {
		var b []byte
		if err := json.Unmarshal(raw[k], &b); err != nil {
			t.Fatalf("%s: %v", k, err)
		}
		params[k] = b
	}
	n := params["modulus"]
	if len(n) != 256 || len(params["d"]) != 256 {
		t.Errorf("modulus %d bytes, d %d bytes: want 256 each", len(n), len(params["d"]))
	}
	for _, k := range []string{"p", "q", "dp", "dq", "inverseQ"} {
		if len(params[k]) != 128 {
			t.Errorf("%s is %d bytes, want 128", k, len(params[k]))
		}
	}
	key := &rsa.PrivateKey{PublicKey: rsa.PublicKey{N: new(big.Int).SetBytes(n), E: int(new(big.Int).SetBytes(params["exponent"]).Int64())},
		D: new(big.Int).SetBytes(params["d"]), Primes: []*big.Int{new(big.Int).SetBytes(params["p"]), new(big.Int).SetBytes(params["q"])}}
	if err := key.Validate(); err != nil {
		t.Fatalf("the key does not hold together: %v", err)
	}
	if !key.PublicKey.Equal(a.PublicKey) {
		t.Error("the server holds another public key than the agent's")
	}
	if a.UserCaps[CapManager] != "m1" || a.UserCaps[CapPool] != "gpu" || a.UserCaps["cuda"] != "true" || a.UserCaps["gpu"] != "a100" {
		t.Errorf("user capabilities %v, want the labels and the manager's marks", a.UserCaps)
	}
}

// A manager lists only its own agents, though another's share the pool and
// the names.
func TestRunnersAreTheManagersOwn(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	mine, theirs := newDriver(t, sim, "m1"), newDriver(t, sim, "m2")
	ctx := context.Background()
	if _, err := mine.Register(ctx, forge.RunnerRequest{Name: "gpu-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := theirs.Register(ctx, forge.RunnerRequest{Name: "gpu-2"}); err != nil {
		t.Fatal(err)
	}
	list, err := mine.Runners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].Name != "gpu-1" || list[0].Status != forge.StatusOffline {
		t.Fatalf("runners %+v, want gpu-1 alone, offline", list)
	}
}

// A server that refuses the listing's demands filter is listed whole, and
// the agents filtered here: still only the manager's own.
func TestRunnersWithoutTheServersFilter(t *testing.T) {
	sim := newSim(t, azsim.Options{NoDemandsFilter: true})
	mine, theirs := newDriver(t, sim, "m1"), newDriver(t, sim, "m2")
	ctx := context.Background()
	for d, name := range map[*Forge]string{mine: "gpu-1", theirs: "gpu-2"} {
		if _, err := d.Register(ctx, forge.RunnerRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		list, err := mine.Runners(ctx)
		if err != nil || len(list) != 1 || list[0].Name != "gpu-1" {
			t.Fatalf("runners %+v, %v: want gpu-1 alone", list, err)
		}
	}
	refused := 0
	for _, c := range sim.Calls() {
		if c.Route == "/_apis/distributedtask/pools/{poolId}/agents" && c.Method == "GET" && c.Status == 400 {
			refused++
		}
	}
	if refused != 1 {
		t.Errorf("the filter was refused %d times, want once and then not sent", refused)
	}
}

// A busy agent is never deleted: RemoveRunner disables it (so that it takes
// no other job), finds its request and refuses; once its job ends, it goes
// with one call. An idle one is disabled, read and deleted.
func TestRemoveRunner(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	busy := connect(t, sim, d, "gpu-1")
	if _, err := sim.QueueRun("gpu", azsim.JobSpec{Name: "train"}); err != nil {
		t.Fatal(err)
	}
	if err := d.RemoveRunner(ctx, busy.id); !errors.Is(err, forge.ErrBusy) {
		t.Fatalf("RemoveRunner of a busy agent: %v, want ErrBusy", err)
	}
	if a := agentByName(sim, "gpu-1"); a == nil || a.Enabled {
		t.Fatalf("the busy agent %+v: want it kept, disabled", a)
	}
	busy.finish(t, "succeeded")
	if _, err := d.Runners(ctx); err != nil { // the listing shows its job ended
		t.Fatal(err)
	}
	before := len(sim.Calls())
	if err := d.RemoveRunner(ctx, busy.id); err != nil {
		t.Fatal(err)
	}
	if calls := sim.Calls()[before:]; len(calls) != 1 || calls[0].Method != "DELETE" {
		t.Errorf("removing an agent whose job ended took %v, want one DELETE", calls)
	}
	idle := connect(t, sim, d, "gpu-2")
	before = len(sim.Calls())
	if err := d.RemoveRunner(ctx, idle.id); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range sim.Calls()[before:] {
		got = append(got, c.Method)
	}
	if !slices.Equal(got, []string{"PATCH", "GET", "DELETE"}) {
		t.Errorf("removing an idle agent sent %v, want PATCH (disable), GET (its request), DELETE", got)
	}
	for _, a := range sim.AllAgents() {
		if a.DeletedBusy {
			t.Errorf("agent %s was deleted with a job", a.Name)
		}
	}
	if err := d.RemoveRunner(ctx, idle.id); !errors.Is(err, forge.ErrNotFound) {
		t.Errorf("removing a deleted agent: %v, want ErrNotFound", err)
	}
	// An agent whose process exited takes no job: one call.
	gone := connect(t, sim, d, "gpu-3")
	before = len(sim.Calls())
	if err := d.RemoveExited(ctx, gone.id); err != nil {
		t.Fatal(err)
	}
	if calls := sim.Calls()[before:]; len(calls) != 1 || calls[0].Method != "DELETE" {
		t.Errorf("removing an exited agent took %v, want one DELETE", calls)
	}
}

// A poll of the job requests that shows a cordoned agent running none has
// seen its job end: the agent is deleted with one call.
func TestPollSeesACordonedAgentsJobEnd(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	a := connect(t, sim, d, "gpu-1")
	if _, err := sim.QueueRun("gpu", azsim.JobSpec{Name: "train"}); err != nil {
		t.Fatal(err)
	}
	if err := d.Cordon(ctx, a.id); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Jobs(ctx, forge.JobQueued); err != nil { // still running: nothing learnt
		t.Fatal(err)
	}
	a.finish(t, "succeeded")
	if _, err := d.Jobs(ctx, forge.JobQueued); err != nil {
		t.Fatal(err)
	}
	before := len(sim.Calls())
	if err := d.RemoveRunner(ctx, a.id); err != nil {
		t.Fatal(err)
	}
	if calls := sim.Calls()[before:]; len(calls) != 1 || calls[0].Method != "DELETE" {
		t.Errorf("removing an agent whose job a poll saw end took %v, want one DELETE", calls)
	}
}

// Queued job requests are the demand, their demands the labels, read page
// by page; a request that has an agent is in progress.
func TestJobsFromJobRequests(t *testing.T) {
	sim := newSim(t, azsim.Options{PageSize: 2})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	if err := d.Placehold(ctx, "gpu", []string{"cuda", "gpu=a100"}); err != nil {
		t.Fatal(err)
	}
	var specs []azsim.JobSpec
	for i := range 5 {
		specs = append(specs, azsim.JobSpec{Name: fmt.Sprintf("job %d", i), Demands: []string{"cuda", "gpu -equals a100"}})
	}
	if _, err := sim.QueueRun("gpu", specs...); err != nil {
		t.Fatal(err)
	}
	jobs, err := d.Jobs(ctx, forge.JobQueued)
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 5 {
		t.Fatalf("%d queued jobs, want 5 over three pages", len(jobs))
	}
	j := jobs[0]
	if j.Name != "job 0" || j.RunID == 0 || j.CreatedAt.IsZero() || !slices.Contains(j.Labels, "gpu -equals a100") || j.Source.Workflow != "ci" {
		t.Errorf("job %+v", j)
	}
	if !d.Meets(append([]string{"cuda", "gpu=A100"}, d.ImplicitLabels()...), j.Labels) {
		t.Errorf("a pool with cuda and gpu=A100 does not meet %v", j.Labels)
	}
	if d.Meets(append([]string{"cuda", "gpu=h100"}, d.ImplicitLabels()...), j.Labels) {
		t.Errorf("a pool with gpu=h100 meets %v", j.Labels)
	}
	if _, err := d.Jobs(ctx, forge.JobCompleted); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("completed jobs: %v, want ErrUnsupported", err)
	}
}

// A PAT the server refuses, or a pool that does not exist, is an error no
// retry fixes.
func TestRefusals(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	ctx := context.Background()
	bad := newDriver(t, sim, "m1", func(c *Config) { c.Token = "wrong" })
	if _, err := bad.Register(ctx, forge.RunnerRequest{Name: "gpu-1"}); !errors.Is(err, forge.ErrRejected) {
		t.Errorf("a wrong PAT: %v, want ErrRejected", err)
	} else if strings.Contains(err.Error(), "wrong") {
		t.Errorf("the error shows the token: %v", err)
	}
	none := newDriver(t, sim, "m1", func(c *Config) { c.PoolName = "tpu" })
	if _, err := none.Runners(ctx); !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), `"tpu"`) {
		t.Errorf("a pool that does not exist: %v, want ErrRejected naming it", err)
	}
	d := newDriver(t, sim, "m1")
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"has space"}}); !errors.Is(err, forge.ErrRejected) {
		t.Errorf("a capability the server refuses: %v, want ErrRejected", err)
	}
}

// While the service answers 503 every call fails, and none is taken for
// a refusal (the pool retries rather than halts); once it is back, the
// calls work.
func TestOutageIsNoRefusal(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	sim.SetDown(true)
	_, lerr := d.Runners(ctx)
	_, rerr := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1"})
	for what, err := range map[string]error{"listing": lerr, "register": rerr} {
		if err == nil || errors.Is(err, forge.ErrRejected) {
			t.Errorf("%s during the outage: %v, want an error that is no refusal", what, err)
		}
	}
	sim.SetDown(false)
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1"}); err != nil {
		t.Fatalf("register after the outage: %v", err)
	}
}

// 429 answers are waited out (Retry-After) and the request sent again;
// the waits are counted.
func TestRateLimitIsObeyed(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	sim.Throttle(2, time.Second)
	start := time.Now()
	if _, err := d.Runners(ctx); err != nil {
		t.Fatalf("a throttled listing: %v, want it through after the waits", err)
	}
	if took := time.Since(start); took < 2*time.Second {
		t.Errorf("took %s: the Retry-After of two 429s was not waited out", took)
	}
	st := d.Stats()
	if sim.Limited() != 2 || st.RateLimitWaits < 2 || st.RateRemaining != 190 {
		t.Errorf("429s %d, stats %+v: want 2 waits and the last remaining (190)", sim.Limited(), st)
	}
	// A wait longer than the call may take fails it at once.
	sim.Throttle(1, time.Minute)
	short := newDriver(t, sim, "m1", func(c *Config) { c.CallTimeout = 2 * time.Second })
	if _, err := short.Runners(ctx); err == nil {
		t.Error("a Retry-After of a minute within a 2s call: no error")
	}
}

// A request the service delayed for the consumption limit comes back done,
// with X-RateLimit-Remaining 0 and X-RateLimit-Reset minutes away but no
// Retry-After: the next calls go on, paced by the delay the service
// applied, not held until the reset (which failed every call for up to 5
// minutes, the disable that stops an agent's second job included).
func TestDelayedRequestsDoNotHoldUntilReset(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1", func(c *Config) { c.CallTimeout = 5 * time.Second })
	ctx := context.Background()
	a := connect(t, sim, d, "gpu-1")
	sim.Delay(3, 200*time.Millisecond)
	start := time.Now()
	for range 3 {
		if _, err := d.Runners(ctx); err != nil {
			t.Fatal(err)
		}
		d.Refresh()
	}
	if err := d.Cordon(ctx, a.id); err != nil {
		t.Fatalf("a disable after delayed answers: %v, want it through", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("4 calls took %s after 3 delayed by 200ms: held for the reset", took)
	}
	if st := d.Stats(); st.RateRemaining != 190 {
		t.Errorf("stats %+v: want the last remaining (190)", st)
	}
}

// Every request the driver sends is one it is documented to: a known
// route, with an api-version.
func TestOnlyDocumentedCalls(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	a := connect(t, sim, d, "gpu-1")
	if _, err := sim.QueueRun("gpu", azsim.JobSpec{Name: "x"}); err != nil {
		t.Fatal(err)
	}
	_ = d.Cordon(ctx, a.id)
	_, _ = d.Jobs(ctx, forge.JobQueued)
	_, _ = d.Runners(ctx)
	_ = d.RemoveRunner(ctx, a.id)
	allowed := map[string]bool{
		"OPTIONS /_apis": true, "GET /_apis/ResourceAreas": true, "GET /_apis/distributedtask/pools": true,
		"GET /_apis/distributedtask/pools/{poolId}/agents": true, "POST /_apis/distributedtask/pools/{poolId}/agents": true,
		"GET /_apis/distributedtask/pools/{poolId}/agents/{agentId}": true, "PATCH /_apis/distributedtask/pools/{poolId}/agents/{agentId}": true,
		"DELETE /_apis/distributedtask/pools/{poolId}/agents/{agentId}": true, "GET /_apis/distributedtask/pools/{poolId}/jobrequests": true,
	}
	for _, c := range sim.Calls() {
		if c.Agent {
			continue
		}
		if !allowed[c.Method+" "+c.Route] {
			t.Errorf("the driver sent %s %s", c.Method, c.Route)
		}
		if c.Method != "OPTIONS" && c.APIVersion == "" {
			t.Errorf("%s %s without an api-version", c.Method, c.Route)
		}
		if c.Status >= 400 && c.Status != 409 {
			t.Errorf("%s %s answered %d", c.Method, c.Route, c.Status)
		}
	}
}

func TestParseDemands(t *testing.T) {
	caps := capabilities([]string{"cuda", "gpu=A100", "Agent.Version=4.275.0"})
	for _, tt := range []struct {
		demands []string
		want    bool
	}{
		{[]string{"cuda"}, true},
		{[]string{"CUDA"}, true},
		{[]string{"gpu -equals a100"}, true},
		{[]string{"gpu -equals h100"}, false},
		{[]string{"gpu"}, true},
		{[]string{"tpu"}, false},
		{[]string{"Agent.Version -gtVersion 2.163.1"}, true},
		{[]string{"Agent.Version -gtVersion 5.0"}, false},
		{[]string{"gpu -like a*"}, false},
		{nil, true},
	} {
		if got := meets(caps, tt.demands); got != tt.want {
			t.Errorf("meets(%v) = %v, want %v", tt.demands, got, tt.want)
		}
	}
}

// connected is an agent registered by the driver and online at the
// simulator (a session opened for it).
type connected struct {
	sim *azsim.Server
	id  int64
}

func connect(t *testing.T, sim *azsim.Server, d *Forge, name string) connected {
	t.Helper()
	cred, err := d.Register(context.Background(), forge.RunnerRequest{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := sim.Connect(int(cred.RunnerID)); err != nil {
		t.Fatal(err)
	}
	return connected{sim: sim, id: cred.RunnerID}
}

// finish ends the job request the agent runs.
func (c connected) finish(t *testing.T, result string) {
	t.Helper()
	for _, r := range c.sim.Requests() {
		if int64(r.AgentID) == c.id && r.Result == "" {
			if err := c.sim.Complete(r.ID, result); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("agent %d runs no request", c.id)
}

func agentByName(sim *azsim.Server, name string) *azsim.Agent {
	for _, a := range sim.Agents() {
		if a.Name == name {
			return &a
		}
	}
	return nil
}

// Azure DevOps fails a job at once when no agent registered in the pool
// meets its demands: with no agent, a pool of size 0 would never see it
// queued. The pool's placeholder, registered with its capabilities and the
// system capabilities an agent reports, keeps such jobs queued; it is
// disabled, so no job is ever given to it; a second Placehold changes
// nothing, and one with other labels updates it in place.
func TestPlaceholderKeepsJobsQueued(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1")
	ctx := context.Background()
	demands := []string{"gpu -equals a100", "Agent.OS -equals Linux", "Agent.OSArchitecture -equals X64"}
	ids, err := sim.QueueRun("gpu", azsim.JobSpec{Name: "before", Demands: demands})
	if err != nil {
		t.Fatal(err)
	}
	if r := request(t, sim, ids[0]); r.Result != "failed" || !strings.Contains(string(r.Log), "No agent found in pool gpu which satisfies the specified demands") {
		t.Fatalf("a job with no agent in the pool: result %q, log %q; want it failed at once", r.Result, r.Log)
	}
	for range 2 {
		if err := d.Placehold(ctx, "gpu", []string{"gpu=a100", "cuda"}); err != nil {
			t.Fatal(err)
		}
	}
	agents := sim.Agents()
	if len(agents) != 1 || agents[0].Name != "gpu-placeholder" || agents[0].Enabled || agents[0].SystemCaps["Agent.OSArchitecture"] != "X64" {
		t.Fatalf("agents %+v, want one disabled placeholder with system capabilities", agents)
	}
	ids, err = sim.QueueRun("gpu", azsim.JobSpec{Name: "after", Demands: demands})
	if err != nil {
		t.Fatal(err)
	}
	if r := request(t, sim, ids[0]); r.Result != "" || r.AgentID != 0 {
		t.Fatalf("with the placeholder: result %q, agent %d; want it queued", r.Result, r.AgentID)
	}
	jobs, err := d.Jobs(ctx, forge.JobQueued)
	if err != nil || len(jobs) != 1 {
		t.Fatalf("queued jobs %v (%v), want the one", jobs, err)
	}
	// The pool's labels change: updated in place, never deleted, and
	// the queued job that the new labels do not meet fails.
	if err := d.Placehold(ctx, "gpu", []string{"gpu=h100"}); err != nil {
		t.Fatal(err)
	}
	if n := len(sim.AllAgents()); n != 1 {
		t.Fatalf("%d agents ever added, want the placeholder updated in place", n)
	}
	if r := request(t, sim, ids[0]); r.Result != "failed" {
		t.Fatalf("a job only the old labels met: result %q", r.Result)
	}
	// Not one of the pool's runners.
	list, err := d.Runners(ctx)
	if err != nil || len(list) != 1 || slices.Contains(list[0].Labels, CapPlaceholder) {
		t.Fatalf("runners %+v (%v)", list, err)
	}
}

func request(t *testing.T, sim *azsim.Server, id int64) azsim.Request {
	t.Helper()
	for _, r := range sim.Requests() {
		if r.ID == id {
			return r
		}
	}
	t.Fatalf("no request %d", id)
	return azsim.Request{}
}

// Azure DevOps Server takes REST API versions up to its own: 6.0 for
// Server 2020, 5.0 for 2019, and refuses a later one. Microsoft's client
// reads the server's resource locations and asks for no later version
// than each offers, the job requests call (written by hand on the same
// client) included: every call a pool makes goes through on either.
func TestAzureDevOpsServerVersions(t *testing.T) {
	for _, v := range []string{"6.0", "5.0"} {
		t.Run(v, func(t *testing.T) {
			sim := newSim(t, azsim.Options{APIVersion: v})
			// The server refuses a version later than its own.
			req, _ := http.NewRequest(http.MethodGet, sim.URL+"/_apis/distributedtask/pools?api-version=7.1", nil)
			req.SetBasicAuth("", testPAT)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "VssVersionOutOfRangeException") {
				t.Fatalf("api-version 7.1 on a %s server: %d %s", v, resp.StatusCode, body)
			}
			d := newDriver(t, sim, "m1")
			ctx := context.Background()
			if err := d.Placehold(ctx, "gpu", []string{"cuda"}); err != nil {
				t.Fatal(err)
			}
			a := connect(t, sim, d, "gpu-1")
			if _, err := sim.QueueRun("gpu", azsim.JobSpec{Name: "x", Demands: []string{"cuda"}}); err != nil {
				t.Fatal(err)
			}
			if _, err := d.Jobs(ctx, forge.JobQueued); err != nil {
				t.Fatal(err)
			}
			if _, err := d.Runners(ctx); err != nil {
				t.Fatal(err)
			}
			if err := d.Cordon(ctx, a.id); err != nil {
				t.Fatal(err)
			}
			for _, c := range sim.Calls() {
				num, _, _ := strings.Cut(c.APIVersion, "-")
				if c.APIVersion != "" && (c.Status >= 300 || compareVersions(num, v) > 0) {
					t.Errorf("%s %s at api-version %s: %d", c.Method, c.Route, c.APIVersion, c.Status)
				}
			}
		})
	}
}

// A name the pool already holds is refused: the driver looks the name up,
// as the agent's configuration does, rather than rely on the answer's
// status. One left by this manager is removed by the pool, and a retry
// adds it; another's is a refusal no retry fixes, that says what to do.
// An agent's settings carry acceptTeeEula where the forge sets it, as
// config.sh --acceptTeeEula writes it.
func TestRegisterNameTaken(t *testing.T) {
	sim := newSim(t, azsim.Options{})
	d := newDriver(t, sim, "m1", func(c *Config) { c.AcceptTeeEula = true })
	ctx := context.Background()
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1"})
	if err != nil {
		t.Fatal(err)
	}
	var settings map[string]any
	if err := json.Unmarshal(cred.Files[FileAgent], &settings); err != nil || settings["acceptTeeEula"] != true {
		t.Errorf(".agent %v (%v), want acceptTeeEula true", settings, err)
	}
	_, err = d.Register(ctx, forge.RunnerRequest{Name: "gpu-1"})
	if err == nil || errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "left in the pool from before") {
		t.Fatalf("this manager's name taken: %v, want a retryable error saying so", err)
	}
	other := newDriver(t, sim, "m2")
	_, err = other.Register(ctx, forge.RunnerRequest{Name: "gpu-1"})
	if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "not this manager's") {
		t.Fatalf("another manager's name: %v, want a refusal", err)
	}
	plain := newDriver(t, sim, "m3")
	cred, err = plain.Register(ctx, forge.RunnerRequest{Name: "gpu-2"})
	if err != nil || strings.Contains(string(cred.Files[FileAgent]), "acceptTeeEula") {
		t.Errorf(".agent %s (%v), want no acceptTeeEula unless set", cred.Files[FileAgent], err)
	}
}
