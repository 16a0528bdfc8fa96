package bitbucket

import (
	"encoding/base64"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/bbsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// managerCalls counts the calls the manager made (the runners' own are
// left out).
func managerCalls(sim *bbsim.Server) (n int, by map[string]int) {
	by = map[string]int{}
	for _, c := range sim.Calls() {
		if !c.Runner {
			n++
			by[c.Method+" "+c.Route]++
		}
	}
	return n, by
}

// TestBitbucketPool runs 10 steps through a pool of 2 runners, as host
// processes and as containers: each step on a fresh runner (its own OAuth
// client, deleted once its step is done), no runner given a second step,
// names within <manager>.<pool>-1 … -2, no secret where it does not
// belong; steady-state calls per step are counted; after SIGTERM no
// runner, process or container is left.
func TestBitbucketPool(t *testing.T) {
	for _, mode := range []string{"process", "docker"} {
		t.Run(mode, func(t *testing.T) {
			name := "bb" + mode[:4]
			f := harness.NewBitbucketFleet(t, name, harness.BitbucketOptions{Size: 2, Docker: mode == "docker", Forge: "    poll_interval: 5s\n"})
			sim := f.BB
			f.Start()
			harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleBitbucket(sim) == 2 })
			before, _ := managerCalls(sim)
			start := time.Now()
			if _, err := sim.RunPipeline(name, harness.BBSteps(10, harness.JobScript, name)...); err != nil {
				t.Fatal(err)
			}
			harness.Eventually(t, 2*time.Minute, "10 steps done", func() bool { done, _ := harness.BBCompleted(sim); return done == 10 })
			took := time.Since(start)
			harness.Eventually(t, time.Minute, "the pool refilled", func() bool { return harness.IdleBitbucket(sim) == 2 && len(sim.Runners()) == 2 })
			after, by := managerCalls(sim)
			t.Logf("%s: 10 steps in %s; Bitbucket calls per step in steady state: %.2f (%d calls; all the manager's calls by route: %v)",
				mode, took.Round(time.Millisecond), float64(after-before)/10, after-before, by)
			runners := map[string]bool{}
			for _, s := range sim.Steps() {
				if s.Result != "SUCCESSFUL" {
					t.Errorf("step %s: %s on %s\n%s", s.Name, s.Result, s.Runner, harness.TailString(string(s.Log), 2000))
				}
				runners[s.Runner] = true
			}
			if len(runners) != 10 {
				t.Errorf("10 steps ran on %d distinct runners, want 10", len(runners))
			}
			most := 0
			for _, r := range sim.AllRunners() {
				most = max(most, r.Steps)
			}
			t.Logf("at most %d step per runner (the simulator counts each runner's steps)", most)
			for _, u := range sim.Unexpected() {
				t.Errorf("the manager sent %s", u)
			}
			harness.RunnerNamesWithin(t, sim, "e2e-"+name, name, 2)
			harness.CheckBitbucketSecrets(t, f)
			f.StopLeavesNothing()
		})
	}
}

// TestBitbucketCrashAdopts kills the manager with -9 while 2 steps run and
// starts it again: both steps finish once, and after the drain no runner,
// process or record is left.
func TestBitbucketCrashAdopts(t *testing.T) {
	f := harness.NewBitbucketFleet(t, "bbcrash", harness.BitbucketOptions{Size: 2, Max: 3, Forge: "    poll_interval: 2s\n"})
	sim := f.BB
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleBitbucket(sim) == 2 })
	if _, err := sim.RunPipeline("bbcrash", harness.BBSteps(2, "echo started; sleep 10; echo finished", "bbcrash")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, time.Minute, "2 steps running", func() bool { return harness.BBRunning(sim) == 2 })
	f.Kill9()
	time.Sleep(2 * time.Second)
	f.Start()
	harness.Eventually(t, 2*time.Minute, "both steps done", func() bool { done, _ := harness.BBCompleted(sim); return done == 2 })
	steps := sim.Steps()
	for _, s := range steps {
		if s.Result != "SUCCESSFUL" || !strings.Contains(string(s.Log), "finished") {
			t.Errorf("step %s: %s\n%s", s.Name, s.Result, harness.TailString(string(s.Log), 1500))
		}
	}
	harness.Eventually(t, time.Minute, "the pool back at 2 idle runners", func() bool { return harness.IdleBitbucket(sim) == 2 && len(sim.Runners()) == 2 })
	t.Logf("both steps succeeded across the crash; %d runners created in all, %d now", len(sim.AllRunners()), len(sim.Runners()))
	f.StopLeavesNothing()
}

