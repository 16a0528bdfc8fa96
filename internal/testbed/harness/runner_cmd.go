package harness

import (
	"bytes"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
)

// RunnerCmd starts `runfleet runner` against a simulated repository, with
// the token only in REPO_TOKEN, as CML users pass it.
func RunnerCmd(t *testing.T, sim *ghsim.Server, repo string, args ...string) (*exec.Cmd, *Output) {
	t.Helper()
	args = append([]string{"runner", "--driver", "github", "--repo", sim.URL + "/" + repo, "--agent", needGitHubRunner(t)}, args...)
	return StartRunner(t, nil, args...)
}

// Output is a command's output, read while it runs: exec copies into it
// from a goroutine of its own.
type Output struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (o *Output) Write(b []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.Write(b)
}

// String is what it has printed so far.
func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

// StartRunner starts `runfleet runner` with the token in REPO_TOKEN and
// env added, and shows its output if the test fails.
func StartRunner(t *testing.T, env []string, args ...string) (*exec.Cmd, *Output) {
	t.Helper()
	cmd := exec.Command(FleetBin, args...)
	cmd.Env = append(append(os.Environ(), "REPO_TOKEN="+GHToken, "XDG_STATE_HOME="+t.TempDir()), env...)
	out := &Output{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		if t.Failed() {
			t.Logf("runfleet runner output:\n%s", TailString(out.String(), 6000))
		}
	})
	return cmd, out
}

func WaitExit(t *testing.T, cmd *exec.Cmd, within time.Duration) time.Duration {
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

func NewRunnerSim(t *testing.T, repo string) *ghsim.Server {
	t.Helper()
	needGitHubRunner(t)
	sim := ghsim.New(ghsim.Options{Token: GHToken, Repos: []string{repo}, LostAfter: 2 * time.Second})
	t.Cleanup(sim.Close)
	return sim
}

// NewCloudRunnerSim is a simulated GitHub for runners on the clouds' and
// the cluster's stand-ins, whose containers reach it at
// host.docker.internal (the address its just-in-time configs carry). A
// runner that vanishes is taken for lost after 2 s, so that a test sees it
// within its run.
func NewCloudRunnerSim(t *testing.T, repo string) *ghsim.Server {
	t.Helper()
	sim := ghsim.New(ghsim.Options{Token: GHToken, Repos: []string{repo}, LostAfter: 2 * time.Second, RunnerHost: "host.docker.internal"})
	t.Cleanup(sim.Close)
	return sim
}
