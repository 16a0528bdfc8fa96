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
	"github.com/runfleet/runfleet/internal/testbed/scopes"
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

func newDriver(t *testing.T, sim *bbsim.Server, mod ...func(*Config)) *Forge {
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

// connectedRunner registers the runner gpu-1 (labels gpu) and connects
// it, as its agent would.
func connectedRunner(t *testing.T, d *Forge, sim *bbsim.Server) (forge.Credential, bbsim.Runner) {
	t.Helper()
	cred, err := d.Register(context.Background(), forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu"}})
	if err != nil {
		t.Fatal(err)
	}
	r := runnerNamed(sim, "m1.gpu-1")
	if err := sim.Connect(r.UUID); err != nil {
		t.Fatal(err)
	}
	return cred, r
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
	// Bitbucket gave the step to the online runner at once: nothing is
	// queued (lint runs on Bitbucket's own machines).
	if jobs, err := d.Jobs(ctx, forge.JobQueued); err != nil || len(jobs) != 0 {
		t.Fatalf("queued jobs %+v, %v; want none", jobs, err)
	}
	jobs, err := d.Jobs(ctx, forge.JobInProgress)
	if err != nil || len(jobs) != 1 || jobs[0].Name != "train" || !slices.Equal(jobs[0].Labels, []string{"self.hosted", "gpu"}) {
		t.Fatalf("jobs in progress %+v, %v; want train on [self.hosted gpu]", jobs, err)
	}
	if got := sim.Take(r.UUID); got != steps[0] {
		t.Fatalf("runner took %q, want %s", got, steps[0])
	}
	if list, _ = d.Runners(ctx); list[0].Status != forge.StatusBusy || list[0].Cordoned {
		t.Fatalf("runner with a step listed %+v, want busy, not cordoned", list[0])
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
	// Where each step's code came from: the pipeline's target and creator.
	if src := jobs[0].Source; !strings.HasSuffix(src.Repository, "/data") || len(src.Commit) < 7 || src.Ref != "main" || src.Actor != "ada" {
		t.Errorf("a step's source: %+v", src)
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
// (base64 of user:token) and an API token with username are basic;
// a refused one is an error no retry fixes, and names no secret.
func TestCredentials(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{User: "ci-bot", Password: "app-password-must-not-leak"})
	repoToken := base64.StdEncoding.EncodeToString([]byte("ci-bot:app-password-must-not-leak"))
	for name, mod := range map[string]func(*Config){
		"access token": func(*Config) {},
		"REPO_TOKEN":   func(c *Config) { c.Token = repoToken },
		"API token":    func(c *Config) { c.Username, c.Token = "ci-bot", "app-password-must-not-leak" },
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
// pipeline run again at once, on the same target; once, also when the
// manager that re-ran it crashed and the next one is told of the loss
// again (before the re-run at once, a manager killed while it waited for
// the lost pipeline to end lost the re-run: TestChaosBitbucket). A lost
// runner whose step had ended is no reason to run anything again.
func TestLostStepReruns(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	cred, r := connectedRunner(t, d, sim)
	spec := bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"}
	if _, err := sim.RunPipeline("models", spec); err != nil {
		t.Fatal(err)
	}
	sim.Take(r.UUID)
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	d.Lost(ctx, forge.Runner{ID: cred.RunnerID, Name: "gpu-1"})
	waitSteps(t, sim, 2)
	all := sim.Steps()
	if all[0].State != "IN_PROGRESS" || all[1].Name != "train" || all[1].State == "COMPLETED" || all[1].Build != 2 {
		t.Fatalf("steps after the loss %+v, want train once more, not run yet, in pipeline 2, while the lost one is not over", all)
	}
	// Told again, by this manager and by a new one that knows nothing of
	// the re-run.
	d.Lost(ctx, forge.Runner{ID: cred.RunnerID, Name: "gpu-1"})
	next := newDriver(t, sim)
	if _, err := next.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	next.Lost(ctx, forge.Runner{ID: cred.RunnerID, Name: "gpu-1"})
	time.Sleep(300 * time.Millisecond)
	if n := len(sim.Steps()); n != 2 {
		t.Fatalf("%d steps after the loss was told three times, want 2 (one re-run)", n)
	}

	// A runner lost after its step ended.
	cred2, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-2", Labels: []string{"cpu"}})
	if err != nil {
		t.Fatal(err)
	}
	r2 := runnerNamed(sim, "m1.gpu-2")
	_ = sim.Connect(r2.UUID)
	spec.Name, spec.RunsOn = "eval", []string{"self.hosted", "cpu"}
	ids, _ := sim.RunPipeline("models", spec)
	if got := sim.Take(r2.UUID); got != ids[0] {
		t.Fatalf("gpu-2 took %q, want %s", got, ids[0])
	}
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sim.Finish(ids[0], "SUCCESSFUL"); err != nil {
		t.Fatal(err)
	}
	d.Lost(ctx, forge.Runner{ID: cred2.RunnerID, Name: "gpu-2"})
	time.Sleep(300 * time.Millisecond)
	if n := len(sim.Steps()); n != 3 {
		t.Fatalf("%d steps after a runner whose step had passed was lost, want 3 (no re-run)", n)
	}
	checkCalls(t, sim)
}

// waitSteps waits up to 5 s for the simulator to hold n steps.
func waitSteps(t *testing.T, sim *bbsim.Server, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); len(sim.Steps()) < n; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d steps after 5 s, want %d", len(sim.Steps()), n)
		}
	}
}

// TestRunnerLimitIsNoRefusal: a scope at Bitbucket's 100 runners refuses
// a creation with a 400 that is not a config error: the pool retries it
// later instead of halting; a bad label is one.
func TestRunnerLimitIsNoRefusal(t *testing.T) {
	ctx := context.Background()
	// The limit's words in either place Bitbucket's error object has
	// for them.
	for _, shape := range []string{"message", "detail"} {
		sim := newSim(t, bbsim.Options{ErrorShape: shape})
		d := newDriver(t, sim, func(c *Config) { c.Manager = "filler" })
		for i := range 100 {
			if _, err := d.Register(ctx, forge.RunnerRequest{Name: fmt.Sprintf("p-%d", i+1)}); err != nil {
				t.Fatal(err)
			}
		}
		_, err := newDriver(t, sim).Register(ctx, forge.RunnerRequest{Name: "p-1"})
		if err == nil || errors.Is(err, forge.ErrRejected) || status(err) != 400 || !strings.Contains(err.Error(), "Maximum number of runners") {
			t.Errorf("at the limit (its words in error.%s): %v, want a 400 that is no refusal", shape, err)
		}
	}
	sim2 := newSim(t, bbsim.Options{})
	d2 := newDriver(t, sim2)
	err := d2.call(ctx, "x", "POST", mustPath(t, d2), map[string]any{"name": "x", "labels": []string{"Bad!"}}, nil)
	if status(err) != 400 || atRunnerLimit(err) {
		t.Errorf("a bad label: %v, want a 400 that is a refusal", err)
	}
}

func mustPath(t *testing.T, d *Forge) string {
	t.Helper()
	p, err := d.runnersPath(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestExitedRunnerWithAStepIsKept: Bitbucket gives a runner its next step
// the moment its step ends, unless it was disabled first; the runner is
// stopped once its step ends, so a step given to it then never runs on
// it. The runner is not deleted while Bitbucket holds that step for it
// (as the autoscaler deletes only runners without a step); once Bitbucket
// fails the step, the runner goes and the step's pipeline is run again.
func TestExitedRunnerWithAStepIsKept(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	cred, r := connectedRunner(t, d, sim)
	spec := bbsim.StepSpec{RunsOn: []string{"self.hosted", "gpu"}, Script: "true"}
	spec2 := spec
	spec.Name, spec2.Name = "train", "eval"
	steps, _ := sim.RunPipeline("models", spec, spec2)
	if got := sim.Take(r.UUID); got != steps[0] {
		t.Fatalf("runner took %q, want %s", got, steps[0])
	}
	if err := sim.Finish(steps[0], "SUCCESSFUL"); err != nil {
		t.Fatal(err)
	}
	if r = runnerNamed(sim, "m1.gpu-1"); r.Step != steps[1] {
		t.Fatalf("after its step the enabled runner holds %q, want the next step %s", r.Step, steps[1])
	}
	if err := d.RemoveExited(ctx, cred.RunnerID); !errors.Is(err, forge.ErrBusy) {
		t.Fatalf("removing an exited runner that Bitbucket gave a step: %v, want ErrBusy", err)
	}
	if r = runnerNamed(sim, "m1.gpu-1"); r.Deleted || r.DeletedBusy {
		t.Fatalf("the runner was deleted with its step: %+v", r)
	}
	// The runner said it went offline as it stopped: Bitbucket fails the
	// step, and the driver runs its pipeline again.
	if err := sim.Offline(r.UUID); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(sim.Steps()) < 4 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	all := sim.Steps()
	if len(all) != 4 || all[1].Result != "ERROR" || all[2].Build != 2 || all[3].Name != "eval" {
		t.Fatalf("steps %+v, want eval failed with its runner and pipeline 1 run again", all)
	}
	if err := d.RemoveExited(ctx, cred.RunnerID); err != nil {
		t.Fatalf("removing the exited runner once its step failed: %v", err)
	}
	for _, r := range sim.AllRunners() {
		if r.DeletedBusy {
			t.Errorf("runner %s deleted with a step", r.Name)
		}
	}
	checkCalls(t, sim)
}

// TestStepFailedUnrunIsRerun: a runner whose step ended while no manager
// was up to disable it is given the next step, and stops before it fetches
// it; going offline, it fails that step at once, so no listing shows it
// holding the step. The manager that finds its agent exited, and never
// disabled it, runs that step's pipeline again once (before, the step
// stayed failed: TestChaosBitbucket).
func TestStepFailedUnrunIsRerun(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	if _, err := newDriver(t, sim).Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu"}}); err != nil {
		t.Fatal(err)
	}
	r := runnerNamed(sim, "m1.gpu-1")
	_ = sim.Connect(r.UUID)
	spec := bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"}
	spec2, spec3 := spec, spec
	spec2.Name = "eval"
	// A step no runner takes keeps the pipeline running: the failed step
	// is run again without waiting for it.
	spec3.Name, spec3.RunsOn = "report", []string{"self.hosted", "tpu"}
	steps, _ := sim.RunPipeline("models", spec, spec2, spec3)
	sim.Take(r.UUID)
	if err := sim.Finish(steps[0], "SUCCESSFUL"); err != nil {
		t.Fatal(err)
	}
	if err := sim.Offline(r.UUID); err != nil { // the runner stopped with eval given to it
		t.Fatal(err)
	}
	if all := sim.Steps(); all[1].Result != "ERROR" || !all[1].Started.IsZero() {
		t.Fatalf("eval %+v, want failed unrun", all[1])
	}
	// A manager started after the crash of the one that created it.
	d := newDriver(t, sim)
	list, err := d.Runners(ctx)
	if err != nil || len(list) != 1 {
		t.Fatalf("runners %v, %v", list, err)
	}
	if err := d.RemoveExited(ctx, list[0].ID); err != nil {
		t.Fatal(err)
	}
	waitSteps(t, sim, 6)
	all := sim.Steps()
	if all[2].State != "PENDING" || all[3].Build != 2 || all[3].Name != "train" || all[4].Name != "eval" {
		t.Fatalf("steps %+v, want pipeline 1 run again while it still runs", all)
	}
	// Another exited runner, seen by yet another manager: no second re-run.
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-2", Labels: []string{"cpu"}}); err != nil {
		t.Fatal(err)
	}
	d2 := newDriver(t, sim)
	list, err = d2.Runners(ctx)
	if err != nil || len(list) != 1 {
		t.Fatalf("runners %v, %v", list, err)
	}
	if err := d2.RemoveExited(ctx, list[0].ID); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if n := len(sim.Steps()); n != 6 {
		t.Fatalf("%d steps after another manager looked, want 6 (one re-run)", n)
	}
	checkCalls(t, sim)
}

// TestLateCordonLooksForStepsFailedUnrun: the pool disables a runner once
// its agent took a step; a runner that Bitbucket says runs none by then
// had its step end first (a step shorter than the pool's look), so it may
// have been given the next and failed it as it stopped. Once deleted, that
// step's pipeline runs again.
func TestLateCordonLooksForStepsFailedUnrun(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	d := newDriver(t, sim)
	cred, r := connectedRunner(t, d, sim)
	spec := bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"}
	steps, _ := sim.RunPipeline("models", spec, spec)
	sim.Take(r.UUID)
	if err := sim.Finish(steps[0], "SUCCESSFUL"); err != nil {
		t.Fatal(err)
	}
	if err := sim.Offline(r.UUID); err != nil {
		t.Fatal(err)
	}
	if err := d.Cordon(ctx, cred.RunnerID); err != nil {
		t.Fatal(err)
	}
	if err := d.RemoveRunner(ctx, cred.RunnerID); err != nil {
		t.Fatal(err)
	}
	waitSteps(t, sim, 4)
	if all := sim.Steps(); all[2].Build != 2 {
		t.Fatalf("steps %+v, want pipeline 1 run again", all)
	}
	checkCalls(t, sim)
}

// The permissions docs/forges/bitbucket.md lists are enough for a pool,
// and each is needed: with read:repository, read:pipeline and
// write:runner (and write:pipeline to re-run a lost step) the driver
// finds its scope, polls, creates, lists, disables and deletes runners;
// without one of them, the calls that need it are refused with an error
// naming the scope Bitbucket requires (forge.ErrRejected).
func TestLeastScopes(t *testing.T) {
	least := []string{"read:repository:bitbucket", "read:pipeline:bitbucket", "write:pipeline:bitbucket", "write:runner:bitbucket"}
	steps := func(d *Forge, sim *bbsim.Server) map[string]error {
		ctx := context.Background()
		errs := map[string]error{}
		if _, err := sim.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"}); err != nil {
			t.Fatal(err)
		}
		_, errs["poll"] = d.Jobs(ctx, forge.JobQueued)
		cred, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu"}})
		if errs["register"] = err; err != nil {
			return errs
		}
		_, errs["list"] = d.Runners(ctx)
		errs["cordon"] = d.Cordon(ctx, cred.RunnerID)
		errs["remove"] = d.RemoveRunner(ctx, cred.RunnerID)
		return errs
	}
	t.Run("least", func(t *testing.T) {
		sim := newSim(t, bbsim.Options{Scopes: least})
		scopes.Check(t, steps(newDriver(t, sim), sim), nil)
		if got := sim.ScopeRefusals(); len(got) != 0 {
			t.Errorf("calls refused for a scope: %v", got)
		}
	})
	for _, missing := range []string{"read:repository:bitbucket", "read:pipeline:bitbucket", "write:runner:bitbucket"} {
		t.Run("without "+missing, func(t *testing.T) {
			have := slices.DeleteFunc(slices.Clone(least), func(s string) bool { return s == missing })
			sim := newSim(t, bbsim.Options{Scopes: have})
			refused := map[string]map[string]string{
				// The repository's uuid comes first, for every call.
				"read:repository:bitbucket": {"poll": missing, "register": missing},
				// write:pipeline implies read:pipeline.
				"read:pipeline:bitbucket": {},
				"write:runner:bitbucket":  {"register": "write:runner:bitbucket"},
			}[missing]
			scopes.Check(t, steps(newDriver(t, sim), sim), refused)
		})
	}
	t.Run("without any pipeline scope", func(t *testing.T) {
		sim := newSim(t, bbsim.Options{Scopes: []string{"read:repository:bitbucket", "write:runner:bitbucket"}})
		scopes.Check(t, steps(newDriver(t, sim), sim), map[string]string{"poll": "read:pipeline:bitbucket"})
	})
}
