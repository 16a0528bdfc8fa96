package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/ghsim"
)

// scaleSetFleet is an organisation-wide GitHub pool of size 0 and max 20
// in scale-set mode: no webhook, no poll.
func scaleSetFleet(t *testing.T, name string) *fleet {
	t.Helper()
	return newGitHubFleet(t, name, ghOptions{
		Size: 0, Max: 20, Org: true,
		Sim:   ghsim.Options{LongPoll: time.Second, SessionTimeout: 5 * time.Second},
		Forge: "    mode: scaleset\n    scale_set: " + name + "-set\n    poll_interval: 0s\n",
		Pool:  "    idle_timeout: 5s\n",
	})
}

// waitSession waits until the one scale set is held by a session.
func waitSession(t *testing.T, sim *ghsim.Server) {
	t.Helper()
	eventually(t, 30*time.Second, "the scale set's session", func() bool {
		sets := sim.ScaleSets()
		return len(sets) == 1 && sets[0].Session
	})
}

func burst(name string, n int, script string) []ghsim.JobSpec {
	specs := make([]ghsim.JobSpec, n)
	for i := range specs {
		specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("train (%d)", i+1), Labels: []string{"self-hosted", name + "-set"}, Script: script}
	}
	return specs
}

// serviceCalls splits the simulator's calls into the REST API's (which
// GitHub's rate limit counts) and the Actions service's (scale sets,
// sessions, messages, JIT configs).
func serviceCalls(sim *ghsim.Server) (rest, service int) {
	byCall, _ := sim.Calls()
	for k, n := range byCall {
		if strings.Contains(k, "/api/v3/") && !strings.Contains(k, "runner-registration") {
			rest += n
		} else {
			service += n
		}
	}
	return rest, service
}

// TestGitHubScaleSet runs a 20-job burst through a scale set on the
// simulator: every job on its own JIT runner, no runner and, after the
// manager stops, no session left.
func TestGitHubScaleSet(t *testing.T) {
	f := scaleSetFleet(t, "ghss")
	sim := f.gh
	f.start()
	waitSession(t, sim)
	rest0, service0 := serviceCalls(sim)
	start := time.Now()
	sim.Queue("acme/ghss", burst("ghss", 20, "env; sleep 1")...)
	most := 0
	eventually(t, 2*time.Minute, "20 jobs done", func() bool {
		most = max(most, len(sim.Runners()))
		done, _ := completed(sim)
		return done == 20
	})
	took := time.Since(start)
	rest, service := serviceCalls(sim)
	_, ok := completed(sim)
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
	eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 && f.liveRunners() == 0 })
	for _, j := range sim.Jobs() {
		if strings.Contains(j.Output, ghToken) || strings.Contains(j.Output, "ACTIONS_RUNNER_INPUT_JITCONFIG") {
			t.Errorf("job %s saw the GitHub token or its runner's JIT config", j.Name)
		}
	}
	f.checkNoSecretOnDisk()
	f.stopLeavesNothing()
	if sets := sim.ScaleSets(); len(sets) != 1 || sets[0].Session {
		t.Errorf("scale sets after the stop: %+v; want the one, with no session", sets)
	}
}

// TestGitHubScaleSetKill9 kills the manager mid-burst: the restarted one
// waits out the session the killed one left, opens its own, adopts the
// runners, and every job completes; nothing is left after the stop.
func TestGitHubScaleSetKill9(t *testing.T) {
	f := scaleSetFleet(t, "ghsk")
	sim := f.gh
	f.start()
	waitSession(t, sim)
	sim.Queue("acme/ghsk", burst("ghsk", 20, "sleep 4")...)
	eventually(t, time.Minute, "jobs running", func() bool {
		running := 0
		for _, j := range sim.Jobs() {
			if j.Status == "in_progress" {
				running++
			}
		}
		return running >= 10
	})
	f.kill9()
	time.Sleep(time.Second)
	f.start()
	// The killed manager's session is still alive: the new one waits for
	// the service to drop it, then opens its own.
	eventually(t, time.Minute, "the restarted manager's session", func() bool { return sim.Sessions() == 2 })
	eventually(t, 3*time.Minute, "20 jobs done", func() bool { done, _ := completed(sim); return done == 20 })
	if _, ok := completed(sim); ok != 20 {
		t.Errorf("%d of 20 jobs succeeded", ok)
	}
	if !f.logHas("another message session holds the scale set") {
		t.Error("the restarted manager did not find the killed one's session")
	}
	eventually(t, 45*time.Second, "no runner after idle_timeout", func() bool { return len(sim.Runners()) == 0 && f.liveRunners() == 0 })
	f.stopLeavesNothing()
	if sets := sim.ScaleSets(); len(sets) != 1 || sets[0].Session {
		t.Errorf("scale sets after the stop: %+v; want the one, with no session", sets)
	}
}
