package bitbucket

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/testbed/bbsim"
)

const token = "bb-access-token-must-not-leak"

func newSim(t *testing.T, opt bbsim.Options) *bbsim.Server {
	t.Helper()
	if opt.Token == "" {
		opt.Token = token
	}
	if opt.Repos == nil {
		opt.Repos = []string{"models"}
	}
	sim := bbsim.New(opt)
	t.Cleanup(sim.Close)
	return sim
}

func newDriver(t *testing.T, sim *bbsim.Server, mod ...func(*Config)) *Driver {
	t.Helper()
	cfg := Config{URL: sim.URL, Workspace: "acme", Repository: "models", Token: token, Manager: "m1", CacheTTL: -1}
	for _, m := range mod {
		m(&cfg)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func runnerNamed(sim *bbsim.Server, name string) bbsim.Runner {
	for _, r := range sim.Runners() {
		if r.Name == name {
			return r
		}
	}
	return bbsim.Runner{}
}

// TestRunnerLife: a runner is created with the pool's labels and its own
// OAuth client, listed by its runner name, busy with a step, refused
// removal while busy (and disabled meanwhile, so no other step comes),
// and deleted with one call once a listing shows it disabled and idle.
func TestRunnerLife(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu", "CUDA=12.4"}})
	if err != nil {
		t.Fatal(err)
	}
	r := runnerNamed(sim, "m1.gpu-1")
	if r.UUID == "" {
		t.Fatalf("no runner m1.gpu-1 at Bitbucket: %+v", sim.Runners())
	}
	if want := []string{"self.hosted", "linux", "gpu", "cuda.12.4"}; !slices.Equal(r.Labels, want) {
		t.Errorf("labels %v, want %v", r.Labels, want)
	}
	want := map[string]string{EnvAccount: sim.WorkspaceUUID(), EnvRepository: sim.RepoUUID("models"), EnvRunner: r.UUID,
		EnvClientID: r.ClientID, EnvClientSecret: r.Secret, EnvAPI: sim.URL}
	for k, v := range want {
		if cred.Env[k] != v {
			t.Errorf("credential %s = %q, want %q", k, cred.Env[k], v)
		}
	}
	if cred.RunnerID != idOf(r.UUID) || len(cred.Files) != 0 {
		t.Errorf("credential id %d files %v", cred.RunnerID, cred.Files)
	}
	list, err := d.Runners(ctx)
	if err != nil || len(list) != 1 || list[0].Name != "gpu-1" || list[0].Status != forge.StatusOffline {
		t.Fatalf("runners %+v, %v; want gpu-1 offline", list, err)
	}
	if err := sim.Connect(r.UUID); err != nil {
		t.Fatal(err)
	}
	if list, _ = d.Runners(ctx); list[0].Status != forge.StatusIdle {
		t.Fatalf("connected runner listed %+v, want idle", list[0])
	}
	steps, _ := sim.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"},
		bbsim.StepSpec{Name: "lint", Script: "true"})
	jobs, err := d.Jobs(ctx, forge.JobQueued)
	if err != nil || len(jobs) != 1 || jobs[0].Name != "train" || !slices.Equal(jobs[0].Labels, []string{"self.hosted", "gpu"}) {
		t.Fatalf("queued jobs %+v, %v; want train on [self.hosted gpu] (lint runs on Bitbucket's machines)", jobs, err)
	}
	if got := sim.Take(r.UUID); got != steps[0] {
		t.Fatalf("runner took %q, want %s", got, steps[0])
	}
	if list, _ = d.Runners(ctx); list[0].Status != forge.StatusBusy || list[0].Cordoned {
		t.Fatalf("runner with a step listed %+v, want busy, not cordoned", list[0])
	}
	if jobs, _ = d.Jobs(ctx, forge.JobInProgress); len(jobs) != 1 {
		t.Errorf("in progress: %+v", jobs)
	}
	if err := d.RemoveRunner(ctx, cred.RunnerID); !errors.Is(err, forge.ErrBusy) {
		t.Fatalf("removing a busy runner: %v, want ErrBusy", err)
	}
	if r = runnerNamed(sim, "m1.gpu-1"); r.Enabled || r.Deleted {
		t.Fatalf("after a refused removal the runner is %+v, want disabled and kept", r)
	}
	if err := sim.Finish(steps[0], "SUCCESSFUL"); err != nil {
		t.Fatal(err)
	}
	if list, _ = d.Runners(ctx); list[0].Status != forge.StatusIdle || !list[0].Cordoned {
		t.Fatalf("disabled runner after its step listed %+v, want idle and cordoned", list[0])
	}
	before := len(sim.Calls())
	if err := d.RemoveRunner(ctx, cred.RunnerID); err != nil {
		t.Fatal(err)
	}
	if calls := sim.Calls()[before:]; len(calls) != 1 || calls[0].Method != "DELETE" {
		t.Errorf("removing a runner listed disabled and idle took %+v, want one DELETE", calls)
	}
	if n := len(sim.Runners()); n != 0 {
		t.Errorf("%d runners left", n)
	}
	if err := d.RemoveRunner(ctx, cred.RunnerID); !errors.Is(err, forge.ErrNotFound) {
		t.Errorf("removing it again: %v, want ErrNotFound", err)
	}
	checkCalls(t, sim)
}

// checkCalls holds the driver to the calls it may make: the autoscaler's
// runner calls and the documented reads, each with the body it takes,
// nothing else; and none answered with an error but those of the faults a
// test sets.
func checkCalls(t *testing.T, sim *bbsim.Server) {
	t.Helper()
	for _, u := range sim.Unexpected() {
		t.Errorf("the driver sent %s", u)
	}
	for _, c := range sim.Calls() {
		if !c.Runner && c.Status >= 400 && c.Status != 404 && c.Status != 429 && c.Status != 503 {
			t.Errorf("%s %s answered %d", c.Method, c.Route, c.Status)
		}
	}
}

// TestWorkspaceScopeAndPages: workspace runners, an other manager's runner
// left alone, and the steps of a pipeline read across pages.
func TestWorkspaceScopeAndPages(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{Repos: []string{"models", "data"}})
	d := newDriver(t, sim, func(c *Config) { c.Repository, c.Repositories = "", []string{"models", "data"} })
	other := newDriver(t, sim, func(c *Config) { c.Repository, c.Manager = "", "m2" })
	if _, err := other.Register(ctx, forge.RunnerRequest{Name: "cpu-1"}); err != nil {
		t.Fatal(err)
	}
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "cpu-1", Labels: []string{"cpu"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := cred.Env[EnvRepository]; ok {
		t.Error("a workspace runner's credential names a repository")
	}
	list, err := d.Runners(ctx)
	if err != nil || len(list) != 1 || list[0].ID != cred.RunnerID {
		t.Fatalf("runners %+v, %v; want this manager's one", list, err)
	}
	var specs []bbsim.StepSpec
	for i := range 120 {
		specs = append(specs, bbsim.StepSpec{Name: fmt.Sprintf("shard %d", i), RunsOn: []string{"self.hosted", "cpu"}, Script: "true"})
	}
	if _, err := sim.RunPipeline("data", specs...); err != nil {
		t.Fatal(err)
	}
	jobs, err := d.Jobs(ctx, forge.JobQueued)
	if err != nil || len(jobs) != 120 {
		t.Fatalf("%d queued jobs, %v; want 120 across two pages of steps", len(jobs), err)
	}
	ids := map[int64]bool{}
	for _, j := range jobs {
		ids[j.ID] = true
	}
	if len(ids) != 120 {
		t.Errorf("%d distinct job ids for 120 steps", len(ids))
	}
	if err := d.RemoveRunner(ctx, cred.RunnerID); err != nil {
		t.Fatal(err)
	}
	if n := len(sim.Runners()); n != 1 {
		t.Errorf("%d runners left, want the other manager's", n)
	}
	only := newDriver(t, sim, func(c *Config) { c.Repository = "" })
	if _, err := only.Jobs(ctx, forge.JobQueued); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("jobs of a workspace with no repositories named: %v, want ErrUnsupported", err)
	}
	checkCalls(t, sim)
}

