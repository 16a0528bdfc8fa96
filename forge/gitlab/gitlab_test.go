package gitlab_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/gitlab"
	"github.com/runfleet/runfleet/internal/testbed/glsim"
	"github.com/runfleet/runfleet/internal/testbed/scopes"
	"github.com/runfleet/runfleet/internal/testbed/stall"
)

const token = "unit-test-gitlab-token-must-not-leak"

func newDriver(t *testing.T, opt glsim.Options, cfg gitlab.Config) (*gitlab.Forge, *glsim.Server) {
	t.Helper()
	opt.Token = token
	opt.Projects = append(opt.Projects, "acme/models")
	sim := glsim.New(opt)
	t.Cleanup(sim.Close)
	cfg.URL, cfg.Token = sim.URL, cmpOr(cfg.Token, token)
	if cfg.Scope.Kind == "" {
		cfg.Scope = gitlab.Scope{Kind: "project", Ref: "acme/models"}
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = 5 * time.Second
	}
	cfg.SettleTime = 10 * time.Millisecond
	d, err := gitlab.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d, sim
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// A runner is created locked to the project, with the pool's labels as
// its tags, not running untagged jobs, its description the runner's name;
// the credential holds its own token and GitLab's URL, never the access
// token.
func TestRegister(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{RunnerURL: "http://gitlab.internal:8080"})
	cred, err := d.Register(context.Background(), forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu", "cuda-12.4"}})
	if err != nil {
		t.Fatal(err)
	}
	runs := sim.Runners()
	if len(runs) != 1 {
		t.Fatalf("%d runners", len(runs))
	}
	r := runs[0]
	if r.Type != "project_type" || r.ProjectID != sim.ProjectID("acme/models") || r.Description != "gpu-1" ||
		!slices.Equal(r.Tags, []string{"gpu", "cuda-12.4"}) || r.RunUntagged || !r.Locked {
		t.Errorf("runner %+v", r)
	}
	if cred.RunnerID != r.ID || cred.Env[gitlab.EnvToken] != r.Token || cred.Env[gitlab.EnvURL] != "http://gitlab.internal:8080" {
		t.Errorf("credential %+v for runner %d", cred, r.ID)
	}
	for k, v := range cred.Env {
		if strings.Contains(v, token) {
			t.Errorf("credential %s holds the access token", k)
		}
	}
	// The project's path is resolved once, not per runner.
	if _, err := d.Register(context.Background(), forge.RunnerRequest{Name: "gpu-2", Labels: []string{"gpu"}}); err != nil {
		t.Fatal(err)
	}
	calls, _ := sim.Calls()
	if n := calls["GET /api/v4/projects/{id}"]; n != 1 {
		t.Errorf("project looked up %d times for 2 runners, want 1", n)
	}
}

// GitLab's refusals that no retry can fix stop the pool (ErrRejected):
// a runner with no tags that may not run untagged jobs, a bad token, a
// project that does not exist.
func TestRegisterRejected(t *testing.T) {
	cases := []struct {
		name string
		cfg  gitlab.Config
		req  forge.RunnerRequest
		want string
	}{
		{"no tags", gitlab.Config{}, forge.RunnerRequest{Name: "x-1"}, "tags_list"},
		{"bad token", gitlab.Config{Token: "wrong-gitlab-token"}, forge.RunnerRequest{Name: "x-1", Labels: []string{"a"}}, "401"},
		{"no project", gitlab.Config{Scope: gitlab.Scope{Kind: "project", Ref: "acme/none"}}, forge.RunnerRequest{Name: "x-1", Labels: []string{"a"}}, "404"},
		{"short timeout", gitlab.Config{MaximumTimeout: time.Minute}, forge.RunnerRequest{Name: "x-1", Labels: []string{"a"}}, "maximum_timeout"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, sim := newDriver(t, glsim.Options{}, c.cfg)
			_, err := d.Register(context.Background(), c.req)
			if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want ErrRejected naming %s", err, c.want)
			}
			if strings.Contains(err.Error(), token) || strings.Contains(err.Error(), "wrong-gitlab-token") {
				t.Errorf("the error shows a token: %v", err)
			}
			if n := len(sim.AllRunners()); n != 0 {
				t.Errorf("%d runners made", n)
			}
		})
	}
}

