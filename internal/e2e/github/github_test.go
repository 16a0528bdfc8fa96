package github

import (
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestGitHubPool runs 10 jobs through a pool of 2 on the simulated GitHub,
// with host processes and with containers: every job gets its own JIT
// registration, no job sees the token, steady-state API calls per job are
// counted, and nothing is left after the drain.
func TestGitHubPool(t *testing.T) {
	for _, mode := range []string{"process", "docker"} {
		t.Run(mode, func(t *testing.T) {
			name := "gh" + mode[:4]
			f := harness.NewGitHubFleet(t, name, harness.GitHubOptions{Size: 2, Docker: mode == "docker"})
			sim := f.GH
			f.Start()
			harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitHub(sim) == 2 })
			_, before := sim.Calls()

			specs := make([]ghsim.JobSpec, 10)
			for i := range specs {
				specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("test (%d)", i+1), Labels: []string{"self-hosted", name}, Script: harness.JobScript}
			}
			start := time.Now()
			sim.Queue("acme/"+name, specs...)
			harness.Eventually(t, 2*time.Minute, "10 jobs done", func() bool { done, _ := harness.Completed(sim); return done == 10 })
			took := time.Since(start)
			// Steady state: the pool refilled, as before the jobs.
			harness.Eventually(t, time.Minute, "the pool refilled", func() bool { return harness.IdleGitHub(sim) == 2 })
			byEndpoint, after := sim.Calls()
			perJob := float64(after-before) / 10
			t.Logf("%s: 10 jobs in %s; forge API calls per job in steady state: %.2f (%d calls: %v)", mode, took.Round(time.Millisecond), perJob, after-before, byEndpoint)

			ids := map[int64]bool{}
			for _, j := range sim.Jobs() {
				if j.Conclusion != "success" {
					t.Errorf("job %s: %s\n%s", j.Name, j.Conclusion, harness.TailString(j.Output, 2000))
				}
				ids[j.RunnerID] = true
				if strings.Contains(j.Output, harness.GHToken) {
					t.Errorf("job %s saw the GitHub token", j.Name)
				}
				if strings.Contains(j.Output, "ACTIONS_RUNNER_INPUT_JITCONFIG") {
					t.Errorf("job %s saw the JIT config variable", j.Name)
				}
			}
			if len(ids) != 10 {
				t.Errorf("10 jobs ran on %d distinct registrations, want 10", len(ids))
			}
			jit := sim.JITNames()
			t.Logf("%s: %d JIT registrations; 10 jobs on %d distinct runner ids", mode, len(jit), len(ids))
			if perJob > 2 {
				t.Errorf("%.2f forge calls per job, want at most 2", perJob)
			}
			f.CheckNoSecretOnDisk()
			f.StopLeavesNothing()
		})
	}
}

// TestGitHubDuplicateNameAndRateLimit: a stale registration under a name
// the pool reuses makes GitHub answer 422; the driver clears it and
// registers again. An exhausted rate limit makes the driver wait for the
// reset instead of calling again and again.
func TestGitHubDuplicateNameAndRateLimit(t *testing.T) {
	name := "ghdup"
	f := harness.NewGitHubFleet(t, name, harness.GitHubOptions{Size: 1, Sim: ghsim.Options{DuplicateStatus: 422}, Forge: "    cache_ttl: 1h\n"})
	sim := f.GH
	f.Start()
	harness.Eventually(t, time.Minute, "an idle runner", func() bool { return harness.IdleGitHub(sim) == 1 })
	// Another tool, or a crash, left a registration under the pool's
	// next name; the manager's list (kept for an hour) does not show it.
	stale := sim.AddRunner("acme/"+name, name+"-1", []string{"x"}, false, false)
	reset := time.Now().Add(3 * time.Second)
	sim.ExhaustRateLimit(reset)
	_, before := sim.Calls()
	sim.Queue("acme/"+name, ghsim.JobSpec{Name: "a", Labels: []string{name}, Script: "true"}, ghsim.JobSpec{Name: "b", Labels: []string{name}, Script: "true"})
	harness.Eventually(t, time.Minute, "2 jobs done", func() bool { done, _ := harness.Completed(sim); return done == 2 })
	harness.Eventually(t, time.Minute, "an idle runner", func() bool { return harness.IdleGitHub(sim) == 1 })
	_, after := sim.Calls()
	if _, ok := harness.Completed(sim); ok != 2 {
		t.Fatalf("%d of 2 jobs succeeded", ok)
	}
	t.Logf("duplicate-name answers: %d; answered 403 rate limited: %d; calls over the %s window and after: %d", sim.Duplicates(), sim.RateLimited(), time.Until(reset)+3*time.Second, after-before)
	if sim.Duplicates() == 0 {
		t.Error("the duplicate name was never refused: the test did not exercise it")
	}
	for _, r := range sim.Runners() {
		if r.ID == stale {
			t.Error("the stale registration is still there")
		}
	}
	if sim.RateLimited() == 0 || sim.RateLimited() > 2 {
		t.Errorf("%d calls answered 403 while the limit was exhausted; want 1 or 2 (one per caller in flight), not a loop", sim.RateLimited())
	}
	if after-before > 12 {
		t.Errorf("%d calls for 2 jobs through a rate limit, want few", after-before)
	}
	f.StopLeavesNothing()
}