// TestBitbucketScaleFromZero scales a pool of size 0 (max 2) on the steps
// its repository's pipelines wait with: three steps run, and the pool
// shrinks back to zero. A step for other labels starts nothing, and the
// manager says so.
func TestBitbucketScaleFromZero(t *testing.T) {
	f := harness.NewBitbucketFleet(t, "bbzero", harness.BitbucketOptions{Size: 0, Max: 2,
		Labels: []string{"bbzero", "gpu"}, Forge: "    poll_interval: 2s\n", Pool: "    idle_timeout: 5s\n"})
	sim := f.BB
	f.Start()
	if _, err := sim.RunPipeline("bbzero", bbsim.StepSpec{Name: "needs an h100", RunsOn: []string{"self.hosted", "h100"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 30*time.Second, "the unmet step reported", func() bool { return f.LogHas("no pool meets") })
	if n := len(sim.AllRunners()); n != 0 {
		t.Fatalf("%d runners for a step no pool meets", n)
	}
	start := time.Now()
	if _, err := sim.RunPipeline("bbzero", harness.BBSteps(3, "sleep 1", "gpu")...); err != nil {
		t.Fatal(err)
	}
	most := 0
	harness.Eventually(t, 2*time.Minute, "3 steps done", func() bool {
		most = max(most, len(sim.Runners()))
		done, _ := harness.BBCompleted(sim)
		return done == 3
	})
	_, ok := harness.BBCompleted(sim)
	t.Logf("3 steps from zero: %d succeeded in %s, at most %d runners at once", ok, time.Since(start).Round(time.Millisecond), most)
	if ok != 3 || most > 2 {
		t.Errorf("%d of 3 succeeded, %d runners at once (max 2)", ok, most)
	}
	harness.Eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 })
	f.StopLeavesNothing()
}

// TestBitbucketDefaultCheck runs a pool at the real runner's pace (a
// check every 30 s, 2 s to set a step up) on a queue of quick steps that
// Bitbucket hands out on its side: each runner is disabled while it sets
// its step up, before the step ends, so none is given a second one, and
// every step succeeds on a runner of its own.
func TestBitbucketDefaultCheck(t *testing.T) {
	f := harness.NewBitbucketFleet(t, "bbpace", harness.BitbucketOptions{Size: 1,
		Sim: bbsim.Options{RunnerCheck: 30 * time.Second, StepSetup: 2 * time.Second}, Forge: "    poll_interval: 5s\n"})
	sim := f.BB
	f.Start()
	harness.Eventually(t, time.Minute, "an idle runner online", func() bool { return harness.IdleBitbucket(sim) == 1 })
	if _, err := sim.RunPipeline("bbpace", harness.BBSteps(3, "true", "bbpace")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 3*time.Minute, "3 steps done", func() bool { done, _ := harness.BBCompleted(sim); return done == 3 })
	byUUID := map[string]bbsim.Runner{}
	for _, r := range sim.AllRunners() {
		byUUID[r.UUID] = r
	}
	for _, s := range sim.Steps() {
		r := byUUID[s.Runner]
		if s.Result != "SUCCESSFUL" {
			t.Errorf("step %s: %s on %s\n%s", s.Name, s.Result, r.Name, harness.TailString(string(s.Log), 2000))
			continue
		}
		if r.Disabled.IsZero() || !r.Disabled.Before(s.Completed) || r.Steps != 1 {
			t.Errorf("step %s: runner %s disabled at %s, its step ended at %s; %d steps given to it, want 1",
				s.Name, r.Name, r.Disabled.Format(time.StampMilli), s.Completed.Format(time.StampMilli), r.Steps)
			continue
		}
		t.Logf("step %s: taken %s after it was assigned, runner disabled %s after that, %s before the step ended",
			s.Name, s.Started.Sub(s.Assigned).Round(time.Millisecond), r.Disabled.Sub(s.Started).Round(time.Millisecond),
			s.Completed.Sub(r.Disabled).Round(time.Millisecond))
	}
	f.StopLeavesNothing()
}

