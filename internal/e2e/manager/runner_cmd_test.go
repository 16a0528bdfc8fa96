package manager

import (
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestRunnerSingleOutlivesIdleTimeout: with --single and an idle timeout
// shorter than the job, the job runs to the end, then the runner exits and
// leaves no registration.
func TestRunnerSingleOutlivesIdleTimeout(t *testing.T) {
	sim := harness.NewRunnerSim(t, "acme/single")
	cmd, out := harness.RunnerCmd(t, sim, "acme/single", "--single", "--labels", "cml,gpu", "--idle-timeout", "1")
	sim.Queue("acme/single", ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "cml"}, Script: "sleep 3; echo trained; env"})
	took := harness.WaitExit(t, cmd, time.Minute)
	jobs := sim.Jobs()
	if len(jobs) != 1 || jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained") {
		t.Fatalf("job = %+v", jobs)
	}
	if strings.Contains(jobs[0].Output, harness.GHToken) || strings.Contains(out.String(), harness.GHToken) {
		t.Error("the token reached the job or the log")
	}
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	if n := len(sim.JITNames()); n != 1 {
		t.Errorf("%d runners registered for one --single job, want 1", n)
	}
	t.Logf("--single with --idle-timeout 1 and a 3s job: job %s, exited after %s", jobs[0].Conclusion, took.Round(time.Millisecond))
}

// TestRunnerIdleTimeout: no job within the idle timeout, and the runner
// exits, removing its registration.
func TestRunnerIdleTimeout(t *testing.T) {
	sim := harness.NewRunnerSim(t, "acme/idle")
	cmd, _ := harness.RunnerCmd(t, sim, "acme/idle", "--idle-timeout", "2s")
	took := harness.WaitExit(t, cmd, 30*time.Second)
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	t.Logf("--idle-timeout 2s: exited after %s, nothing left", took.Round(time.Millisecond))
}

// TestRunnerReuseIgnoresOffline: --reuse starts nothing when an online
// runner shares a label, but an offline one does not count.
func TestRunnerReuseIgnoresOffline(t *testing.T) {
	sim := harness.NewRunnerSim(t, "acme/reuse")
	sim.AddRunner("acme/reuse", "old-offline", []string{"cml"}, false, false)
	cmd, _ := harness.RunnerCmd(t, sim, "acme/reuse", "--reuse", "--idle-timeout", "1")
	harness.WaitExit(t, cmd, 30*time.Second)
	if n := len(sim.JITNames()); n != 1 {
		t.Fatalf("with only an offline match, %d runners registered, want 1", n)
	}
	sim.AddRunner("acme/reuse", "live", []string{"cml", "x"}, true, false)
	cmd, out := harness.RunnerCmd(t, sim, "acme/reuse", "--reuse", "--idle-timeout", "never")
	harness.WaitExit(t, cmd, 30*time.Second)
	if n := len(sim.JITNames()); n != 1 {
		t.Fatalf("with an online match, a runner was registered anyway (%d)", n)
	}
	if !strings.Contains(out.String(), "an existing runner matches") {
		t.Errorf("output does not say why nothing started:\n%s", out.String())
	}
}