// A 5xx on creation is not retried by the client (a second request could
// make a duplicate runner); the pool retries later. A 429 is waited out.
func TestRegisterFailures(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{})
	sim.SetDown(true)
	_, err := d.Register(context.Background(), forge.RunnerRequest{Name: "x-1", Labels: []string{"a"}})
	if err == nil || errors.Is(err, forge.ErrRejected) {
		t.Fatalf("err = %v, want a retryable error", err)
	}
	calls, _ := sim.Calls()
	if n := calls["POST /api/v4/user/runners"]; n > 1 {
		t.Errorf("create sent %d times in an outage, want at most 1", n)
	}
	sim.SetDown(false)
	sim.ExhaustRateLimit(time.Now().Add(2 * time.Second))
	start := time.Now()
	if _, err := d.Register(context.Background(), forge.RunnerRequest{Name: "x-1", Labels: []string{"a"}}); err != nil {
		t.Fatalf("after the rate limit's reset: %v", err)
	}
	if took := time.Since(start); took < time.Second {
		t.Errorf("created after %s, before the rate limit's reset", took)
	}
	if n := sim.RateLimited(); n > 4 {
		t.Errorf("%d calls answered 429 while waiting for the reset, want a few", n)
	}
}

// Runners lists every page (GitLab gives 20 a page unless asked), by
// description, and tells busy ones by the project's running jobs.
func TestRunnersPagesAndBusy(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{})
	ctx := context.Background()
	var creds []forge.Credential
	for i := range 130 {
		c, err := d.Register(ctx, forge.RunnerRequest{Name: fmt.Sprintf("p-%d", i), Labels: []string{"p"}})
		if err != nil {
			t.Fatal(err)
		}
		creds = append(creds, c)
	}
	if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "j", Tags: []string{"p"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	requestJob(t, sim, creds[7].Env[gitlab.EnvToken])
	runs, err := d.Runners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 130 {
		t.Fatalf("listed %d runners, want 130", len(runs))
	}
	for _, r := range runs {
		want := forge.StatusOffline
		switch r.ID {
		case creds[7].RunnerID:
			want = forge.StatusBusy
		}
		if r.Status != want {
			t.Errorf("runner %s: %s, want %s", r.Name, r.Status, want)
		}
	}
}

// requestJob asks for a job as gitlab-runner does and fails the test if
// none is given. It returns the job's id and token.
func requestJob(t *testing.T, sim *glsim.Server, runnerToken string) (int64, string) {
	t.Helper()
	res := postJobRequest(t, sim, runnerToken)
	defer res.Body.Close()
	if res.StatusCode != http.StatusCreated {
		t.Fatalf("job request: %d", res.StatusCode)
	}
	var j struct {
		ID    int64  `json:"id"`
		Token string `json:"token"`
	}
	if err := json.NewDecoder(res.Body).Decode(&j); err != nil {
		t.Fatal(err)
	}
	return j.ID, j.Token
}

