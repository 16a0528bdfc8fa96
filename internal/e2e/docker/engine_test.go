package docker

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/provider/docker"
)

// TestDockerEngineRestart restarts a private Docker engine (live-restore
// on, as a production engine upgraded in place runs) while two jobs run in
// its containers: the manager's event stream reconnects, the running
// containers are adopted (same containers, their output copied on), no
// runner is started twice, both jobs succeed and the pool refills.
func TestDockerEngineRestart(t *testing.T) {
	harness.Need(t)
	eng, err := harness.StartEngine(harness.EngineOptions{Name: "rfrst", Net: 232, DaemonJSON: `{"live-restore": true}`})
	peers.Need(t, "a private Docker engine (root and dockerd)", err)
	t.Cleanup(eng.Stop)
	f := harness.NewGitHubFleet(t, "engrestart", harness.GitHubOptions{Size: 2, Max: 4, Docker: true, Engine: eng})
	sim := f.GH
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return harness.IdleGitHub(sim) == 2 })
	// Counted before the jobs: the pool's refill of their two runners
	// may start at once, before the restart as well as after it.
	started := f.LogCount(`msg="runner started"`)
	sim.Queue("acme/engrestart",
		ghsim.JobSpec{Name: "a", Labels: []string{"self-hosted", "engrestart"}, Script: "sleep 12; echo job a finished"},
		ghsim.JobSpec{Name: "b", Labels: []string{"self-hosted", "engrestart"}, Script: "sleep 12; echo job b finished"})
	harness.Eventually(t, time.Minute, "2 jobs running", func() bool {
		n := 0
		for _, j := range sim.Jobs() {
			if j.Status == "in_progress" {
				n++
			}
		}
		return n == 2
	})
	busy := map[string]bool{} // the runners of the two jobs
	for _, j := range sim.Jobs() {
		if j.Status == "in_progress" {
			busy[j.RunnerName] = true
		}
	}
	before := map[string]string{} // busy runner -> container id
	for _, c := range f.Containers() {
		if r := c.Labels[docker.LabelRunner]; c.State == "running" && busy[r] {
			before[r] = c.ID
		}
	}
	if len(before) != 2 {
		t.Fatalf("the running jobs' containers: %v (runners %v), want 2", before, busy)
	}
	watch := harness.WatchContainers(t, f)

	if err := eng.Restart(3 * time.Second); err != nil {
		t.Fatal(err)
	}
	t.Log("engine restarted")
	harness.Eventually(t, time.Minute, "the event stream back", func() bool {
		return f.LogCount("docker event stream lost; reconnecting") > 0 && f.LogCount(`msg="runner container exited"`) > 0
	})
	harness.Eventually(t, 2*time.Minute, "both jobs done", func() bool { done, _ := harness.Completed(sim); return done == 2 })
	if _, ok := harness.Completed(sim); ok != 2 {
		t.Errorf("%d of 2 jobs succeeded", ok)
	}
	harness.Eventually(t, time.Minute, "the pool refilled", func() bool { return harness.IdleGitHub(sim) == 2 })
	watch.Stop()
	if d := watch.Duplicates(); len(d) > 0 {
		t.Errorf("runners with two running containers at once: %v", d)
	}
	// The jobs' containers were adopted, not replaced: the manager started
	// the two that refill the pool and nothing else.
	if n := f.LogCount(`msg="runner started"`) - started; n != 2 {
		t.Errorf("%d runners started since the jobs were queued, want 2 (the refill)", n)
	}
	for runner := range before {
		logs, _ := filepath.Glob(filepath.Join(f.State, "logs", runner+"-*.log"))
		var out strings.Builder
		for _, l := range logs {
			b, _ := os.ReadFile(l)
			out.Write(b)
		}
		if !strings.Contains(out.String(), "completed with result: Succeeded") {
			t.Errorf("the output copy of %s stopped at the engine restart:\n%s", runner, harness.TailString(out.String(), 1500))
		}
	}
	f.StopLeavesNothing()
}
