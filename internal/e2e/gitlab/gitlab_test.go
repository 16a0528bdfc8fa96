package gitlab

import (
	"cmp"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/glsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestGitLabPool runs a 10-job pipeline through a pool of 2 on the
// simulated GitLab, with host processes and with containers: every job
// on a runner of its own, deleted once its job is done; no job sees the
// access token, nor another runner's token; steady-state API calls per
// job are counted; nothing is left after the drain.
func TestGitLabPool(t *testing.T) {
	for _, mode := range []string{"process", "docker"} {
		t.Run(mode, func(t *testing.T) {
			name := "gl" + mode[:4]
			f := harness.NewGitLabFleet(t, name, harness.GitLabOptions{Size: 2, Docker: mode == "docker", Forge: "    poll_interval: 5s\n"})
			sim := f.GL
			f.Start()
			harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitLab(sim) == 2 })
			before := sim.ManagerCalls()
			start := time.Now()
			if _, err := sim.CreatePipeline("acme/"+name, harness.GLJobs(name, 10, harness.JobScript)...); err != nil {
				t.Fatal(err)
			}
			harness.Eventually(t, 2*time.Minute, "10 jobs done", func() bool { done, _ := harness.GLCompleted(sim); return done == 10 })
			took := time.Since(start)
			harness.Eventually(t, time.Minute, "the pool refilled", func() bool { return harness.IdleGitLab(sim) == 2 && len(sim.Runners()) == 2 })
			after := sim.ManagerCalls()
			byEndpoint, _ := sim.Calls()
			t.Logf("%s: 10 jobs in %s; GitLab API calls per job in steady state: %.2f (%d calls; all calls by endpoint, runners' included: %v)",
				mode, took.Round(time.Millisecond), float64(after-before)/10, after-before, byEndpoint)
			ids := map[int64]bool{}
			for _, j := range sim.Jobs() {
				if j.Status != "success" {
					t.Errorf("job %s: %s\n%s", j.Name, j.Status, harness.TailString(string(j.Trace), 2000))
				}
				ids[j.RunnerID] = true
			}
			if len(ids) != 10 {
				t.Errorf("10 jobs ran on %d distinct runners, want 10", len(ids))
			}
			t.Logf("%s: %d runners created in all; 10 jobs on %d distinct runner ids", mode, len(sim.AllRunners()), len(ids))
			harness.CheckGitLabTokens(t, sim)
			f.CheckNoSecretOnDisk()
			f.CheckNoRunnerTokenOnDisk()
			f.StopLeavesNothing()
		})
	}
}

// TestGitLabCrashWhileJobsRun kills the manager with -9 while 2 jobs run
// and starts it again: both jobs finish, each ran once, and after the
// drain no runner, process or record is left.
func TestGitLabCrashWhileJobsRun(t *testing.T) {
	f := harness.NewGitLabFleet(t, "glcrash", harness.GitLabOptions{Size: 2, Max: 3, Forge: "    poll_interval: 2s\n"})
	sim := f.GL
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitLab(sim) == 2 })
	if _, err := sim.CreatePipeline("acme/glcrash", harness.GLJobs("glcrash", 2, "echo started; sleep 10; echo finished")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, time.Minute, "2 jobs running", func() bool { return harness.GLRunning(sim) == 2 })
	f.Kill9()
	time.Sleep(2 * time.Second)
	f.Start()
	harness.Eventually(t, 2*time.Minute, "both jobs done", func() bool { done, _ := harness.GLCompleted(sim); return done == 2 })
	jobs := sim.Jobs()
	for _, j := range jobs {
		if j.Status != "success" || !strings.Contains(string(j.Trace), "finished") {
			t.Errorf("job %d: %s\n%s", j.ID, j.Status, harness.TailString(string(j.Trace), 1500))
		}
	}
	if len(jobs) != 2 {
		t.Errorf("%d jobs at GitLab, want the 2 of the pipeline (none retried or duplicated)", len(jobs))
	}
	harness.Eventually(t, time.Minute, "the pool back at 2 idle runners", func() bool { return harness.IdleGitLab(sim) == 2 && len(sim.Runners()) == 2 })
	t.Logf("both jobs succeeded across the crash; %d runners created in all, %d registered now", len(sim.AllRunners()), len(sim.Runners()))
	f.StopLeavesNothing()
}

