package github

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
