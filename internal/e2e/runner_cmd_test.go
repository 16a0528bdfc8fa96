package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/ghsim"
)

// runnerCmd starts `runfleet runner` against a simulated repository, with
// the token only in REPO_TOKEN, as CML users pass it.
func runnerCmd(t *testing.T, sim *ghsim.Server, repo string, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	args = append([]string{"runner", "--driver", "github", "--repo", sim.URL + "/" + repo, "--agent", needGitHubRunner(t)}, args...)
	return startRunner(t, nil, args...)
}

// startRunner starts `runfleet runner` with the token in REPO_TOKEN and
// env added, and shows its output if the test fails.
func startRunner(t *testing.T, env []string, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(fleetBin, args...)
	cmd.Env = append(append(os.Environ(), "REPO_TOKEN="+ghToken, "XDG_STATE_HOME="+t.TempDir()), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		if t.Failed() {
			t.Logf("runfleet runner output:\n%s", tailString(out.String(), 6000))
		}
	})
	return cmd, &out
}

func waitExit(t *testing.T, cmd *exec.Cmd, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("runfleet runner: %v", err)
		}
	case <-time.After(within):
		t.Fatalf("runfleet runner still running after %s", within)
	}
	return time.Since(start)
}

func newRunnerSim(t *testing.T, repo string) *ghsim.Server {
	t.Helper()
	needGitHubRunner(t)
	sim := ghsim.New(ghsim.Options{Token: ghToken, Repos: []string{repo}, LostAfter: 2 * time.Second})
	t.Cleanup(sim.Close)
	return sim
}

// TestRunnerSingleOutlivesIdleTimeout: with --single and an idle timeout
// shorter than the job, the job runs to the end, then the runner exits and
// leaves no registration.
func TestRunnerSingleOutlivesIdleTimeout(t *testing.T) {
	sim := newRunnerSim(t, "acme/single")
	cmd, out := runnerCmd(t, sim, "acme/single", "--single", "--labels", "cml,gpu", "--idle-timeout", "1")
	sim.Queue("acme/single", ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "cml"}, Script: "sleep 3; echo trained; env"})
	took := waitExit(t, cmd, time.Minute)
	jobs := sim.Jobs()
	if len(jobs) != 1 || jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained") {
		t.Fatalf("job = %+v", jobs)
	}
	if strings.Contains(jobs[0].Output, ghToken) || strings.Contains(out.String(), ghToken) {
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
	sim := newRunnerSim(t, "acme/idle")
	cmd, _ := runnerCmd(t, sim, "acme/idle", "--idle-timeout", "2s")
	took := waitExit(t, cmd, 30*time.Second)
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	t.Logf("--idle-timeout 2s: exited after %s, nothing left", took.Round(time.Millisecond))
}

// TestRunnerReuseIgnoresOffline: --reuse starts nothing when an online
// runner shares a label, but an offline one does not count.
func TestRunnerReuseIgnoresOffline(t *testing.T) {
	sim := newRunnerSim(t, "acme/reuse")
	sim.AddRunner("acme/reuse", "old-offline", []string{"cml"}, false, false)
	cmd, _ := runnerCmd(t, sim, "acme/reuse", "--reuse", "--idle-timeout", "1")
	waitExit(t, cmd, 30*time.Second)
	if n := len(sim.JITNames()); n != 1 {
		t.Fatalf("with only an offline match, %d runners registered, want 1", n)
	}
	sim.AddRunner("acme/reuse", "live", []string{"cml", "x"}, true, false)
	cmd, out := runnerCmd(t, sim, "acme/reuse", "--reuse", "--idle-timeout", "never")
	waitExit(t, cmd, 30*time.Second)
	if n := len(sim.JITNames()); n != 1 {
		t.Fatalf("with an online match, a runner was registered anyway (%d)", n)
	}
	if !strings.Contains(out.String(), "an existing runner matches") {
		t.Errorf("output does not say why nothing started:\n%s", out.String())
	}
}