// TestGitLabScaleFromZero scales a pool of size 0 (max 2) on Job Hooks
// alone and on polling alone; a hook with a wrong X-Gitlab-Token is
// answered 401, counted, and starts nothing.
func TestGitLabScaleFromZero(t *testing.T) {
	for _, mode := range []string{"hooks", "polling"} {
		t.Run(mode, func(t *testing.T) {
			name := "glzero" + mode[:4]
			top, hooks, base := harness.Listeners(t)
			opt := harness.GitLabOptions{Size: 0, Max: 2, Top: top, Pool: "    idle_timeout: 5s\n"}
			if mode == "hooks" {
				opt.Sim = glsim.Options{HookURL: hooks + "/webhook/gl", HookSecret: harness.HookSecret}
				opt.Forge = "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 0s\n"
			} else {
				opt.Forge = "    poll_interval: 2s\n"
			}
			f := harness.NewGitLabFleet(t, name, opt)
			sim := f.GL
			f.Start()
			harness.Eventually(t, 30*time.Second, "the server", func() bool { code, _ := harness.Get(t, base+"/healthz"); return code == 200 })
			if mode == "hooks" {
				code := harness.PostHook(t, hooks+"/webhook/gl", map[string]string{"X-Gitlab-Token": "not-the-secret", "X-Gitlab-Event": "Job Hook"},
					`{"object_kind":"build","build_id":1,"build_status":"pending","project_id":1}`)
				if code != 401 {
					t.Errorf("a hook with a wrong X-Gitlab-Token was answered %d, want 401", code)
				}
				time.Sleep(3 * time.Second)
				if n := len(sim.AllRunners()); n != 0 {
					t.Errorf("%d runners made after a hook with a wrong token", n)
				}
				if bad := harness.Metric(t, base, `runfleet_webhook_deliveries_total{forge="gl",result="bad_signature"}`); bad != 1 {
					t.Errorf("bad_signature deliveries counted %v, want 1", bad)
				}
			}
			time.Sleep(2 * time.Second)
			if n := len(sim.AllRunners()); n != 0 {
				t.Fatalf("%d runners at size 0 with no job", n)
			}
			start := time.Now()
			if _, err := sim.CreatePipeline("acme/"+name, harness.GLJobs(name, 3, "sleep 1")...); err != nil {
				t.Fatal(err)
			}
			most := 0
			harness.Eventually(t, 2*time.Minute, "3 jobs done", func() bool {
				most = max(most, len(sim.Runners()))
				done, _ := harness.GLCompleted(sim)
				return done == 3
			})
			_, ok := harness.GLCompleted(sim)
			t.Logf("%s: 3 jobs from zero, %d succeeded in %s, at most %d runners at once; hook answers %v",
				mode, ok, time.Since(start).Round(time.Millisecond), most, sim.Deliveries())
			if ok != 3 || most > 2 {
				t.Errorf("%d of 3 succeeded, %d runners at once (max 2)", ok, most)
			}
			harness.Eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 })
			f.StopLeavesNothing()
		})
	}
}

// TestRunnerGitLabSingle: `runfleet runner --driver gitlab --single`, as
// a GitLab CI job starts it (CI_SERVER_URL, CI_PROJECT_URL, REPO_TOKEN),
// runs one job and leaves no runner registered.
func TestRunnerGitLabSingle(t *testing.T) {
	bin := harness.NeedGitLabRunner(t)
	sim := glsim.New(glsim.Options{Token: harness.GLToken, Projects: []string{"acme/glsingle"}})
	t.Cleanup(sim.Close)
	if _, err := sim.CreatePipeline("acme/glsingle", glsim.JobSpec{Name: "train", Tags: []string{"cml"}, Script: "echo trained on $(hostname)"}); err != nil {
		t.Fatal(err)
	}
	cmd, out := harness.StartRunner(t, []string{"REPO_TOKEN=" + harness.GLToken, "CI_PROJECT_URL=" + sim.URL + "/acme/glsingle", "GITLAB_CI=true"},
		"runner", "--driver", "gitlab", "--single", "--labels", "cml", "--agent", bin)
	took := harness.WaitExit(t, cmd, 2*time.Minute)
	jobs := sim.Jobs()
	if len(jobs) != 1 || jobs[0].Status != "success" {
		t.Fatalf("jobs %+v", jobs)
	}
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("%d runners left registered: %+v", len(r), r)
	}
	if strings.Contains(out.String(), harness.GLToken) {
		t.Error("runfleet runner's output shows the access token")
	}
	t.Logf("one job (%s) on runner %q, exited after %s, no runner left; %d runner created", jobs[0].Status, jobs[0].RunnerDescription, took.Round(time.Millisecond), len(sim.AllRunners()))
}