// TestBitbucketHostileJob runs steps that read their runner's OAuth
// client from the processes' environments (in a container, as Atlassian's
// runner runs: its own runner's only) and use it: a step asks for a step
// for its runner five times over five seconds and gets only its own (the
// pool disabled the runner as it took it), and the runner's token is
// refused on the manager's calls (create a runner, read pipelines). No
// runner is given or runs a second step. The manager's token has the
// least permissions docs/forges/bitbucket.md gives, which the stand-in
// checks on each call: none is refused.
func TestBitbucketHostileJob(t *testing.T) {
	const name = "bbhostile"
	f := harness.NewBitbucketFleet(t, name, harness.BitbucketOptions{Size: 2, Max: 3, Docker: true, Forge: "    poll_interval: 2s\n",
		Sim: bbsim.Options{Scopes: []string{"read:repository:bitbucket", "read:pipeline:bitbucket", "write:pipeline:bitbucket", "write:runner:bitbucket"}}})
	sim := f.BB
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleBitbucket(sim) == 2 })
	if _, err := sim.RunPipeline(name, harness.BBSteps(4, harness.BBHostileScript(name), name)...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 3*time.Minute, "4 steps done", func() bool { done, _ := harness.BBCompleted(sim); return done == 4 })
	requests := 0
	for i, s := range sim.Steps() {
		log := string(s.Log)
		if i == 0 {
			var lines []string
			for _, l := range strings.Split(log, "\n") {
				if strings.HasPrefix(l, "hostile:") {
					lines = append(lines, l)
				}
			}
			t.Logf("step %s (%s) printed:\n%s", s.Name, s.UUID, strings.Join(lines, "\n"))
		}
		if s.Result != "SUCCESSFUL" || !strings.Contains(log, "token granted") {
			t.Fatalf("step %s: %s; the hostile step must find its runner's OAuth client and get a token\n%s", s.Name, s.Result, harness.TailString(log, 3000))
		}
		for _, line := range strings.Split(log, "\n") {
			switch {
			case strings.Contains(line, "hostile: step request"):
				requests++
				if !strings.Contains(line, " 204 ") && !strings.HasSuffix(line, "step="+s.UUID) {
					t.Errorf("step %s: %s (its own step is %s)", s.Name, line, s.UUID)
				}
			case strings.Contains(line, "hostile: create runner"), strings.Contains(line, "hostile: read pipelines"):
				if !strings.HasSuffix(line, " 401") {
					t.Errorf("step %s: %s, want 401", s.Name, line)
				}
			}
		}
	}
	for _, r := range sim.AllRunners() {
		if r.Steps > 1 || r.Ran > 1 {
			t.Errorf("runner %s was given %d steps and fetched %d", r.Name, r.Steps, r.Ran)
		}
	}
	if refused := sim.ScopeRefusals(); len(refused) > 0 {
		t.Errorf("the manager's calls refused for its token's scopes: %v", refused)
	}
	t.Logf("4 steps on 4 runners; %d step requests with the runners' own OAuth clients, each answered with the asking step or none; runner tokens refused on the manager's calls; no manager call refused for its least scopes", requests)
	f.StopLeavesNothing()
}

// TestChaosBitbucket is the chaos test for a pool of Bitbucket runners: a
// manager killed between creating a runner and starting it, or while
// runners are disabled and deleted after their steps, leaves nothing the
// next one does not adopt or delete.
func TestChaosBitbucket(t *testing.T) {
	f := harness.NewBitbucketFleet(t, "chaosbb", harness.BitbucketOptions{Size: 4, Max: 8,
		Forge: "    poll_interval: 2s\n", Pool: "    idle_timeout: 3s\n    max_lifetime: 10s\n"})
	harness.RunChaos(t, f)
}