// TestCredentials: an access token is a bearer token, CML's REPO_TOKEN
// (base64 of user:password) and an app password with username are basic;
// a refused one is an error no retry fixes, and names no secret.
func TestCredentials(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{User: "ci-bot", Password: "app-password-must-not-leak"})
	repoToken := base64.StdEncoding.EncodeToString([]byte("ci-bot:app-password-must-not-leak"))
	for name, mod := range map[string]func(*Config){
		"access token": func(*Config) {},
		"REPO_TOKEN":   func(c *Config) { c.Token = repoToken },
		"app password": func(c *Config) { c.Username, c.Token = "ci-bot", "app-password-must-not-leak" },
	} {
		if _, err := newDriver(t, sim, mod).Runners(ctx); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	_, err := newDriver(t, sim, func(c *Config) { c.Token = "wrong-token-must-not-leak" }).Runners(ctx)
	if !errors.Is(err, forge.ErrRejected) || status(err) != 401 {
		t.Errorf("a wrong token: %v, want a 401 wrapping ErrRejected", err)
	}
	if err != nil && strings.Contains(err.Error(), "must-not-leak") {
		t.Errorf("the error names the secret: %v", err)
	}
	_, err = newDriver(t, sim, func(c *Config) { c.Repository = "nope" }).Runners(ctx)
	if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "nope") {
		t.Errorf("a repository that does not exist: %v, want ErrRejected naming it", err)
	}
}