// TestChaosGitLab is the chaos test for a pool of GitLab runners: a
// manager killed between creating a runner and starting its agent, or
// while runners are paused and deleted after their jobs, leaves nothing
// the next one does not adopt or delete by description.
func TestChaosGitLab(t *testing.T) {
	f := harness.NewGitLabFleet(t, "chaosgl", harness.GitLabOptions{Size: 4, Max: 8,
		Forge: "    poll_interval: 2s\n", Pool: "    idle_timeout: 3s\n    max_lifetime: 4s\n"})
	harness.RunChaos(t, f)
}

// TestGitLabOutage: GitLab answers every call 503 for 20 s while jobs run
// on the pool's runners. Nothing is deleted meanwhile, the manager keeps
// answering, the jobs succeed on the runners they had (whose updates wait
// out the outage), and once GitLab is back the pool returns to size.
func TestGitLabOutage(t *testing.T) {
	top, _, status := harness.Listeners(t)
	f := harness.NewGitLabFleet(t, "glout", harness.GitLabOptions{Size: 2, Max: 4, Top: top, Forge: "    poll_interval: 2s\n"})
	sim := f.GL
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitLab(sim) == 2 })
	if _, err := sim.CreatePipeline("acme/glout", harness.GLJobs("glout", 2, "echo started; sleep 8; echo finished")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, time.Minute, "2 jobs running", func() bool { return harness.GLRunning(sim) == 2 })
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
		if code, _ := harness.Get(t, status+"/healthz"); code != 200 {
			t.Errorf("the manager's /healthz answered %d during the outage", code)
		}
		time.Sleep(2 * time.Second)
	}
	if n := deleted() - before; n != 0 {
		t.Errorf("%d runners deleted while GitLab was down", n)
	}
	sim.SetDown(false)
	back := time.Now()
	harness.Eventually(t, 2*time.Minute, "both jobs done", func() bool { done, _ := harness.GLCompleted(sim); return done == 2 })
	if _, ok := harness.GLCompleted(sim); ok != 2 {
		for _, j := range sim.Jobs() {
			t.Errorf("job %d: %s\n%s", j.ID, j.Status, harness.TailString(string(j.Trace), 1500))
		}
	}
	harness.Eventually(t, time.Minute, "the pool back at 2 idle runners", func() bool { return harness.IdleGitLab(sim) == 2 && len(sim.Runners()) == 2 })
	t.Logf("GitLab down 20 s under 2 running jobs: both succeeded, the pool back at size %s after GitLab's return", time.Since(back).Round(time.Millisecond))
	f.StopLeavesNothing()
}

// TestGitLabCrashGC: a manager killed with -9 and not restarted leaves its
// runners at GitLab and their processes; `runfleet gc` lists them by
// description (a dry run removes nothing), and with --yes deletes the
// runners, then stops the processes.
func TestGitLabCrashGC(t *testing.T) {
	f := harness.NewGitLabFleet(t, "glgc", harness.GitLabOptions{Size: 2, Forge: "    poll_interval: 2s\n"})
	sim := f.GL
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitLab(sim) == 2 })
	f.Kill9()
	listed := f.Runfleet("gc", "-c", f.Config)
	t.Logf("gc after the crash:\n%s", listed)
	for _, r := range sim.Runners() {
		if !regexp.MustCompile(`glgc\s+registration\s+` + r.Description + `\s+` + strconv.FormatInt(r.ID, 10)).MatchString(listed) {
			t.Errorf("gc does not list runner %s (%d)", r.Description, r.ID)
		}
	}
	if n := strings.Count(listed, " machine "); n != 2 {
		t.Errorf("gc listed %d machines, want the 2 runner processes", n)
	}
	if n := len(sim.Runners()); n != 2 || len(f.RunnerPIDs()) != 2 {
		t.Fatalf("the dry run removed something: %d runners, %d processes", n, len(f.RunnerPIDs()))
	}
	removed := f.Runfleet("gc", "-c", f.Config, "--yes")
	t.Logf("gc --yes:\n%s", removed)
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("%d runners left after gc --yes", len(r))
	}
	harness.Eventually(t, 30*time.Second, "no runner process", func() bool { return len(f.RunnerPIDs()) == 0 })
}

