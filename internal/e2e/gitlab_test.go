package e2e

import (
	"bytes"
	"cmp"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/glsim"
)

// glToken is the simulated GitLab's access token: the secret that must
// reach no runner.
const glToken = "e2e-simulated-gitlab-token-must-not-leak"

var glStandIn = &standIn{pkg: "github.com/runfleet/runfleet/internal/glsim/runner", file: "gitlab-runner", name: "gitlab-runner"}

// needGitLabRunner builds the stand-in for gitlab-runner.
func needGitLabRunner(t testing.TB) string { return glStandIn.bin(t) }

// needGitLabImage builds an image with the stand-in at /bin/gitlab-runner.
func needGitLabImage(t testing.TB) string { return glStandIn.image(t) }

type glOptions struct {
	Size, Max int
	Docker    bool
	Sim       glsim.Options
	Forge     string // appended to the forge
	Pool      string // appended to the pool
	Top       string // added at the top of the config
}

// newGitLabFleet makes a manager config for a pool on a simulated GitLab
// project acme/<name>.
func newGitLabFleet(t testing.TB, name string, opt glOptions) *fleet {
	t.Helper()
	bin := needGitLabRunner(t)
	image := ""
	if opt.Docker {
		image = needGitLabImage(t)
		opt.Sim.RunnerHost = "host.docker.internal"
	}
	opt.Sim.Token = glToken
	opt.Sim.Projects = append(opt.Sim.Projects, "acme/"+name)
	sim := glsim.New(opt.Sim)
	t.Cleanup(sim.Close)
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	dir := t.TempDir()
	f := &fleet{t: t, repo: name, dir: dir, state: filepath.Join(dir, "state"), work: filepath.Join(dir, "work"), gl: sim, docker: opt.Docker,
		env: []string{"E2E_GITLAB_TOKEN=" + glToken}}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: 2m
forges:
  - name: gl
    type: gitlab
    url: %[3]s
    runner_url: %[4]s
    token: ${E2E_GITLAB_TOKEN}
    project: acme/%[1]s
%[7]spools:
  - name: %[1]s
    labels: [%[1]s, linux]
    size: %[5]d
    max: %[6]d
    workdir: %[8]s
    bootstrap_timeout: 1m
`, name, f.state, sim.URL, sim.RunnerURL(), opt.Size, opt.Max, opt.Forge, f.work)
	if opt.Docker {
		cfg += "    agent:\n      path: /bin/gitlab-runner\n    docker:\n      image: " + image + "\n      pull: never\n"
	} else {
		cfg += "    agent:\n      path: " + bin + "\n"
	}
	cfg += opt.Pool
	f.config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.cleanup)
	return f
}

// idleGitLab counts runners that asked GitLab for a job and run none.
func idleGitLab(sim *glsim.Server) int {
	busy := map[int64]bool{}
	for _, j := range sim.Jobs() {
		if j.Status == "running" {
			busy[j.RunnerID] = true
		}
	}
	n := 0
	for _, r := range sim.Runners() {
		if !r.ContactedAt.IsZero() && !r.Paused && !busy[r.ID] {
			n++
		}
	}
	return n
}

// glRunning counts the jobs running.
func glRunning(sim *glsim.Server) int {
	n := 0
	for _, j := range sim.Jobs() {
		if j.Status == "running" {
			n++
		}
	}
	return n
}

func glCompleted(sim *glsim.Server) (done, ok int) {
	for _, j := range sim.Jobs() {
		if j.Finished() {
			done++
			if j.Status == "success" {
				ok++
			}
		}
	}
	return done, ok
}

func glJobs(name string, n int, script string) []glsim.JobSpec {
	specs := make([]glsim.JobSpec, n)
	for i := range specs {
		specs[i] = glsim.JobSpec{Name: fmt.Sprintf("test %d/%d", i+1, n), Tags: []string{name}, Script: script}
	}
	return specs
}

var serverTokenRE = regexp.MustCompile(`CI_SERVER_TOKEN=(glrt-\S+)`)

// checkGitLabTokens reads every job's log (which prints its environment
// and every process's command line): the access token never shows, and
// the only runner token a job sees is its own runner's.
func checkGitLabTokens(t testing.TB, sim *glsim.Server) {
	t.Helper()
	tokens := map[int64]string{}
	for _, r := range sim.AllRunners() {
		tokens[r.ID] = r.Token
	}
	for _, j := range sim.Jobs() {
		out := string(j.Trace)
		if strings.Contains(out, glToken) {
			t.Errorf("job %d saw the access token", j.ID)
		}
		for id, tok := range tokens {
			if id != j.RunnerID && strings.Contains(out, tok) {
				t.Errorf("job %d (runner %d) saw runner %d's token", j.ID, j.RunnerID, id)
			}
		}
		if m := serverTokenRE.FindAllStringSubmatch(out, -1); len(m) != 1 || m[0][1] != tokens[j.RunnerID] {
			t.Errorf("job %d: its environment's CI_SERVER_TOKEN is not its own runner's token, once (%d found)", j.ID, len(m))
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, "gitlab-runner") && strings.Contains(line, "glrt-") {
				t.Errorf("job %d: a runner token in a process's arguments: %q", j.ID, line)
			}
		}
	}
	t.Logf("%d job logs (each job's environment and every process's arguments): the access token in none, each job's CI_SERVER_TOKEN its own runner's, no runner token in any argument", len(sim.Jobs()))
}

// checkNoRunnerTokenOnDisk looks for every runner's token in what the
// manager and the agents wrote (logs, records, working directories).
func (f *fleet) checkNoRunnerTokenOnDisk() {
	f.t.Helper()
	runs := f.gl.AllRunners()
	files := 0
	_ = filepath.Walk(f.dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return nil
		}
		files++
		b, _ := os.ReadFile(path)
		for _, r := range runs {
			if bytes.Contains(b, []byte(r.Token)) {
				f.t.Errorf("runner %s's token is in %s", r.Description, path)
			}
		}
		return nil
	})
	f.t.Logf("%d files the manager and the agents wrote: no runner token, no access token", files)
}

// TestGitLabPool runs a 10-job pipeline through a pool of 2 on the
// simulated GitLab, with host processes and with containers: every job
// on a runner of its own, deleted once its job is done; no job sees the
// access token, nor another runner's token; steady-state API calls per
// job are counted; nothing is left after the drain.
func TestGitLabPool(t *testing.T) {
	for _, mode := range []string{"process", "docker"} {
		t.Run(mode, func(t *testing.T) {
			name := "gl" + mode[:4]
			f := newGitLabFleet(t, name, glOptions{Size: 2, Docker: mode == "docker", Forge: "    poll_interval: 5s\n"})
			sim := f.gl
			f.start()
			eventually(t, time.Minute, "2 idle runners online", func() bool { return idleGitLab(sim) == 2 })
			before := sim.ManagerCalls()
			start := time.Now()
			if _, err := sim.CreatePipeline("acme/"+name, glJobs(name, 10, jobScript)...); err != nil {
				t.Fatal(err)
			}
			eventually(t, 2*time.Minute, "10 jobs done", func() bool { done, _ := glCompleted(sim); return done == 10 })
			took := time.Since(start)
			eventually(t, time.Minute, "the pool refilled", func() bool { return idleGitLab(sim) == 2 && len(sim.Runners()) == 2 })
			after := sim.ManagerCalls()
			byEndpoint, _ := sim.Calls()
			t.Logf("%s: 10 jobs in %s; GitLab API calls per job in steady state: %.2f (%d calls; all calls by endpoint, runners' included: %v)",
				mode, took.Round(time.Millisecond), float64(after-before)/10, after-before, byEndpoint)
			ids := map[int64]bool{}
			for _, j := range sim.Jobs() {
				if j.Status != "success" {
					t.Errorf("job %s: %s\n%s", j.Name, j.Status, tailString(string(j.Trace), 2000))
				}
				ids[j.RunnerID] = true
			}
			if len(ids) != 10 {
				t.Errorf("10 jobs ran on %d distinct runners, want 10", len(ids))
			}
			t.Logf("%s: %d runners created in all; 10 jobs on %d distinct runner ids", mode, len(sim.AllRunners()), len(ids))
			checkGitLabTokens(t, sim)
			f.checkNoSecretOnDisk()
			f.checkNoRunnerTokenOnDisk()
			f.stopLeavesNothing()
		})
	}
}

// TestGitLabCrashWhileJobsRun kills the manager with -9 while 2 jobs run
// and starts it again: both jobs finish, each ran once, and after the
// drain no runner, process or record is left.
func TestGitLabCrashWhileJobsRun(t *testing.T) {
	f := newGitLabFleet(t, "glcrash", glOptions{Size: 2, Max: 3, Forge: "    poll_interval: 2s\n"})
	sim := f.gl
	f.start()
	eventually(t, time.Minute, "2 idle runners online", func() bool { return idleGitLab(sim) == 2 })
	if _, err := sim.CreatePipeline("acme/glcrash", glJobs("glcrash", 2, "echo started; sleep 10; echo finished")...); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "2 jobs running", func() bool { return glRunning(sim) == 2 })
	f.kill9()
	time.Sleep(2 * time.Second)
	f.start()
	eventually(t, 2*time.Minute, "both jobs done", func() bool { done, _ := glCompleted(sim); return done == 2 })
	jobs := sim.Jobs()
	for _, j := range jobs {
		if j.Status != "success" || !strings.Contains(string(j.Trace), "finished") {
			t.Errorf("job %d: %s\n%s", j.ID, j.Status, tailString(string(j.Trace), 1500))
		}
	}
	if len(jobs) != 2 {
		t.Errorf("%d jobs at GitLab, want the 2 of the pipeline (none retried or duplicated)", len(jobs))
	}
	eventually(t, time.Minute, "the pool back at 2 idle runners", func() bool { return idleGitLab(sim) == 2 && len(sim.Runners()) == 2 })
	t.Logf("both jobs succeeded across the crash; %d runners created in all, %d registered now", len(sim.AllRunners()), len(sim.Runners()))
	f.stopLeavesNothing()
}

// TestGitLabScaleFromZero scales a pool of size 0 (max 2) on Job Hooks
// alone and on polling alone; a hook with a wrong X-Gitlab-Token is
// answered 401, counted, and starts nothing.
func TestGitLabScaleFromZero(t *testing.T) {
	for _, mode := range []string{"hooks", "polling"} {
		t.Run(mode, func(t *testing.T) {
			name := "glzero" + mode[:4]
			top, hooks, base := listeners(t)
			opt := glOptions{Size: 0, Max: 2, Top: top, Pool: "    idle_timeout: 5s\n"}
			if mode == "hooks" {
				opt.Sim = glsim.Options{HookURL: hooks + "/webhook/gl", HookSecret: hookSecret}
				opt.Forge = "    webhook_secret: " + hookSecret + "\n    poll_interval: 0s\n"
			} else {
				opt.Forge = "    poll_interval: 2s\n"
			}
			f := newGitLabFleet(t, name, opt)
			sim := f.gl
			f.start()
			eventually(t, 30*time.Second, "the server", func() bool { code, _ := get(t, base+"/healthz"); return code == 200 })
			if mode == "hooks" {
				code := postHook(t, hooks+"/webhook/gl", map[string]string{"X-Gitlab-Token": "not-the-secret", "X-Gitlab-Event": "Job Hook"},
					`{"object_kind":"build","build_id":1,"build_status":"pending","project_id":1}`)
				if code != 401 {
					t.Errorf("a hook with a wrong X-Gitlab-Token was answered %d, want 401", code)
				}
				time.Sleep(3 * time.Second)
				if n := len(sim.AllRunners()); n != 0 {
					t.Errorf("%d runners made after a hook with a wrong token", n)
				}
				if bad := metric(t, base, `runfleet_webhook_deliveries_total{forge="gl",result="bad_signature"}`); bad != 1 {
					t.Errorf("bad_signature deliveries counted %v, want 1", bad)
				}
			}
			time.Sleep(2 * time.Second)
			if n := len(sim.AllRunners()); n != 0 {
				t.Fatalf("%d runners at size 0 with no job", n)
			}
			start := time.Now()
			if _, err := sim.CreatePipeline("acme/"+name, glJobs(name, 3, "sleep 1")...); err != nil {
				t.Fatal(err)
			}
			most := 0
			eventually(t, 2*time.Minute, "3 jobs done", func() bool {
				most = max(most, len(sim.Runners()))
				done, _ := glCompleted(sim)
				return done == 3
			})
			_, ok := glCompleted(sim)
			t.Logf("%s: 3 jobs from zero, %d succeeded in %s, at most %d runners at once; hook answers %v",
				mode, ok, time.Since(start).Round(time.Millisecond), most, sim.Deliveries())
			if ok != 3 || most > 2 {
				t.Errorf("%d of 3 succeeded, %d runners at once (max 2)", ok, most)
			}
			eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 })
			f.stopLeavesNothing()
		})
	}
}

// TestRunnerGitLabSingle: `runfleet runner --driver gitlab --single`, as
// a GitLab CI job starts it (CI_SERVER_URL, CI_PROJECT_URL, REPO_TOKEN),
// runs one job and leaves no runner registered.
func TestRunnerGitLabSingle(t *testing.T) {
	bin := needGitLabRunner(t)
	sim := glsim.New(glsim.Options{Token: glToken, Projects: []string{"acme/glsingle"}})
	t.Cleanup(sim.Close)
	if _, err := sim.CreatePipeline("acme/glsingle", glsim.JobSpec{Name: "train", Tags: []string{"cml"}, Script: "echo trained on $(hostname)"}); err != nil {
		t.Fatal(err)
	}
	cmd, out := startRunner(t, []string{"REPO_TOKEN=" + glToken, "CI_PROJECT_URL=" + sim.URL + "/acme/glsingle", "GITLAB_CI=true"},
		"runner", "--driver", "gitlab", "--single", "--labels", "cml", "--agent", bin)
	took := waitExit(t, cmd, 2*time.Minute)
	jobs := sim.Jobs()
	if len(jobs) != 1 || jobs[0].Status != "success" {
		t.Fatalf("jobs %+v", jobs)
	}
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("%d runners left registered: %+v", len(r), r)
	}
	if strings.Contains(out.String(), glToken) {
		t.Error("runfleet runner's output shows the access token")
	}
	t.Logf("one job (%s) on runner %q, exited after %s, no runner left; %d runner created", jobs[0].Status, jobs[0].RunnerDescription, took.Round(time.Millisecond), len(sim.AllRunners()))
}

// postHook posts a hook delivery with headers and returns the status.
func postHook(t *testing.T, url string, headers map[string]string, body string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	return res.StatusCode
}

// gitLabChaos is chaosForge for a fleet on the GitLab simulator.
func (f *fleet) gitLabChaos() chaosForge {
	sim := f.gl
	return chaosForge{
		push: func(n, b, sleep int) {
			specs := glJobs(f.repo, n, fmt.Sprintf("echo burst %d job $CI_JOB_NAME\nsleep %d", b, sleep))
			if _, err := sim.CreatePipeline("acme/"+f.repo, specs...); err != nil {
				f.t.Fatal(err)
			}
		},
		wait: func(n int, timeout time.Duration) []endedJob {
			var open []string
			for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(time.Second) {
				jobs, ended := sim.Jobs(), []endedJob{}
				open = nil
				for _, j := range jobs {
					if !j.Finished() {
						open = append(open, fmt.Sprintf("%d %s (%s on %q)", j.ID, j.Name, j.Status, j.RunnerDescription))
						continue
					}
					c := map[string]string{"success": "success", "failed": "failure", "canceled": "cancelled"}[j.Status]
					ended = append(ended, endedJob{ID: j.ID, Run: j.PipelineID, RunnerID: j.RunnerID, Name: j.Name, Runner: j.RunnerDescription, Conclusion: c})
				}
				if len(open) == 0 && len(ended) >= n {
					return ended
				}
			}
			f.t.Fatalf("after %s, jobs not completed: %v", timeout, open)
			return nil
		},
		ready: func() int { return idleGitLab(sim) },
		names: func() ([]string, error) {
			var names []string
			for _, r := range sim.Runners() {
				names = append(names, r.Description)
			}
			return names, nil
		},
	}
}

// TestChaosGitLab is the chaos test for a pool of GitLab runners: a
// manager killed between creating a runner and starting its agent, or
// while runners are paused and deleted after their jobs, leaves nothing
// the next one does not adopt or delete by description.
func TestChaosGitLab(t *testing.T) {
	f := newGitLabFleet(t, "chaosgl", glOptions{Size: 4, Max: 8,
		Forge: "    poll_interval: 2s\n", Pool: "    idle_timeout: 3s\n    max_lifetime: 4s\n"})
	runChaos(t, f)
}

// TestGitLabOutage: GitLab answers every call 503 for 20 s while jobs run
// on the pool's runners. Nothing is deleted meanwhile, the manager keeps
// answering, the jobs succeed on the runners they had (whose updates wait
// out the outage), and once GitLab is back the pool returns to size.
func TestGitLabOutage(t *testing.T) {
	top, _, status := listeners(t)
	f := newGitLabFleet(t, "glout", glOptions{Size: 2, Max: 4, Top: top, Forge: "    poll_interval: 2s\n"})
	sim := f.gl
	f.start()
	eventually(t, time.Minute, "2 idle runners online", func() bool { return idleGitLab(sim) == 2 })
	if _, err := sim.CreatePipeline("acme/glout", glJobs("glout", 2, "echo started; sleep 8; echo finished")...); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "2 jobs running", func() bool { return glRunning(sim) == 2 })
	deleted := func() int {
		n := 0
		for _, r := range sim.AllRunners() {
			if r.Deleted {
				n++
			}
		}
		return n
	}
	before := deleted()
	sim.SetDown(true)
	down := time.Now()
	for time.Since(down) < 20*time.Second {
		if code, _ := get(t, status+"/healthz"); code != 200 {
			t.Errorf("the manager's /healthz answered %d during the outage", code)
		}
		time.Sleep(2 * time.Second)
	}
	if n := deleted() - before; n != 0 {
		t.Errorf("%d runners deleted while GitLab was down", n)
	}
	sim.SetDown(false)
	back := time.Now()
	eventually(t, 2*time.Minute, "both jobs done", func() bool { done, _ := glCompleted(sim); return done == 2 })
	if _, ok := glCompleted(sim); ok != 2 {
		for _, j := range sim.Jobs() {
			t.Errorf("job %d: %s\n%s", j.ID, j.Status, tailString(string(j.Trace), 1500))
		}
	}
	eventually(t, time.Minute, "the pool back at 2 idle runners", func() bool { return idleGitLab(sim) == 2 && len(sim.Runners()) == 2 })
	t.Logf("GitLab down 20 s under 2 running jobs: both succeeded, the pool back at size %s after GitLab's return", time.Since(back).Round(time.Millisecond))
	f.stopLeavesNothing()
}

// TestGitLabCrashGC: a manager killed with -9 and not restarted leaves its
// runners at GitLab and their processes; `runfleet gc` lists them by
// description (a dry run removes nothing), and with --yes deletes the
// runners, then stops the processes.
func TestGitLabCrashGC(t *testing.T) {
	f := newGitLabFleet(t, "glgc", glOptions{Size: 2, Forge: "    poll_interval: 2s\n"})
	sim := f.gl
	f.start()
	eventually(t, time.Minute, "2 idle runners online", func() bool { return idleGitLab(sim) == 2 })
	f.kill9()
	listed := f.runfleet("gc", "-c", f.config)
	t.Logf("gc after the crash:\n%s", listed)
	for _, r := range sim.Runners() {
		if !regexp.MustCompile(`glgc\s+registration\s+` + r.Description + `\s+` + strconv.FormatInt(r.ID, 10)).MatchString(listed) {
			t.Errorf("gc does not list runner %s (%d)", r.Description, r.ID)
		}
	}
	if n := strings.Count(listed, " machine "); n != 2 {
		t.Errorf("gc listed %d machines, want the 2 runner processes", n)
	}
	if n := len(sim.Runners()); n != 2 || len(f.runnerPIDs()) != 2 {
		t.Fatalf("the dry run removed something: %d runners, %d processes", n, len(f.runnerPIDs()))
	}
	removed := f.runfleet("gc", "-c", f.config, "--yes")
	t.Logf("gc --yes:\n%s", removed)
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("%d runners left after gc --yes", len(r))
	}
	eventually(t, 30*time.Second, "no runner process", func() bool { return len(f.runnerPIDs()) == 0 })
}

// TestGitLabRerunOnTimeout: with rerun_on_timeout: 1, a job its runner
// ended for hitting its timeout (failed, job_execution_timeout, as its
// Job Hook says) is retried once and resumes from its checkpoint; one
// that times out again is left; a job that failed of itself is never
// retried.
func TestGitLabRerunOnTimeout(t *testing.T) {
	top, hooks, _ := listeners(t)
	name := "gltimeout"
	f := newGitLabFleet(t, name, glOptions{
		Size: 2, Max: 4, Top: top,
		Sim:   glsim.Options{HookURL: hooks + "/webhook/gl", HookSecret: hookSecret},
		Forge: "    webhook_secret: " + hookSecret + "\n    poll_interval: 2s\n",
		Pool:  "    rerun_on_timeout: 1\n",
	})
	sim := f.gl
	f.start()
	eventually(t, time.Minute, "2 idle runners", func() bool { return idleGitLab(sim) == 2 })
	ckpt := filepath.Join(f.dir, "checkpoint")
	for _, spec := range []glsim.JobSpec{
		{Name: "train", Tags: []string{name}, Timeout: 3 * time.Second,
			Script: fmt.Sprintf("if [ -e %[1]s ]; then echo resumed from the checkpoint; exit 0; fi; touch %[1]s; sleep 600", ckpt)},
		{Name: "endless", Tags: []string{name}, Timeout: 3 * time.Second, Script: "sleep 600"},
		{Name: "broken", Tags: []string{name}, Script: "exit 1"},
	} {
		if _, err := sim.CreatePipeline("acme/"+name, spec); err != nil {
			t.Fatal(err)
		}
	}
	attempts := func(job string) []glsim.Job {
		var out []glsim.Job
		for _, j := range sim.Jobs() {
			if j.Name == job {
				out = append(out, j)
			}
		}
		slices.SortFunc(out, func(a, b glsim.Job) int { return cmp.Compare(a.ID, b.ID) })
		return out
	}
	eventually(t, 2*time.Minute, "train retried and done, endless timed out twice", func() bool {
		tr, en := attempts("train"), attempts("endless")
		return len(tr) == 2 && tr[1].Finished() && len(en) == 2 && en[1].Finished()
	})
	time.Sleep(5 * time.Second) // a wrong third attempt would show by now
	for _, job := range []string{"train", "endless", "broken"} {
		for i, j := range attempts(job) {
			t.Logf("%s attempt %d (job %d, retry of %d): %s %s", job, i+1, j.ID, j.RetryOf, j.Status, j.FailureReason)
		}
	}
	tr, en, br := attempts("train"), attempts("endless"), attempts("broken")
	if tr[0].FailureReason != "job_execution_timeout" || tr[1].Status != "success" || !strings.Contains(string(tr[1].Trace), "resumed from the checkpoint") {
		t.Errorf("train: %s (%s) then %s", tr[0].Status, tr[0].FailureReason, tr[1].Status)
	}
	if len(en) != 2 || en[1].FailureReason != "job_execution_timeout" || en[1].RetryOf != en[0].ID {
		t.Errorf("endless: %d attempts, want 2, both timed out", len(en))
	}
	if len(br) != 1 || br[0].Status != "failed" {
		t.Errorf("broken: %d attempts, want 1 failure", len(br))
	}
	f.stopLeavesNothing()
}