// TestGitHubLostRunnerReruns kills a runner mid-job: GitHub fails the job,
// and runfleet re-runs the run's failed jobs once; the re-run succeeds on
// a fresh runner.
func TestGitHubLostRunnerReruns(t *testing.T) {
	name := "ghlost"
	f := harness.NewGitHubFleet(t, name, harness.GitHubOptions{Size: 1, Sim: ghsim.Options{LostAfter: time.Second}})
	sim := f.GH
	f.Start()
	harness.Eventually(t, time.Minute, "an idle runner", func() bool { return harness.IdleGitHub(sim) == 1 })
	// The first attempt hangs until killed; the re-run finds the marker.
	marker := filepath.Join(f.Dir, "attempted")
	sim.Queue("acme/"+name, ghsim.JobSpec{Name: "train", Labels: []string{name}, Script: fmt.Sprintf("if [ -e %[1]s ]; then echo second attempt; exit 0; fi; touch %[1]s; sleep 600", marker)})
	harness.Eventually(t, time.Minute, "the job running", func() bool { return len(f.RunnerPIDs()) > 0 && harness.FileExists(marker) })
	// The runner's process group first (RunnerPIDs is oldest first):
	// killed after its job's shell, the runner would report the job
	// failed before it died, as it did once at a load of 7.
	for _, p := range f.RunnerPIDs() {
		_ = syscall.Kill(-p, syscall.SIGKILL)
	}
	harness.Eventually(t, 2*time.Minute, "the job re-run and done", func() bool {
		for _, j := range sim.Jobs() {
			if j.Attempt == 2 && j.Status == "completed" {
				return true
			}
		}
		return false
	})
	for _, j := range sim.Jobs() {
		t.Logf("job %s attempt %d: %s %s on %s", j.Name, j.Attempt, j.Status, j.Conclusion, j.RunnerName)
		if j.Attempt == 2 && j.Conclusion != "success" {
			t.Errorf("re-run: %s\n%s", j.Conclusion, j.Output)
		}
	}
	if r := sim.Reruns(); len(r) != 1 {
		t.Errorf("re-runs = %v, want exactly one", r)
	}
	f.StopLeavesNothing()
}

// TestGitHubScaleFromZeroWebhooks scales a GitHub pool of size 0 (max 3)
// on the simulator's workflow_job webhooks alone, each delivered twice and
// in no set order: 5 jobs succeed on at most 3 runners, redeliveries are
// counted as duplicates, and after idle_timeout no registration is left.
func TestGitHubScaleFromZeroWebhooks(t *testing.T) {
	top, hooks, base := harness.Listeners(t)
	f := harness.NewGitHubFleet(t, "ghzero", harness.GitHubOptions{
		Size: 0, Max: 3,
		Sim:   ghsim.Options{WebhookURL: hooks + "/webhook/gh", WebhookSecret: harness.HookSecret, Redeliver: true},
		Top:   top,
		Forge: "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 0s\n",
		Pool:  "    idle_timeout: 5s\n",
	})
	sim := f.GH
	f.Start()
	harness.Eventually(t, 30*time.Second, "the server", func() bool { code, _ := harness.Get(t, base+"/healthz"); return code == 200 })
	time.Sleep(2 * time.Second)
	if n := len(sim.Runners()); n != 0 {
		t.Fatalf("%d runners at size 0 with no job", n)
	}
	specs := make([]ghsim.JobSpec, 5)
	for i := range specs {
		specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("train (%d)", i+1), Labels: []string{"self-hosted", "ghzero"}, Script: "sleep 1"}
	}
	most := 0
	sim.Queue("acme/ghzero", specs...)
	harness.Eventually(t, 2*time.Minute, "5 jobs done", func() bool {
		most = max(most, len(sim.Runners()))
		done, _ := harness.Completed(sim)
		return done == 5
	})
	_, ok := harness.Completed(sim)
	dups := harness.Metric(t, base, `runfleet_webhook_deliveries_total{forge="gh",result="duplicate"}`)
	accepted := harness.Metric(t, base, `runfleet_webhook_deliveries_total{forge="gh",result="accepted"}`)
	t.Logf("5 jobs, %d succeeded, at most %d registrations at once; deliveries: %d answered 2xx, %v accepted, %v duplicates", ok, most, sim.Delivered(), accepted, dups)
	if ok != 5 || most > 3 {
		t.Errorf("%d of 5 succeeded, %d registrations at once (max 3)", ok, most)
	}
	if accepted < 10 || dups < 5 {
		t.Errorf("accepted %v, duplicates %v: every job has 3 states, each delivered twice", accepted, dups)
	}
	harness.Eventually(t, 45*time.Second, "no registration after idle_timeout", func() bool { return len(sim.Runners()) == 0 })
	f.StopLeavesNothing()
}