// TestGitLabRerunOnTimeout: with rerun_on_timeout: 1, a job its runner
// ended for hitting its timeout (failed, job_execution_timeout, as its
// Job Hook says) is retried once and resumes from its checkpoint; one
// that times out again is left; a job that failed of itself is never
// retried.
func TestGitLabRerunOnTimeout(t *testing.T) {
	top, hooks, _ := harness.Listeners(t)
	name := "gltimeout"
	f := harness.NewGitLabFleet(t, name, harness.GitLabOptions{
		Size: 2, Max: 4, Top: top,
		Sim:   glsim.Options{HookURL: hooks + "/webhook/gl", HookSecret: harness.HookSecret},
		Forge: "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 2s\n",
		Pool:  "    rerun_on_timeout: 1\n",
	})
	sim := f.GL
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return harness.IdleGitLab(sim) == 2 })
	ckpt := filepath.Join(f.Dir, "checkpoint")
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
	harness.Eventually(t, 2*time.Minute, "train retried and done, endless timed out twice", func() bool {
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
	f.StopLeavesNothing()
}

// TestGitLabHostileJob: each job reads everything its runner can read
// (its environment, every process's environment and arguments, the files
// in every process's working directory) and tries every runner token it
// finds on GitLab: for another job, for a fresh token of its own, for a
// check. While they run, more jobs wait that a live token would get. The
// jobs find their runner's token (in its config file) dead, each job runs
// on a runner of its own, and none takes a second. Containers: runners on
// one host as host processes share a Unix user (docs/security.md).
// The manager's token has the least scopes docs/forges/gitlab.md gives
// (create_runner, manage_runner, read_api; api only for retry_lost), and
// GitLab's stand-in checks each call's as GitLab does: none is refused.
func TestGitLabHostileJob(t *testing.T) {
	name := "glhostile"
	f := harness.NewGitLabFleet(t, name, harness.GitLabOptions{Size: 2, Max: 2, Docker: true, Forge: "    poll_interval: 2s\n", Pool: "    retry_lost: false\n",
		Sim: glsim.Options{Scopes: []string{"create_runner", "manage_runner", "read_api"}}})
	sim := f.GL
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitLab(sim) == 2 })
	script := harness.JobScript + "\n" + harness.GLHostileScript(sim.RunnerURL())
	if _, err := sim.CreatePipeline("acme/"+name, harness.GLJobs(name, 6, script)...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 3*time.Minute, "6 jobs done", func() bool { done, _ := harness.GLCompleted(sim); return done == 6 })
	ids := map[int64]int{}
	found := 0
	for _, j := range sim.Jobs() {
		out := string(j.Trace)
		if j.Status != "success" {
			t.Errorf("job %s: %s\n%s", j.Name, j.Status, harness.TailString(out, 2000))
		}
		ids[j.RunnerID]++
		tries := regexp.MustCompile(`hostile: (\S+) with glrt-\S+: (.*)`).FindAllStringSubmatch(out, -1)
		for _, m := range tries {
			if !strings.Contains(m[2], " 403") {
				t.Errorf("job %d: %s with a token it found: %q, want 403", j.ID, m[1], m[2])
			}
		}
		if len(tries) == 0 {
			t.Errorf("job %d found no runner token to try:\n%s", j.ID, harness.TailString(out, 3000))
		}
		found += len(tries)
	}
	for id, n := range ids {
		if n != 1 {
			t.Errorf("runner %d ran %d jobs", id, n)
		}
	}
	if refused := sim.ScopeRefusals(); len(refused) > 0 {
		t.Errorf("calls refused for the token's scopes: %v", refused)
	}
	t.Logf("6 jobs on %d runners; %d tries with the tokens they found, each refused (403); no call refused for the manager's least scopes", len(ids), found)
	harness.CheckGitLabTokens(t, sim)
	f.StopLeavesNothing()
}