// TestRunnerBitbucketSingle: `runfleet runner --driver bitbucket --single`,
// with CML's REPO_TOKEN (base64 of email:API token) and the repository
// URL, runs one step and leaves no runner registered.
func TestRunnerBitbucketSingle(t *testing.T) {
	bin := harness.NeedBitbucketRunner(t)
	sim := bbsim.New(bbsim.Options{Token: harness.BBToken, User: "ci-bot", Password: harness.BBToken, Repos: []string{"models"}})
	t.Cleanup(sim.Close)
	if _, err := sim.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "cml"}, Script: "echo trained on $(hostname)"}); err != nil {
		t.Fatal(err)
	}
	repoToken := base64.StdEncoding.EncodeToString([]byte("ci-bot:" + harness.BBToken))
	cmd, out := harness.StartRunner(t, []string{"REPO_TOKEN=" + repoToken},
		"runner", "--driver", "bitbucket", "--repo", sim.URL+"/acme/models", "--single", "--labels", "cml", "--agent", bin, "--log", "debug")
	took := harness.WaitExit(t, cmd, 2*time.Minute)
	steps := sim.Steps()
	if len(steps) != 1 || steps[0].Result != "SUCCESSFUL" {
		t.Fatalf("steps %+v\n%s", steps, out)
	}
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("%d runners left: %+v", len(r), r)
	}
	for _, r := range sim.AllRunners() {
		if strings.Contains(out.String(), r.Secret) {
			t.Error("runfleet runner's output shows the runner's OAuth secret")
		}
	}
	if strings.Contains(out.String(), harness.BBToken) || strings.Contains(out.String(), repoToken) {
		t.Error("runfleet runner's output shows the token")
	}
	t.Logf("one step (%s) on runner %s, exited after %s, %d runner created, none left", steps[0].Result, steps[0].Runner, took.Round(time.Millisecond), len(sim.AllRunners()))
}

// TestBitbucketLostStepReruns kills a runner mid-step: Bitbucket fails the
// step (at once, as runfleet deletes the dead runner, or once its
// heartbeat stops), and runfleet runs its pipeline again once; the new
// step succeeds on a fresh runner.
func TestBitbucketLostStepReruns(t *testing.T) {
	name := "bblost"
	f := harness.NewBitbucketFleet(t, name, harness.BitbucketOptions{Size: 1, Sim: bbsim.Options{Heartbeat: 10 * time.Second}, Forge: "    poll_interval: 2s\n"})
	sim := f.BB
	f.Start()
	harness.Eventually(t, time.Minute, "an idle runner", func() bool { return harness.IdleBitbucket(sim) == 1 })
	// The first run hangs until killed; the re-run finds the marker.
	marker := filepath.Join(f.Dir, "attempted")
	script := fmt.Sprintf("if [ -e %[1]s ]; then echo second run; exit 0; fi; touch %[1]s; sleep 600", marker)
	if _, err := sim.RunPipeline(name, bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", name}, Script: script}); err != nil {
		t.Fatal(err)
	}
	// Killed once the manager has seen it run the step (it disables the
	// runner then), as a machine taken back mid-step is.
	harness.Eventually(t, time.Minute, "the step running on a disabled runner", func() bool {
		r := sim.Runners()
		return harness.BBRunning(sim) == 1 && harness.FileExists(marker) && len(r) == 1 && !r[0].Enabled
	})
	killed := time.Now()
	f.Killed = 1
	for _, p := range f.RunnerPIDs() {
		_ = syscall.Kill(-p, syscall.SIGKILL)
	}
	// The re-run starts at once; the lost step fails once its runner's
	// heartbeat lapses (10 s), maybe after the re-run passed.
	harness.Eventually(t, 2*time.Minute, "the pipeline run again, its step done, the lost one failed", func() bool {
		steps := sim.Steps()
		return len(steps) == 2 && steps[0].State == "COMPLETED" && steps[1].State == "COMPLETED"
	})
	steps := sim.Steps()
	for _, s := range steps {
		t.Logf("step %s of pipeline %d: %s %s on %s", s.Name, s.Build, s.State, s.Result, s.Runner)
	}
	if steps[0].Result == "SUCCESSFUL" || steps[1].Result != "SUCCESSFUL" || !strings.Contains(string(steps[1].Log), "second run") {
		t.Errorf("the lost step %s, its re-run %s:\n%s", steps[0].Result, steps[1].Result, steps[1].Log)
	}
	if !steps[0].Completed.After(killed) || !steps[1].Started.After(killed) {
		t.Errorf("the first step ended at %s and the re-run started at %s, not after the kill at %s: the step was not lost by the kill", steps[0].Completed, steps[1].Started, killed)
	}
	t.Logf("a step lost with its runner ran again in pipeline %d, done %s after the kill", steps[1].Build, steps[1].Completed.Sub(killed).Round(time.Millisecond))
	f.StopLeavesNothing()
}