// TestGitHubRerunOnTimeout: with rerun_on_timeout: 1, a job cancelled for
// hitting its timeout (timed_out) is re-run once and resumes from its
// checkpoint; one that times out again is left; a failed job is never
// re-run, nor a timed-out one in a pool without the setting.
func TestGitHubRerunOnTimeout(t *testing.T) {
	top, hooks, _ := harness.Listeners(t)
	name := "ghtimeout"
	f := harness.NewGitHubFleet(t, name, harness.GitHubOptions{
		Size: 2, Max: 4,
		Sim:   ghsim.Options{WebhookURL: hooks + "/webhook/gh", WebhookSecret: harness.HookSecret},
		Top:   top,
		Forge: "    webhook_secret: " + harness.HookSecret + "\n",
		Pool:  "    rerun_on_timeout: 1\n",
	})
	sim := f.GH
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return harness.IdleGitHub(sim) == 2 })
	ckpt := filepath.Join(f.Dir, "checkpoint")
	resumes := sim.Queue("acme/"+name, ghsim.JobSpec{Name: "train", Labels: []string{name}, Timeout: 3 * time.Second,
		Script: fmt.Sprintf("if [ -e %[1]s ]; then echo resumed from the checkpoint; exit 0; fi; touch %[1]s; sleep 600", ckpt)})
	endless := sim.Queue("acme/"+name, ghsim.JobSpec{Name: "endless", Labels: []string{name}, Timeout: 3 * time.Second, Script: "sleep 600"})
	failing := sim.Queue("acme/"+name, ghsim.JobSpec{Name: "broken", Labels: []string{name}, Script: "exit 1"})
	attempts := func(run int64) []ghsim.Job {
		var out []ghsim.Job
		for _, j := range sim.Jobs() {
			if j.RunID == run {
				out = append(out, j)
			}
		}
		return out
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		tr, en := attempts(resumes.ID), attempts(endless.ID)
		if len(tr) == 2 && tr[1].Status == "completed" && tr[0].Status == "completed" && len(en) == 2 && en[1].Status == "completed" {
			break
		}
		if time.Now().After(deadline) {
			for _, j := range sim.Jobs() {
				t.Logf("job %d run %d %s attempt %d: %s %s on %q", j.ID, j.RunID, j.Name, j.Attempt, j.Status, j.Conclusion, j.RunnerName)
			}
			t.Fatal("timed out waiting for train re-run and done, endless timed out twice")
		}
	}
	time.Sleep(5 * time.Second) // a wrong third attempt would show by now
	for _, run := range []int64{resumes.ID, endless.ID, failing.ID} {
		for _, j := range attempts(run) {
			t.Logf("%s attempt %d: %s", j.Name, j.Attempt, j.Conclusion)
		}
	}
	tr, en, br := attempts(resumes.ID), attempts(endless.ID), attempts(failing.ID)
	if tr[0].Conclusion != "timed_out" || tr[1].Conclusion != "success" || !strings.Contains(tr[1].Output, "resumed from the checkpoint") {
		t.Errorf("train: %s then %s (%q)", tr[0].Conclusion, tr[1].Conclusion, tr[1].Output)
	}
	if len(en) != 2 || en[1].Conclusion != "timed_out" {
		t.Errorf("endless: %d attempts, want 2, both timed out", len(en))
	}
	if len(br) != 1 || br[0].Conclusion != "failure" {
		t.Errorf("broken: %d attempts (%s), want 1 failure", len(br), br[0].Conclusion)
	}
	if r := sim.JobReruns(); len(r) != 2 {
		t.Errorf("job re-runs %v, want 2 (train's and endless's first attempts)", r)
	}
	if r := sim.Reruns(); len(r) != 0 {
		t.Errorf("runs re-run as lost: %v, want none", r)
	}
	f.StopLeavesNothing()
}
