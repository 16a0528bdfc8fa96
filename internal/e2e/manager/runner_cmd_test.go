package manager

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge/gitea"
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

// `runfleet runner` against Gitea on a host without gitea-runner: the
// real gitea-runner is fetched from a loopback mirror laid out as
// dl.gitea.com lays out its releases (each binary beside its .sha256,
// which runfleet reads first since it pins no digest for it), and takes
// the job; the run exits 0.
func TestRunnerFetchesGiteaRunner(t *testing.T) {
	f := harness.NewFleet(t, "rffetch", harness.FleetOptions{Size: 1}) // its repository; no manager runs
	bin, err := os.ReadFile(harness.RunnerBin())
	if err != nil {
		t.Fatal(err)
	}
	rel := gitea.AgentRelease
	file := strings.NewReplacer("{arch}", rel.Arch[runtime.GOARCH], "{version}", rel.Version).Replace(rel.File)
	sum := sha256.Sum256(bin)
	var fetched atomic.Int64
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/" + file + ".sha256":
			fmt.Fprintf(w, "%s  %s\n", hex.EncodeToString(sum[:]), file)
		case "/" + file:
			fetched.Add(1)
			w.Write(bin)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(mirror.Close)
	cmd, out := harness.StartRunner(t, []string{"PATH=/usr/bin:/bin", "XDG_CACHE_HOME=" + t.TempDir(), "REPO_TOKEN=" + harness.Gitea.Token},
		"runner", "--driver", "gitea", "--repo", harness.Gitea.URL+"/"+harness.Gitea.User+"/rffetch", "--single", "--labels", "rffetch",
		"--agent-url", mirror.URL)
	f.Push(harness.Matrix("rffetch", 1, "echo on-the-fetched-gitea-runner"))
	jobs := f.WaitJobs(1, 3*time.Minute)
	if jobs[0].Conclusion != "success" {
		t.Errorf("job %d: %s", jobs[0].ID, jobs[0].Conclusion)
	}
	harness.WaitExit(t, cmd, time.Minute)
	if n := fetched.Load(); n != 1 || !strings.Contains(out.String(), "fetched the forge's runner agent") {
		t.Errorf("gitea-runner fetched %d times; output:\n%s", n, out.String())
	}
}

// The on-premise `cml runner launch` examples of CML's docs, run as
// written but for the command name, on a host without GitHub's runner
// (fetched from a loopback mirror, which CML_RUNNER_AGENT_URL names as a
// site's would): each registers a runner that takes a job, and exits 0
// when stopped as a user stops it.
func TestCMLExamplesOnPremise(t *testing.T) {
	sim := harness.NewRunnerSim(t, "acme/onprem")
	tgz := harness.GitHubRunnerRelease(t)
	rel := github.AgentRelease
	file := strings.NewReplacer("{arch}", rel.Arch[runtime.GOARCH], "{version}", rel.Version).Replace(rel.File)
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/"+file {
			http.NotFound(w, r)
			return
		}
		w.Write(tgz)
	}))
	t.Cleanup(mirror.Close)
	sum := sha256.Sum256(tgz)
	// CML_DRIVER: the stand-in is not at github.com, by whose host CML
	// and runfleet tell a repository URL's forge.
	env := []string{"PATH=/usr/bin:/bin", "XDG_CACHE_HOME=" + t.TempDir(), "REPO_TOKEN=", "CML_DRIVER=github",
		"CML_RUNNER_AGENT_URL=" + mirror.URL, "CML_RUNNER_AGENT_SHA256=" + hex.EncodeToString(sum[:])}
	repo, token := sim.URL+"/acme/onprem", harness.GHToken
	for _, ex := range []struct {
		where  string
		args   []string
		labels []string
	}{
		{"iterative/cml README.md, On-premise (Local) Runners",
			[]string{"--repo=" + repo, "--token=" + token, "--labels=local,runner", "--idle-timeout=180"}, []string{"local"}},
		{"iterative/cml.dev content/docs/self-hosted-runners.md, On-premise (Local) Runners",
			[]string{"--repo=" + repo, "--token=" + token, "--labels=cml-gpu", "--idle-timeout=never"}, []string{"cml-gpu"}},
	} {
		t.Run(strings.ReplaceAll(ex.where[strings.LastIndex(ex.where, "/")+1:], " ", ""), func(t *testing.T) {
			cmd, out := harness.StartRunner(t, env, append([]string{"runner", "launch"}, ex.args...)...)
			n := len(sim.Jobs())
			sim.Queue("acme/onprem", ghsim.JobSpec{Name: "train", Labels: append([]string{"self-hosted"}, ex.labels...), Script: "echo trained-on-premise"})
			harness.Eventually(t, 2*time.Minute, "the job done", func() bool { j := sim.Jobs(); return len(j) > n && j[n].Conclusion != "" })
			if j := sim.Jobs()[n]; j.Conclusion != "success" || !strings.Contains(j.Output, "trained-on-premise") {
				t.Fatalf("job: %+v", j)
			}
			_ = cmd.Process.Signal(syscall.SIGTERM)
			harness.WaitExit(t, cmd, time.Minute)
			if strings.Contains(out.String(), token) {
				t.Error("the token reached the runner's log")
			}
		})
	}
	if left := sim.Runners(); len(left) != 0 {
		t.Errorf("registrations left: %+v", left)
	}
}