// postJobRequest asks for a job as gitlab-runner does.
func postJobRequest(t *testing.T, sim *glsim.Server, runnerToken string) *http.Response {
	t.Helper()
	res, err := http.Post(sim.URL+"/api/v4/jobs/request", "application/json",
		strings.NewReader(`{"token":"`+runnerToken+`","info":{"name":"gitlab-runner"}}`))
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// askForJob asks for a job and returns the answer's status alone.
func askForJob(t *testing.T, sim *glsim.Server, runnerToken string) int {
	t.Helper()
	res := postJobRequest(t, sim, runnerToken)
	res.Body.Close()
	return res.StatusCode
}

// finishJob ends a job as its runner does.
func finishJob(t *testing.T, sim *glsim.Server, id int64, jobToken, state, reason string) {
	t.Helper()
	body := fmt.Sprintf(`{"token":%q,"state":%q,"failure_reason":%q,"exit_code":1}`, jobToken, state, reason)
	req, _ := http.NewRequest("PUT", fmt.Sprintf("%s/api/v4/jobs/%d", sim.URL, id), strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("job update: %d", res.StatusCode)
	}
}

// A lost runner's running job is cancelled and retried once; a job that
// failed with its runner is retried; one that failed of itself is not.
func TestLostRetriesJob(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{})
	ctx := context.Background()
	var creds []forge.Credential
	for i := range 3 {
		c, err := d.Register(ctx, forge.RunnerRequest{Name: fmt.Sprintf("l-%d", i), Labels: []string{"l"}})
		if err != nil {
			t.Fatal(err)
		}
		creds = append(creds, c)
	}
	if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "a", Tags: []string{"l"}, Script: "true"},
		glsim.JobSpec{Name: "b", Tags: []string{"l"}, Script: "true"}, glsim.JobSpec{Name: "c", Tags: []string{"l"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	running, _ := requestJob(t, sim, creds[0].Env[gitlab.EnvToken])
	sysFail, tok1 := requestJob(t, sim, creds[1].Env[gitlab.EnvToken])
	finishJob(t, sim, sysFail, tok1, "failed", "runner_system_failure")
	scriptFail, tok2 := requestJob(t, sim, creds[2].Env[gitlab.EnvToken])
	finishJob(t, sim, scriptFail, tok2, "failed", "script_failure")
	for i, c := range creds {
		d.Lost(ctx, forge.Runner{ID: c.RunnerID, Name: fmt.Sprintf("l-%d", i)})
		d.Lost(ctx, forge.Runner{ID: c.RunnerID, Name: fmt.Sprintf("l-%d", i)}) // reported twice: once is enough
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		retries := map[int64]int{}
		status := map[int64]string{}
		for _, j := range sim.Jobs() {
			status[j.ID] = j.Status
			if j.RetryOf != 0 {
				retries[j.RetryOf]++
			}
		}
		if retries[running] == 1 && retries[sysFail] == 1 {
			if status[running] != "canceled" || retries[scriptFail] != 0 {
				t.Errorf("running job %s, script failure retried %d times", status[running], retries[scriptFail])
			}
			time.Sleep(200 * time.Millisecond)
			if n := len(sim.Jobs()); n != 5 {
				t.Errorf("%d jobs, want the 3 and 2 retries", n)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("retries %v, statuses %v", retries, status)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// RemoveRunner deletes an idle runner, refuses a busy one (ErrBusy) and
// leaves it, paused so that it takes no other job, and says ErrNotFound
// for one that is gone.
func TestRemoveRunner(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{})
	ctx := context.Background()
	idle, _ := d.Register(ctx, forge.RunnerRequest{Name: "r-1", Labels: []string{"r"}})
	busy, _ := d.Register(ctx, forge.RunnerRequest{Name: "r-2", Labels: []string{"r"}})
	if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "j", Tags: []string{"r"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	requestJob(t, sim, busy.Env[gitlab.EnvToken])
	if err := d.RemoveRunner(ctx, idle.RunnerID); err != nil {
		t.Fatalf("idle: %v", err)
	}
	if err := d.RemoveRunner(ctx, busy.RunnerID); !errors.Is(err, forge.ErrBusy) {
		t.Fatalf("busy: %v, want ErrBusy", err)
	}
	left := sim.Runners()
	if len(left) != 1 || left[0].ID != busy.RunnerID || !left[0].Paused {
		t.Errorf("left %+v, want the busy runner, paused", left)
	}
	if err := d.RemoveRunner(ctx, idle.RunnerID); !errors.Is(err, forge.ErrNotFound) {
		t.Errorf("gone: %v, want ErrNotFound", err)
	}
}

// Jobs reads the project's pending jobs with their tags and pipeline.
func TestJobs(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{})
	pipeline, err := sim.CreatePipeline("acme/models",
		glsim.JobSpec{Name: "train", Tags: []string{"gpu", "cuda-12.4"}, Script: "true"},
		glsim.JobSpec{Name: "lint", Script: "true"})
	if err != nil {
		t.Fatal(err)
	}
	jobs, err := d.Jobs(context.Background(), forge.JobQueued)
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 2 {
		t.Fatalf("%d jobs", len(jobs))
	}
	for _, j := range jobs {
		if j.Status != forge.JobQueued || j.RunID != pipeline || j.CreatedAt.IsZero() {
			t.Errorf("job %+v", j)
		}
		if j.Name == "train" && !slices.Equal(j.Labels, []string{"gpu", "cuda-12.4"}) {
			t.Errorf("train's labels %v", j.Labels)
		}
		// No pool has this label: an untagged job starts no runner
		// that may not take it.
		if j.Name == "lint" && !slices.Equal(j.Labels, []string{gitlab.NoTags}) {
			t.Errorf("lint's labels %v, want %q", j.Labels, gitlab.NoTags)
		}
	}
	group, _ := newDriver(t, glsim.Options{}, gitlab.Config{Scope: gitlab.Scope{Kind: "group", Ref: "acme"}})
	if _, err := group.Jobs(context.Background(), forge.JobQueued); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("group jobs: %v, want ErrUnsupported", err)
	}
}

// A hung GitLab fails each call after the call timeout.
func TestHangingGitLabTimesOut(t *testing.T) {
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer hang.Close()
	d, err := gitlab.New(gitlab.Config{URL: hang.URL, Token: token, Scope: gitlab.Scope{Kind: "project", Ref: "1"}, CallTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = d.Runners(context.Background())
	if err == nil || time.Since(start) > 3*time.Second {
		t.Errorf("listing a hung GitLab: %v after %s", err, time.Since(start))
	}
}

// The agent gets its URL and token in its config file, never in its
// environment (which the shell executor hands to the job) or arguments,
// with the hooks that hold the job until the token is dead, and stops
// after one job or its idle timeout.
func TestAgentSpec(t *testing.T) {
	d, _ := newDriver(t, glsim.Options{}, gitlab.Config{})
	ag, err := d.Agent(agent.Config{Path: "/bin/gitlab-runner", IdleTimeout: 90 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	cred := forge.Credential{RunnerID: 5, Env: map[string]string{gitlab.EnvURL: "http://gl", gitlab.EnvToken: "glrt-t1_secret"}}
	spec, err := ag.Spec(agent.Runner{Name: "p-1", Env: map[string]string{"DATA": "/data", "CI_SERVER_TOKEN": "stale"}}, cred)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"run-single", "--config", gitlab.ConfigFile, "--runner", "p-1", "--max-builds", "1", "--wait-timeout", "90"}; !slices.Equal(spec.Args, want) {
		t.Errorf("args %v, want %v", spec.Args, want)
	}
	if _, ok := spec.Env["CI_SERVER_TOKEN"]; ok || spec.Env["DATA"] != "/data" {
		t.Errorf("env %v, want DATA and no token", spec.Env)
	}
	var file struct {
		Runners []map[string]string `toml:"runners"`
	}
	if _, err := toml.Decode(string(spec.Files[gitlab.ConfigFile]), &file); err != nil || len(file.Runners) != 1 {
		t.Fatalf("config file %q: %v", spec.Files[gitlab.ConfigFile], err)
	}
	r := file.Runners[0]
	if r["name"] != "p-1" || r["url"] != "http://gl" || r["token"] != "glrt-t1_secret" || r["executor"] != "shell" {
		t.Errorf("config's runner %v", r)
	}
	for _, hook := range []string{"pre_get_sources_script", "pre_build_script"} {
		if !strings.Contains(r[hook], "verify --config") || !strings.Contains(r[hook], "is not valid") {
			t.Errorf("%s %q: no wait for the token's death", hook, r[hook])
		}
	}
	for _, a := range spec.Args {
		if strings.Contains(a, "glrt-") {
			t.Errorf("the token is an argument: %v", spec.Args)
		}
	}
	// The docker executor, where a pool's env asks for it.
	spec, _ = ag.Spec(agent.Runner{Name: "p-2", Env: map[string]string{"RUNNER_EXECUTOR": "docker"}}, cred)
	if !strings.Contains(string(spec.Files[gitlab.ConfigFile]), `executor = "docker"`) || spec.Env["RUNNER_EXECUTOR"] != "" {
		t.Errorf("config %s env %v, want executor docker", spec.Files[gitlab.ConfigFile], spec.Env)
	}
	out := []byte("Starting runner for http://gl with token secret ...\nChecking for jobs... received                       job=12 repo_url=http://gl/acme/models.git runner=secret\n")
	if ph := ag.(interface{ Phase([]byte) agent.Phase }).Phase(out); ph != agent.PhaseBusy {
		t.Errorf("phase %v after a job was received, want busy", ph)
	}
	out = append(out, "Job succeeded\nThis runner has processed its build limit, so now exiting\n"...)
	if ph := ag.(interface{ Phase([]byte) agent.Phase }).Phase(out); ph != agent.PhaseDone {
		t.Errorf("phase %v after the build limit, want done", ph)
	}
}

// A runner made while a listing is under way is missing from that
// listing: it is not kept, so the next pass reads GitLab again and sees
// the runner, instead of missing it for a whole cache_ttl (long enough for
// the pool to take its machine for an orphan and give its name to a
// second runner).
func TestRunnersCacheSkipsListingThatOverlapsAChange(t *testing.T) {
	sim := glsim.New(glsim.Options{Token: token, Projects: []string{"acme/models"}})
	t.Cleanup(sim.Close)
	front, listing, release := stall.HoldAnswer(t, sim.URL, func(r *http.Request) bool {
		return r.Method == "GET" && strings.HasSuffix(r.URL.Path, "/runners")
	})
	d, err := gitlab.New(gitlab.Config{URL: front, Token: token, CacheTTL: time.Minute, CallTimeout: 5 * time.Second,
		SettleTime: 10 * time.Millisecond, Scope: gitlab.Scope{Kind: "project", Ref: "acme/models"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "c-1", Labels: []string{"c"}}); err != nil {
		t.Fatal(err)
	}
	first := make(chan []forge.Runner, 1)
	go func() {
		runs, _ := d.Runners(ctx)
		first <- runs
	}()
	<-listing
	c2, err := d.Register(ctx, forge.RunnerRequest{Name: "c-2", Labels: []string{"c"}})
	if err != nil {
		t.Fatal(err)
	}
	close(release)
	if runs := <-first; len(runs) != 1 {
		t.Fatalf("the held listing has %d runners, want c-1 alone (it was read before c-2 was made)", len(runs))
	}
	runs, err := d.Runners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(runs, func(r forge.Runner) bool { return r.ID == c2.RunnerID }) {
		t.Errorf("the next listing lacks the runner made during the last one: %+v", runs)
	}
}

// A listing is reused within the cache's time, with the runners the
// driver made and removed meanwhile: one list call for a register, a
// removal and three listings.
func TestRunnersCache(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{CacheTTL: time.Minute})
	ctx := context.Background()
	a, _ := d.Register(ctx, forge.RunnerRequest{Name: "c-1", Labels: []string{"c"}})
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	b, _ := d.Register(ctx, forge.RunnerRequest{Name: "c-2", Labels: []string{"c"}})
	if err := d.RemoveRunner(ctx, a.RunnerID); err != nil {
		t.Fatal(err)
	}
	runs, _ := d.Runners(ctx)
	if len(runs) != 1 || runs[0].ID != b.RunnerID || runs[0].Name != "c-2" {
		t.Errorf("listed %+v, want c-2 alone", runs)
	}
	calls, _ := sim.Calls()
	if n := calls["GET /api/v4/projects/{id}/runners"]; n != 1 {
		t.Errorf("%d list calls, want 1", n)
	}
}

// A job that hit its time limit is reported timed_out with its attempt
// (retries_count + 1) by its Job Hook; RerunJob retries it, and the
// retry's hook says attempt 2. A group's driver retries the job in the
// project its hook named, and refuses one no hook reported.
func TestRerunJobAfterTimeout(t *testing.T) {
	hooks := make(chan *http.Request, 100)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		req := httptest.NewRequest("POST", "/webhook/gl", bytes.NewReader(body))
		req.Header = r.Header.Clone()
		hooks <- req
	}))
	t.Cleanup(srv.Close)
	d, sim := newDriver(t, glsim.Options{HookURL: srv.URL, HookSecret: "s3cret"}, gitlab.Config{})
	group, err := gitlab.New(gitlab.Config{URL: sim.URL, Token: token, Scope: gitlab.Scope{Kind: "group", Ref: "acme"}, CallTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "t-1", Labels: []string{"t"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "train", Tags: []string{"t"}, Script: "sleep 600"}); err != nil {
		t.Fatal(err)
	}
	id, tok := requestJob(t, sim, cred.Env[gitlab.EnvToken])
	finishJob(t, sim, id, tok, "failed", "job_execution_timeout")
	// hookFor waits for the hook that reports a job in a status; GitLab
	// sends hooks asynchronously, so an older job's hook (the original's
	// "queued") may come after a newer one and is skipped by its ID.
	hookFor := func(drv *gitlab.Forge, want forge.JobStatus, skip ...int64) forge.Job {
		t.Helper()
		for {
			select {
			case r := <-hooks:
				dl, err := drv.ParseWebhook(r, []byte("s3cret"))
				if err != nil {
					t.Fatal(err)
				}
				if dl.Job != nil && dl.Job.Status == want && !slices.Contains(skip, dl.Job.ID) {
					return *dl.Job
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("no hook of a %s job", want)
			}
		}
	}
	ended := hookFor(d, forge.JobCompleted)
	if ended.ID != id || ended.Conclusion != forge.ConclusionTimedOut || ended.Attempt != 1 {
		t.Fatalf("the hook reported job %d %s attempt %d, want job %d timed_out attempt 1", ended.ID, ended.Conclusion, ended.Attempt, id)
	}
	// Where its code came from: the project's path from the hook's
	// repository page, its commit, ref and who started the pipeline.
	if src := ended.Source; src.Repository != "acme/models" || len(src.Commit) != 40 || src.Ref != "main" || src.Actor != "root" {
		t.Errorf("the hook's source: %+v", src)
	}
	if err := d.RerunJob(ctx, ended); err != nil {
		t.Fatal(err)
	}
	retry := hookFor(d, forge.JobQueued, id)
	if retry.ID == id || retry.Attempt != 2 || retry.Name != "train" {
		t.Errorf("the retry's hook: job %d %q attempt %d, want a new job train, attempt 2", retry.ID, retry.Name, retry.Attempt)
	}

	// The group's driver: the project comes from the hook.
	id2, tok2 := requestJob(t, sim, cred.Env[gitlab.EnvToken])
	finishJob(t, sim, id2, tok2, "failed", "job_execution_timeout")
	if err := group.RerunJob(ctx, forge.Job{ID: id2, Attempt: 2}); err == nil || !strings.Contains(err.Error(), "project is unknown") {
		t.Errorf("a group's driver re-ran a job no hook reported: %v", err)
	}
	ended = hookFor(group, forge.JobCompleted)
	if ended.ID != id2 || ended.Attempt != 2 {
		t.Fatalf("the hook reported job %d attempt %d, want job %d attempt 2", ended.ID, ended.Attempt, id2)
	}
	if err := group.RerunJob(ctx, ended); err != nil {
		t.Fatal(err)
	}
	if r := hookFor(group, forge.JobQueued, id, retry.ID, id2); r.Attempt != 3 {
		t.Errorf("the second retry's attempt is %d, want 3", r.Attempt)
	}
	retries := 0
	for _, j := range sim.Jobs() {
		if j.RetryOf != 0 {
			retries++
		}
	}
	if retries != 2 {
		t.Errorf("%d retries at GitLab, want 2", retries)
	}
}

// A create whose answer never came (the drain cancelled it) may have made
// the runner: the kept listing is dropped, so the next pass sees the
// runner and removes it, and a drain does not end with it left at GitLab.
func TestRunnersCacheDroppedAfterAnUnansweredCreate(t *testing.T) {
	sim := glsim.New(glsim.Options{Token: token, Projects: []string{"acme/models"}})
	t.Cleanup(sim.Close)
	front, created, release := stall.HoldAnswer(t, sim.URL, func(r *http.Request) bool {
		return r.Method == "POST" && strings.HasSuffix(r.URL.Path, "/user/runners")
	})
	defer close(release)
	d, err := gitlab.New(gitlab.Config{URL: front, Token: token, CacheTTL: time.Minute, CallTimeout: 5 * time.Second,
		SettleTime: 10 * time.Millisecond, Scope: gitlab.Scope{Kind: "project", Ref: "acme/models"}})
	if err != nil {
		t.Fatal(err)
	}
	if runs, err := d.Runners(context.Background()); err != nil || len(runs) != 0 {
		t.Fatalf("first listing: %v, %v", runs, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-created; cancel() }()
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "c-1", Labels: []string{"c"}}); err == nil {
		t.Fatal("a create cancelled before its answer succeeded")
	}
	runs, err := d.Runners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(runs, func(r forge.Runner) bool { return r.Name == "c-1" }) {
		t.Errorf("the listing after the unanswered create lacks the runner GitLab made: %+v", runs)
	}
}

// GitLab's four words for a runner's connection
// (https://docs.gitlab.com/api/runners/#list-owned-runners): one online is
// idle; one offline or stale is not, though one offline did reach GitLab
// (not within the last hours), which tells the pool that its agent ran.
func TestRunnerConnection(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if strings.HasSuffix(r.URL.Path, "/runners") {
			_, _ = io.WriteString(w, `[{"id":1,"description":"on","status":"online"},{"id":2,"description":"off","status":"offline"},`+
				`{"id":3,"description":"never","status":"never_contacted"},{"id":4,"description":"stale","status":"stale"}]`)
			return
		}
		_, _ = io.WriteString(w, `[]`)
	}))
	defer srv.Close()
	d, err := gitlab.New(gitlab.Config{URL: srv.URL, Token: token, Scope: gitlab.Scope{Kind: "project", Ref: "1"}, CacheTTL: -1})
	if err != nil {
		t.Fatal(err)
	}
	rs, err := d.Runners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]forge.Runner{
		"on": {Status: forge.StatusIdle, Connected: true}, "off": {Status: forge.StatusOffline, Connected: true},
		"never": {Status: forge.StatusOffline}, "stale": {Status: forge.StatusOffline},
	}
	for _, r := range rs {
		if w := want[r.Name]; r.Status != w.Status || r.Connected != w.Connected {
			t.Errorf("runner %q: status %s, connected %v; want %s, %v", r.Name, r.Status, r.Connected, w.Status, w.Connected)
		}
	}
	if len(rs) != len(want) {
		t.Errorf("%d runners listed, want %d", len(rs), len(want))
	}
}

