package github

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestGitHubCrashLoopBacksOff runs, for a minute, a GitHub pool whose
// agent exits at once without taking a job (a broken install): the pool
// backs off from 1s doubling, so the whole minute costs at most 30 forge
// calls, and the reason, with the agent's last line, is in `status -o
// json`, on the status page, in /metrics and in the log.
func TestGitHubCrashLoopBacksOff(t *testing.T) {
	top, _, base := harness.Listeners(t)
	broken := filepath.Join(t.TempDir(), "run.sh")
	script := "#!/bin/sh\necho 'Runner.Listener: cannot open /opt/actions-runner/bin/libcoreclr.so: No such file or directory' >&2\nexit 127\n"
	if err := os.WriteFile(broken, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	f := harness.NewGitHubFleet(t, "ghcrash", harness.GitHubOptions{Size: 1, AgentPath: broken, Top: top})
	sim := f.GH
	f.Start()
	time.Sleep(60 * time.Second)
	byCall, calls := sim.Calls()
	t.Logf("forge calls in 60s: %d %v", calls, byCall)
	if calls > 30 {
		t.Errorf("%d forge calls in a minute of an agent that exits at once; want at most 30", calls)
	}
	const why = "libcoreclr.so: No such file or directory"

	failures := harness.Metric(t, base, `runfleet_pool_start_failures{pool="ghcrash"}`)
	if failures < 4 {
		t.Errorf("runfleet_pool_start_failures = %v, want the failures in a row counted", failures)
	}
	if _, page := harness.Get(t, base+"/"); !strings.Contains(page, why) || !strings.Contains(page, "runner starts failed in a row") {
		t.Errorf("the status page does not say why the pool backs off:\n%s", page)
	}
	cmd := exec.Command(harness.FleetBin, "status", "-c", f.Config, "-o", "json")
	cmd.Env = append(os.Environ(), "E2E_GITHUB_TOKEN="+harness.GHToken)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	var doc struct {
		Pools []struct {
			Backoff *struct {
				Failures int       `json:"failures"`
				Until    time.Time `json:"until"`
				Reason   string    `json:"reason"`
			} `json:"backoff"`
		} `json:"pools"`
	}
	if err := json.Unmarshal(out, &doc); err != nil || len(doc.Pools) != 1 {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	if b := doc.Pools[0].Backoff; b == nil || b.Failures < 4 || !strings.Contains(b.Reason, why) {
		t.Errorf("status -o json does not say why the pool backs off:\n%s", out)
	}
	log, _ := os.ReadFile(f.LogPath)
	if n := strings.Count(string(log), "agent exited without taking a job; backing off"); n < 4 || !strings.Contains(string(log), why) {
		t.Errorf("%d backoff log lines; want one a failure, with the agent's output", n)
	}
	f.StopLeavesNothing()
}

// TestGitHubRegistrationTokenCrashLoopBacksOff: where GitHub offers no
// just-in-time runners, the agent registers itself with config.sh; one
// that fails there never shows a registration, and is a failed start all
// the same. Before, each such runner was replaced at once: 105
// registration tokens in 11 s, each able to enrol runners for an hour (45
// in 40 s here). Now the pool backs off from 1s doubling, as for a crash
// after registering.
func TestGitHubRegistrationTokenCrashLoopBacksOff(t *testing.T) {
	top, _, _ := harness.Listeners(t)
	dir := t.TempDir()
	config := "#!/bin/sh\necho 'Http response code: NotFound from POST https://github.example/api/v3/actions/runner-registration' >&2\nexit 1\n"
	if err := os.WriteFile(filepath.Join(dir, "config.sh"), []byte(config), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "run.sh"), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	f := harness.NewGitHubFleet(t, "ghregcrash", harness.GitHubOptions{Size: 1, AgentPath: filepath.Join(dir, "run.sh"), Top: top,
		Sim: ghsim.Options{NoJIT: true}})
	f.Start()
	time.Sleep(20 * time.Second)
	n := f.GH.RegistrationTokens()
	t.Logf("registration tokens in 20s: %d", n)
	// Starts 1, 2, 4, 8 s apart: 5 in 20 s, and one of margin for a slow
	// start.
	if n > 6 {
		t.Errorf("%d registration tokens in 20 s of a config.sh that fails; want at most 6", n)
	}
	log, _ := os.ReadFile(f.LogPath)
	if c := strings.Count(string(log), "agent exited without taking a job; backing off"); c < 3 || !strings.Contains(string(log), "runner-registration") {
		t.Errorf("%d backoff log lines; want one a failure, with config.sh's output", c)
	}
	f.StopLeavesNothing()
}