// TestRateLimitAndOutage: a 429 is waited out and sent again; an outage is
// an error a retry may fix, not a refusal.
func TestRateLimitAndOutage(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	sim.Throttle(2)
	start := time.Now()
	if _, err := d.Runners(ctx); err != nil {
		t.Fatalf("after two 429s: %v", err)
	}
	if took := time.Since(start); took < firstHold {
		t.Errorf("sent again after %s, before the wait", took)
	}
	if st := d.Stats(); st.RateLimitWaits < 2 || sim.Limited() != 2 {
		t.Errorf("stats %+v, limited %d", st, sim.Limited())
	}
	sim.SetDown(true)
	_, err := d.Register(ctx, forge.RunnerRequest{Name: "x-1"})
	if err == nil || errors.Is(err, forge.ErrRejected) || status(err) != 503 {
		t.Errorf("during an outage: %v, want a 503 that is no refusal", err)
	}
	sim.SetDown(false)
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "x-1", Labels: []string{"Bad Label!"}}); err != nil {
		t.Errorf("a label mapped to Bitbucket's form: %v", err)
	}
	checkCalls(t, sim)
}

func TestStepLabels(t *testing.T) {
	yml := `
definitions:
  steps:
    - step: &build
        name: Build
        runs-on: [self.hosted, linux, gpu]
        script: [make]
pipelines:
  default:
    - step: *build
    - parallel:
        - step:
            name: Test
            runs-on:
              - self.hosted
              - GPU.A100
            script: [make test]
        - step:
            name: Lint
            script: [make lint]
    - stage:
        name: Deploy
        steps:
          - step:
              name: Push
              runs-on: self.hosted
              script: [make push]
  custom:
    nightly:
      - step:
          name: Nightly
          runs-on: [self.hosted, cpu]
          script: [make nightly]
`
	got, err := StepLabels([]byte(yml))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		"Build": {"self.hosted", "linux", "gpu"}, "Test": {"self.hosted", "gpu.a100"},
		"Push": {"self.hosted"}, "Nightly": {"self.hosted", "cpu"},
	}
	if len(got) != len(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if !slices.Equal(got[k], v) {
			t.Errorf("%s: %v, want %v", k, got[k], v)
		}
	}
	if _, err := StepLabels([]byte("pipelines: [")); err == nil {
		t.Error("a broken file parsed")
	}
}