// Runners are created ref_protected unless the forge says not_protected:
// GitLab then gives them only jobs of protected branches, so a job of an
// unprotected branch (a merge request's, anyone's push) never runs where a
// protected job could follow it. Demand agrees: such a job is labelled
// NotProtected and starts no runner that could not take it. Without
// access_level GitLab makes a runner not_protected, and it takes any job.
func TestAccessLevel(t *testing.T) {
	ctx := context.Background()
	opt := glsim.Options{ProtectedBranches: []string{"main", "release/*"}}
	d, sim := newDriver(t, opt, gitlab.Config{})
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "t-1", Labels: []string{"t"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := sim.Runners(); len(r) != 1 || r[0].AccessLevel != "ref_protected" {
		t.Fatalf("runners %+v, want one ref_protected", r)
	}
	for _, ref := range []string{"feature/x", "release/1.2", "main"} {
		if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: ref, Tags: []string{"t"}, Script: "true", Ref: ref}); err != nil {
			t.Fatal(err)
		}
	}
	jobs, err := d.Jobs(ctx, forge.JobQueued)
	if err != nil || len(jobs) != 3 {
		t.Fatalf("queued %v (%v)", jobs, err)
	}
	for _, j := range jobs {
		unprotected := j.Name == "feature/x"
		if got := slices.Equal(j.Labels, []string{gitlab.NotProtected}); got != unprotected {
			t.Errorf("job %s labelled %v", j.Name, j.Labels)
		}
	}
	// The runner's token gets the protected jobs, never the other.
	taken := map[string]bool{}
	for range 2 {
		id, _ := requestJob(t, sim, cred.Env[gitlab.EnvToken])
		for _, j := range sim.Jobs() {
			if j.ID == id {
				taken[j.Ref] = true
			}
		}
	}
	if !taken["main"] || !taken["release/1.2"] {
		t.Errorf("a ref_protected runner took %v, want main and release/1.2", taken)
	}
	if code := askForJob(t, sim, cred.Env[gitlab.EnvToken]); code != http.StatusNoContent {
		t.Errorf("a ref_protected runner asking for the unprotected job: %d, want 204", code)
	}

	// not_protected: the unprotected job is demand, and taken.
	open, sim2 := newDriver(t, opt, gitlab.Config{AccessLevel: gitlab.AccessNotProtected})
	if _, err := sim2.CreatePipeline("acme/models", glsim.JobSpec{Name: "mr", Tags: []string{"t"}, Script: "true", Ref: "feature/y"}); err != nil {
		t.Fatal(err)
	}
	jobs, err = open.Jobs(ctx, forge.JobQueued)
	if err != nil || len(jobs) != 1 || !slices.Equal(jobs[0].Labels, []string{"t"}) {
		t.Fatalf("queued %+v (%v), want the job with its tags", jobs, err)
	}
	cred, err = open.Register(ctx, forge.RunnerRequest{Name: "t-2", Labels: []string{"t"}})
	if err != nil {
		t.Fatal(err)
	}
	requestJob(t, sim2, cred.Env[gitlab.EnvToken])
	if r := sim2.Runners(); r[0].AccessLevel != "not_protected" {
		t.Errorf("runner %+v, want not_protected", r[0])
	}
}

