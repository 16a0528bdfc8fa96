package github

import (
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestGitHubScaleSet runs a 20-job burst through a scale set on the
// simulator: every job on its own JIT runner, no runner and, after the
// manager stops, no session left.
func TestGitHubScaleSet(t *testing.T) {
	f := harness.ScaleSetFleet(t, "ghss")
	sim := f.GH
	f.Start()
	harness.WaitSession(t, sim)
	rest0, service0 := harness.ServiceCalls(sim)
	start := time.Now()
	sim.Queue("acme/ghss", harness.Burst("ghss", 20, "env; sleep 1")...)
	most := 0
	harness.Eventually(t, 2*time.Minute, "20 jobs done", func() bool {
		most = max(most, len(sim.Runners()))
		done, _ := harness.Completed(sim)
		return done == 20
	})
	took := time.Since(start)
	rest, service := harness.ServiceCalls(sim)
	_, ok := harness.Completed(sim)
	ids := map[int64]bool{}
	for _, j := range sim.Jobs() {
		ids[j.RunnerID] = true
	}
	t.Logf("20 jobs in %s, %d succeeded, on %d distinct runners, at most %d registrations at once; per job: %.2f REST calls, %.2f Actions service calls",
		took.Round(time.Millisecond), ok, len(ids), most, float64(rest-rest0)/20, float64(service-service0)/20)
	if ok != 20 || len(ids) != 20 || most > 20 {
		t.Errorf("%d of 20 succeeded on %d runners (%d at once, max 20)", ok, len(ids), most)
	}
	if perJob := float64(rest-rest0) / 20; perJob > 1.2 {
		t.Errorf("%.2f REST calls per job, want at most 1.2", perJob)
	}
	harness.Eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 && f.LiveRunners() == 0 })
	for _, j := range sim.Jobs() {
		if strings.Contains(j.Output, harness.GHToken) || strings.Contains(j.Output, "ACTIONS_RUNNER_INPUT_JITCONFIG") {
			t.Errorf("job %s saw the GitHub token or its runner's JIT config", j.Name)
		}
	}
	f.CheckNoSecretOnDisk()
	f.StopLeavesNothing()
	if sets := sim.ScaleSets(); len(sets) != 1 || sets[0].Session {
		t.Errorf("scale sets after the stop: %+v; want the one, with no session", sets)
	}
}

// TestGitHubScaleSetKill9 kills the manager mid-burst: the restarted one
// waits out the session the killed one left, opens its own, adopts the
// runners, and every job completes; nothing is left after the stop.
func TestGitHubScaleSetKill9(t *testing.T) {
	f := harness.ScaleSetFleet(t, "ghsk")
	sim := f.GH
	f.Start()
	harness.WaitSession(t, sim)
	sim.Queue("acme/ghsk", harness.Burst("ghsk", 20, "sleep 4")...)
	harness.Eventually(t, time.Minute, "jobs running", func() bool {
		running := 0
		for _, j := range sim.Jobs() {
			if j.Status == "in_progress" {
				running++
			}
		}
		return running >= 10
	})
	f.Kill9()
	time.Sleep(time.Second)
	f.Start()
	// The killed manager's session is still alive: the new one waits for
	// the service to drop it, then opens its own.
	harness.Eventually(t, time.Minute, "the restarted manager's session", func() bool { return sim.Sessions() == 2 })
	harness.Eventually(t, 3*time.Minute, "20 jobs done", func() bool { done, _ := harness.Completed(sim); return done == 20 })
	if _, ok := harness.Completed(sim); ok != 20 {
		t.Errorf("%d of 20 jobs succeeded", ok)
	}
	if !f.LogHas("another message session holds the scale set") {
		t.Error("the restarted manager did not find the killed one's session")
	}
	harness.Eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 && f.LiveRunners() == 0 })
	f.StopLeavesNothing()
	if sets := sim.ScaleSets(); len(sets) != 1 || sets[0].Session {
		t.Errorf("scale sets after the stop: %+v; want the one, with no session", sets)
	}
}