func TestIDOf(t *testing.T) {
	a, b := idOf("{670ea89c-e64d-5923-8ccc-06d67fae8039}"), idOf("{670ea89c-e64d-5923-8ccc-06d67fae803a}")
	if a <= 0 || a != idOf("670ea89c-e64d-5923-8ccc-06d67fae8039") || a != b {
		t.Errorf("ids %d %d: want the first 63 bits, braces or none", a, b)
	}
	if idOf("") != 1 {
		t.Error("an empty uuid is not id 1")
	}
}

// TestUnexpectedCallsAreSeen: the simulator's record tells a call outside
// the set a manager may make, so that checkCalls can fail.
func TestUnexpectedCallsAreSeen(t *testing.T) {
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	_ = d.call(context.Background(), "stray", "GET", "/2.0/user", nil, nil)
	if u := sim.Unexpected(); len(u) != 1 || !strings.Contains(u[0], "no such call") {
		t.Errorf("a stray call recorded as %v", u)
	}
}

// TestLostStepReruns: a runner lost while it ran a step has the step's
// pipeline run again once it ended, on the same target; once.
func TestLostStepReruns(t *testing.T) {
	rerunPoll = 50 * time.Millisecond
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu"}})
	if err != nil {
		t.Fatal(err)
	}
	r := runnerNamed(sim, "m1.gpu-1")
	_ = sim.Connect(r.UUID)
	steps, _ := sim.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"})
	sim.Take(r.UUID)
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	d.Lost(ctx, forge.Runner{ID: cred.RunnerID, Name: "gpu-1"})
	time.Sleep(200 * time.Millisecond)
	if n := len(sim.Steps()); n != 1 {
		t.Fatalf("%d steps while the lost step's pipeline runs, want 1 (no re-run before it ends)", n)
	}
	if err := sim.Finish(steps[0], "ERROR"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(sim.Steps()) < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	d.Lost(ctx, forge.Runner{ID: cred.RunnerID, Name: "gpu-1"})
	time.Sleep(300 * time.Millisecond)
	all := sim.Steps()
	if len(all) != 2 || all[1].Name != "train" || all[1].State != "PENDING" || all[1].Build != 2 {
		t.Fatalf("steps after the re-run %+v, want train once more, pending, in pipeline 2", all)
	}
	checkCalls(t, sim)
}

// TestRunnerLimitIsNoRefusal: a scope at Bitbucket's 100 runners refuses
// a creation with a 400 that is not a config error: the pool retries it
// later instead of halting; a bad label is one.
func TestRunnerLimitIsNoRefusal(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim, func(c *Config) { c.Manager = "filler" })
	for i := range 100 {
		if _, err := d.Register(ctx, forge.RunnerRequest{Name: fmt.Sprintf("p-%d", i+1)}); err != nil {
			t.Fatal(err)
		}
	}
	_, err := newDriver(t, sim).Register(ctx, forge.RunnerRequest{Name: "p-1"})
	if err == nil || errors.Is(err, forge.ErrRejected) || status(err) != 400 {
		t.Errorf("at the limit: %v, want a 400 that is no refusal", err)
	}
	sim2 := newSim(t, bbsim.Options{})
	d2 := newDriver(t, sim2)
	err = d2.call(ctx, "x", "POST", mustPath(t, d2), map[string]any{"name": "x", "labels": []string{"Bad!"}}, nil)
	if status(err) != 400 || atRunnerLimit(err) {
		t.Errorf("a bad label: %v, want a 400 that is a refusal", err)
	}
}

func mustPath(t *testing.T, d *Driver) string {
	t.Helper()
	p, err := d.runnersPath(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return p
}