// GitLab hands an active runner's token a job whenever it asks, also
// while its first job runs: a job that reads its runner's token could take
// more, or swap it for a fresh one. The pool cordons a runner the moment
// it takes its job: its token is reset (dead: refused for jobs, for
// verify and for a reset of its own) and the runner paused, and the
// listing says it is cordoned.
func TestCordonPausesTheRunner(t *testing.T) {
	ctx := context.Background()
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{CacheTTL: -1})
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "t-1", Labels: []string{"t"}})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "j", Tags: []string{"t"}, Script: "sleep 60"}); err != nil {
			t.Fatal(err)
		}
	}
	requestJob(t, sim, cred.Env[gitlab.EnvToken])
	if err := d.Cordon(ctx, cred.RunnerID); err != nil {
		t.Fatal(err)
	}
	tok := cred.Env[gitlab.EnvToken]
	if code := askForJob(t, sim, tok); code != http.StatusForbidden {
		t.Errorf("the old token asking for a second job: %d, want 403", code)
	}
	for _, path := range []string{"/api/v4/runners/verify", "/api/v4/runners/reset_authentication_token"} {
		resp, err := http.Post(sim.URL+path, "application/json", strings.NewReader(`{"token":"`+tok+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("POST %s with the old token: %d, want 403", path, resp.StatusCode)
		}
	}
	if r := sim.Runners(); len(r) != 1 || !r[0].Paused || len(r[0].Tokens) != 2 {
		t.Errorf("runner %+v, want it paused with its token reset once", r)
	}
	list, err := d.Runners(ctx)
	if err != nil || len(list) != 1 || !list[0].Cordoned || list[0].Status != forge.StatusBusy {
		t.Errorf("runners %+v (%v), want the one cordoned and busy", list, err)
	}
	if err := d.Cordon(ctx, 999999); !errors.Is(err, forge.ErrNotFound) {
		t.Errorf("cordon of a runner that is gone: %v, want ErrNotFound", err)
	}
}

