package manager

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge/github"
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

// A host without GitHub's runner: `runfleet runner` fetches the release
// (from a loopback mirror of it, the stand-in runner packed as
// actions/runner packs its own, with its checksum), unpacks it into its
// cache, and the job runs on it; a second run takes it from the cache.
func TestRunnerFetchesTheAgent(t *testing.T) {
	sim := harness.NewRunnerSim(t, "acme/fetch")
	tgz := harness.GitHubRunnerRelease(t)
	rel := github.AgentRelease
	file := strings.NewReplacer("{arch}", rel.Arch[runtime.GOARCH], "{version}", rel.Version).Replace(rel.File)
	var fetched atomic.Int64
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/actions-runner/"+file {
			http.NotFound(w, r)
			return
		}
		fetched.Add(1)
		w.Write(tgz)
	}))
	t.Cleanup(mirror.Close)
	sum := sha256.Sum256(tgz)
	cache := t.TempDir()
	for i := range 2 {
		cmd, out := harness.StartRunner(t, []string{"PATH=/usr/bin:/bin", "XDG_CACHE_HOME=" + cache},
			"runner", "--driver", "github", "--repo", sim.URL+"/acme/fetch", "--single", "--labels", "cml",
			"--agent-url", mirror.URL+"/actions-runner", "--agent-sha256", hex.EncodeToString(sum[:]))
		sim.Queue("acme/fetch", ghsim.JobSpec{Name: fmt.Sprint("train-", i), Labels: []string{"self-hosted", "cml"}, Script: "echo on-the-fetched-runner"})
		harness.WaitExit(t, cmd, time.Minute)
		if i == 0 && !strings.Contains(out.String(), "fetched the forge's runner agent") {
			t.Errorf("the output does not say the agent was fetched:\n%s", out.String())
		}
	}
	jobs := sim.Jobs()
	if len(jobs) != 2 || jobs[0].Conclusion != "success" || jobs[1].Conclusion != "success" || !strings.Contains(jobs[0].Output, "on-the-fetched-runner") {
		t.Fatalf("jobs = %+v", jobs)
	}
	if n := fetched.Load(); n != 1 {
		t.Errorf("the release was fetched %d times for two runs, want once", n)
	}
}