// The scopes docs/forges/gitlab.md lists are enough for a pool, and each
// is needed: with create_runner, manage_runner and read_api the driver
// creates, lists, polls, cordons and removes runners; without any one of
// them, the calls that need it are refused with a clear error naming it
// (forge.ErrRejected: no retry fixes it). Retrying a lost job needs api.
func TestLeastScopes(t *testing.T) {
	least := []string{"create_runner", "manage_runner", "read_api"}
	// steps runs a pool's calls in their order, and returns each one's
	// error by name.
	steps := func(d *gitlab.Forge, sim *glsim.Server) (errs map[string]error) {
		ctx := context.Background()
		errs = map[string]error{}
		if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "train", Tags: []string{"gpu"}, Script: "true"}); err != nil {
			t.Fatal(err)
		}
		_, errs["poll"] = d.Jobs(ctx, forge.JobQueued)
		cred, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"gpu"}})
		if errs["register"] = err; err != nil {
			return errs
		}
		_, errs["list"] = d.Runners(ctx)
		errs["cordon"] = d.Cordon(ctx, cred.RunnerID)
		errs["remove"] = d.RemoveRunner(ctx, cred.RunnerID)
		errs["retry"] = d.RerunJob(ctx, forge.Job{ID: sim.Jobs()[0].ID})
		return errs
	}
	t.Run("least", func(t *testing.T) {
		d, sim := newDriver(t, glsim.Options{Scopes: least}, gitlab.Config{CacheTTL: -1})
		errs := steps(d, sim)
		scopes.Check(t, errs, map[string]string{"retry": "api"})
		if got := sim.ScopeRefusals(); len(got) != 1 || !strings.Contains(got[0], "/retry") {
			t.Errorf("calls refused for a scope: %v, want the retry's only", got)
		}
	})
	for _, missing := range least {
		t.Run("without "+missing, func(t *testing.T) {
			have := slices.DeleteFunc(slices.Clone(least), func(s string) bool { return s == missing })
			d, sim := newDriver(t, glsim.Options{Scopes: have}, gitlab.Config{CacheTTL: -1})
			refused := map[string]map[string]string{
				"create_runner": {"register": "create_runner"},
				"read_api":      {"poll": "read_api", "register": "read_api"}, // register finds the project first
				"manage_runner": {"cordon": "manage_runner", "remove": "manage_runner", "retry": "api"},
			}[missing]
			scopes.Check(t, steps(d, sim), refused)
		})
	}
}
