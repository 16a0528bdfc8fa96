package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/ghsim"
	"github.com/runfleet/runfleet/internal/peers"
)

// ghToken is the simulated GitHub's personal access token: the secret that
// must reach no runner.
const ghToken = "ghp_e2eSimulatedTokenThatMustNotLeak0042"

// needGitHubRunner builds the stand-in for GitHub's runner (static, so
// that it also runs in a FROM scratch image).
func needGitHubRunner(t testing.TB) string {
	return ghStandIn.bin(t)
}

// needGitHubImage builds an image with the stand-in runner at
// /bin/github-runner.
func needGitHubImage(t testing.TB) string {
	return ghStandIn.image(t)
}

var ghStandIn = &standIn{pkg: "github.com/runfleet/runfleet/internal/ghsim/runner", file: "run.sh", name: "github-runner"}

// standIn is a stand-in agent built once per test binary, and its image.
type standIn struct {
	pkg  string // the command's package
	file string // its file name in the build directory
	name string // its name in /bin of the image, and the image's
	once sync.Once
	path string
	err  error
	img  string
}

// bin builds the stand-in (static, so that it also runs in a FROM
// scratch image).
func (s *standIn) bin(t testing.TB) string {
	t.Helper()
	need(t)
	s.once.Do(func() {
		dir, err := os.MkdirTemp("", "runfleet-standin-")
		if err != nil {
			s.err = err
			return
		}
		s.path = filepath.Join(dir, s.file)
		cmd := exec.Command("go", "build", "-o", s.path, s.pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			s.err = fmt.Errorf("build the stand-in %s: %v\n%s", s.name, err, out)
		}
	})
	if s.err != nil {
		t.Fatal(s.err)
	}
	return s.path
}

// image builds an image with the stand-in at /bin/<name>.
func (s *standIn) image(t testing.TB) string {
	t.Helper()
	bin := s.bin(t)
	needDocker(t)
	if s.img == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		img, err := peers.AgentImage(ctx, dockerCli, "runfleet-test/"+s.name, s.name, bin)
		if err != nil {
			t.Fatal(err)
		}
		s.img = img
	}
	return s.img
}

type ghOptions struct {
	Size, Max int
	Docker    bool
	Sim       ghsim.Options
	Forge     string // appended to the forge
	Pool      string // appended to the pool
	// Top is added at the top of the config.
	Top string
	// Engine runs the containers instead of the default engine, with
	// host networking.
	Engine *gpuEngine
	// AgentPath replaces the stand-in runner of a process pool.
	AgentPath string
	// Org makes the forge the organisation acme, not the repository.
	Org bool
}

// newGitHubFleet makes a manager config for a pool on a simulated GitHub
// repository acme/<name>.
func newGitHubFleet(t testing.TB, name string, opt ghOptions) *fleet {
	t.Helper()
	bin := needGitHubRunner(t)
	image := ""
	switch {
	case opt.Engine != nil:
		image = opt.Engine.image(t, bin)
		opt.Sim.RunnerHost = "127.0.0.1" // host networking
	case opt.Docker:
		image = needGitHubImage(t)
		opt.Sim.RunnerHost = "host.docker.internal"
	}
	opt.Sim.Token = ghToken
	opt.Sim.Repos = append(opt.Sim.Repos, "acme/"+name)
	scope := "/acme/" + name
	if opt.Org {
		opt.Sim.Orgs, scope = append(opt.Sim.Orgs, "acme"), "/acme"
	}
	if opt.Sim.LostAfter == 0 {
		opt.Sim.LostAfter = 2 * time.Second
	}
	sim := ghsim.New(opt.Sim)
	t.Cleanup(sim.Close)
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	dir := t.TempDir()
	f := &fleet{t: t, repo: name, dir: dir, state: filepath.Join(dir, "state"), work: filepath.Join(dir, "work"), gh: sim, docker: opt.Docker}
	if opt.Engine != nil {
		f.engine, f.env = opt.Engine.cli, []string{"DOCKER_HOST=" + opt.Engine.host}
	}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: 2m
forges:
  - name: gh
    type: github
    url: %[3]s%[8]s
    token: ${E2E_GITHUB_TOKEN}
%[7]spools:
  - name: %[1]s
    labels: [%[1]s, linux]
    size: %[4]d
    max: %[5]d
    workdir: %[6]s
    bootstrap_timeout: 1m
`, name, f.state, sim.URL, opt.Size, opt.Max, f.work, opt.Forge, scope)
	if opt.Size < 0 { // sized by the pool's GPUs
		cfg = strings.Replace(cfg, fmt.Sprintf("    size: %d\n    max: %d\n", opt.Size, opt.Max), "", 1)
	}
	if opt.Docker {
		cfg += "    agent:\n      path: /bin/github-runner\n    docker:\n      image: " + image + "\n      pull: never\n"
		if opt.Engine != nil {
			cfg += "      network: host\n"
		}
	} else {
		if opt.AgentPath != "" {
			bin = opt.AgentPath
		}
		cfg += "    agent:\n      path: " + bin + "\n"
	}
	cfg += opt.Pool
	f.config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.cleanup)
	return f
}

// idleGitHub counts runners online at the simulator without a job.
func idleGitHub(sim *ghsim.Server) int {
	n := 0
	for _, r := range sim.Runners() {
		if r.Online && r.JobID == 0 {
			n++
		}
	}
	return n
}

func completed(sim *ghsim.Server) (done, ok int) {
	for _, j := range sim.Jobs() {
		if j.Status == "completed" {
			done++
			if j.Conclusion == "success" {
				ok++
			}
		}
	}
	return done, ok
}

// jobScript runs in every job: it fails if an earlier job's file is
// there, and prints what a hostile job could read: its environment and
// every process's command line.
const jobScript = `test ! -e left-by-earlier-job || { echo "earlier job's file is here"; exit 1; }
touch left-by-earlier-job
echo "host=$(hostname) dir=$(pwd)"
env
for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' < "$f" 2>/dev/null; echo; done
sleep 0.3`

// TestGitHubPool runs 10 jobs through a pool of 2 on the simulated GitHub,
// with host processes and with containers: every job gets its own JIT
// registration, no job sees the token, steady-state API calls per job are
// counted, and nothing is left after the drain.
func TestGitHubPool(t *testing.T) {
	for _, mode := range []string{"process", "docker"} {
		t.Run(mode, func(t *testing.T) {
			name := "gh" + mode[:4]
			f := newGitHubFleet(t, name, ghOptions{Size: 2, Docker: mode == "docker"})
			sim := f.gh
			f.start()
			eventually(t, time.Minute, "2 idle runners online", func() bool { return idleGitHub(sim) == 2 })
			_, before := sim.Calls()

			specs := make([]ghsim.JobSpec, 10)
			for i := range specs {
				specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("test (%d)", i+1), Labels: []string{"self-hosted", name}, Script: jobScript}
			}
			start := time.Now()
			sim.Queue("acme/"+name, specs...)
			eventually(t, 2*time.Minute, "10 jobs done", func() bool { done, _ := completed(sim); return done == 10 })
			took := time.Since(start)
			// Steady state: the pool refilled, as before the jobs.
			eventually(t, time.Minute, "the pool refilled", func() bool { return idleGitHub(sim) == 2 })
			byEndpoint, after := sim.Calls()
			perJob := float64(after-before) / 10
			t.Logf("%s: 10 jobs in %s; forge API calls per job in steady state: %.2f (%d calls: %v)", mode, took.Round(time.Millisecond), perJob, after-before, byEndpoint)

			ids := map[int64]bool{}
			for _, j := range sim.Jobs() {
				if j.Conclusion != "success" {
					t.Errorf("job %s: %s\n%s", j.Name, j.Conclusion, tailString(j.Output, 2000))
				}
				ids[j.RunnerID] = true
				if strings.Contains(j.Output, ghToken) {
					t.Errorf("job %s saw the GitHub token", j.Name)
				}
				if strings.Contains(j.Output, "ACTIONS_RUNNER_INPUT_JITCONFIG") {
					t.Errorf("job %s saw the JIT config variable", j.Name)
				}
			}
			if len(ids) != 10 {
				t.Errorf("10 jobs ran on %d distinct registrations, want 10", len(ids))
			}
			jit := sim.JITNames()
			t.Logf("%s: %d JIT registrations; 10 jobs on %d distinct runner ids", mode, len(jit), len(ids))
			if perJob > 2 {
				t.Errorf("%.2f forge calls per job, want at most 2", perJob)
			}
			f.checkNoSecretOnDisk()
			f.stopLeavesNothing()
		})
	}
}

// checkNoSecretOnDisk looks for the access tokens in everything the
// manager and its runners wrote: logs, records, working directories,
// container files.
func (f *fleet) checkNoSecretOnDisk() {
	f.t.Helper()
	_ = filepath.Walk(f.dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() || path == f.config {
			return nil
		}
		b, _ := os.ReadFile(path)
		if bytes.Contains(b, []byte(ghToken)) {
			f.t.Errorf("the GitHub token is in %s", path)
		}
		if bytes.Contains(b, []byte(glToken)) {
			f.t.Errorf("the GitLab token is in %s", path)
		}
		return nil
	})
}

// TestGitHubDuplicateNameAndRateLimit: a stale registration under a name
// the pool reuses makes GitHub answer 422; the driver clears it and
// registers again. An exhausted rate limit makes the driver wait for the
// reset instead of calling again and again.
func TestGitHubDuplicateNameAndRateLimit(t *testing.T) {
	name := "ghdup"
	f := newGitHubFleet(t, name, ghOptions{Size: 1, Sim: ghsim.Options{DuplicateStatus: 422}, Forge: "    cache_ttl: 1h\n"})
	sim := f.gh
	f.start()
	eventually(t, time.Minute, "an idle runner", func() bool { return idleGitHub(sim) == 1 })
	// Another tool, or a crash, left a registration under the pool's
	// next name; the manager's list (kept for an hour) does not show it.
	stale := sim.AddRunner("acme/"+name, name+"-1", []string{"x"}, false, false)
	reset := time.Now().Add(3 * time.Second)
	sim.ExhaustRateLimit(reset)
	_, before := sim.Calls()
	sim.Queue("acme/"+name, ghsim.JobSpec{Name: "a", Labels: []string{name}, Script: "true"}, ghsim.JobSpec{Name: "b", Labels: []string{name}, Script: "true"})
	eventually(t, time.Minute, "2 jobs done", func() bool { done, _ := completed(sim); return done == 2 })
	eventually(t, time.Minute, "an idle runner", func() bool { return idleGitHub(sim) == 1 })
	_, after := sim.Calls()
	if _, ok := completed(sim); ok != 2 {
		t.Fatalf("%d of 2 jobs succeeded", ok)
	}
	t.Logf("duplicate-name answers: %d; answered 403 rate limited: %d; calls over the %s window and after: %d", sim.Duplicates(), sim.RateLimited(), time.Until(reset)+3*time.Second, after-before)
	if sim.Duplicates() == 0 {
		t.Error("the duplicate name was never refused: the test did not exercise it")
	}
	for _, r := range sim.Runners() {
		if r.ID == stale {
			t.Error("the stale registration is still there")
		}
	}
	if sim.RateLimited() == 0 || sim.RateLimited() > 2 {
		t.Errorf("%d calls answered 403 while the limit was exhausted; want 1 or 2 (one per caller in flight), not a loop", sim.RateLimited())
	}
	if after-before > 12 {
		t.Errorf("%d calls for 2 jobs through a rate limit, want few", after-before)
	}
	f.stopLeavesNothing()
}

// TestGitHubLostRunnerReruns kills a runner mid-job: GitHub fails the job,
// and runfleet re-runs the run's failed jobs once; the re-run succeeds on
// a fresh runner.
func TestGitHubLostRunnerReruns(t *testing.T) {
	name := "ghlost"
	f := newGitHubFleet(t, name, ghOptions{Size: 1, Sim: ghsim.Options{LostAfter: time.Second}})
	sim := f.gh
	f.start()
	eventually(t, time.Minute, "an idle runner", func() bool { return idleGitHub(sim) == 1 })
	// The first attempt hangs until killed; the re-run finds the marker.
	marker := filepath.Join(f.dir, "attempted")
	sim.Queue("acme/"+name, ghsim.JobSpec{Name: "train", Labels: []string{name}, Script: fmt.Sprintf("if [ -e %[1]s ]; then echo second attempt; exit 0; fi; touch %[1]s; sleep 600", marker)})
	eventually(t, time.Minute, "the job running", func() bool { return len(f.runnerPIDs()) > 0 && fileExists(marker) })
	for _, p := range f.runnerPIDs() {
		_ = syscall.Kill(-p, syscall.SIGKILL)
	}
	eventually(t, 2*time.Minute, "the job re-run and done", func() bool {
		for _, j := range sim.Jobs() {
			if j.Attempt == 2 && j.Status == "completed" {
				return true
			}
		}
		return false
	})
	for _, j := range sim.Jobs() {
		t.Logf("job %s attempt %d: %s %s on %s", j.Name, j.Attempt, j.Status, j.Conclusion, j.RunnerName)
		if j.Attempt == 2 && j.Conclusion != "success" {
			t.Errorf("re-run: %s\n%s", j.Conclusion, j.Output)
		}
	}
	if r := sim.Reruns(); len(r) != 1 {
		t.Errorf("re-runs = %v, want exactly one", r)
	}
	f.stopLeavesNothing()
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// TestGitHubScaleFromZeroWebhooks scales a GitHub pool of size 0 (max 3)
// on the simulator's workflow_job webhooks alone, each delivered twice and
// in no set order: 5 jobs succeed on at most 3 runners, redeliveries are
// counted as duplicates, and after idle_timeout no registration is left.
func TestGitHubScaleFromZeroWebhooks(t *testing.T) {
	top, hooks, base := listeners(t)
	f := newGitHubFleet(t, "ghzero", ghOptions{
		Size: 0, Max: 3,
		Sim:   ghsim.Options{WebhookURL: hooks + "/webhook/gh", WebhookSecret: hookSecret, Redeliver: true},
		Top:   top,
		Forge: "    webhook_secret: " + hookSecret + "\n    poll_interval: 0s\n",
		Pool:  "    idle_timeout: 5s\n",
	})
	sim := f.gh
	f.start()
	eventually(t, 30*time.Second, "the server", func() bool { code, _ := get(t, base+"/healthz"); return code == 200 })
	time.Sleep(2 * time.Second)
	if n := len(sim.Runners()); n != 0 {
		t.Fatalf("%d runners at size 0 with no job", n)
	}
	specs := make([]ghsim.JobSpec, 5)
	for i := range specs {
		specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("train (%d)", i+1), Labels: []string{"self-hosted", "ghzero"}, Script: "sleep 1"}
	}
	most := 0
	sim.Queue("acme/ghzero", specs...)
	eventually(t, 2*time.Minute, "5 jobs done", func() bool {
		most = max(most, len(sim.Runners()))
		done, _ := completed(sim)
		return done == 5
	})
	_, ok := completed(sim)
	dups := metric(t, base, `runfleet_webhook_deliveries_total{forge="gh",result="duplicate"}`)
	accepted := metric(t, base, `runfleet_webhook_deliveries_total{forge="gh",result="accepted"}`)
	t.Logf("5 jobs, %d succeeded, at most %d registrations at once; deliveries: %d answered 2xx, %v accepted, %v duplicates", ok, most, sim.Delivered(), accepted, dups)
	if ok != 5 || most > 3 {
		t.Errorf("%d of 5 succeeded, %d registrations at once (max 3)", ok, most)
	}
	if accepted < 10 || dups < 5 {
		t.Errorf("accepted %v, duplicates %v: every job has 3 states, each delivered twice", accepted, dups)
	}
	eventually(t, 45*time.Second, "no registration after idle_timeout", func() bool { return len(sim.Runners()) == 0 })
	f.stopLeavesNothing()
}

// TestGitHubRerunOnTimeout: with rerun_on_timeout: 1, a job cancelled for
// hitting its timeout (timed_out) is re-run once and resumes from its
// checkpoint; one that times out again is left; a failed job is never
// re-run, nor a timed-out one in a pool without the setting.
func TestGitHubRerunOnTimeout(t *testing.T) {
	top, hooks, _ := listeners(t)
	name := "ghtimeout"
	f := newGitHubFleet(t, name, ghOptions{
		Size: 2, Max: 4,
		Sim:   ghsim.Options{WebhookURL: hooks + "/webhook/gh", WebhookSecret: hookSecret},
		Top:   top,
		Forge: "    webhook_secret: " + hookSecret + "\n",
		Pool:  "    rerun_on_timeout: 1\n",
	})
	sim := f.gh
	f.start()
	eventually(t, time.Minute, "2 idle runners", func() bool { return idleGitHub(sim) == 2 })
	ckpt := filepath.Join(f.dir, "checkpoint")
	resumes := sim.Queue("acme/"+name, ghsim.JobSpec{Name: "train", Labels: []string{name}, Timeout: 3 * time.Second,
		Script: fmt.Sprintf("if [ -e %[1]s ]; then echo resumed from the checkpoint; exit 0; fi; touch %[1]s; sleep 600", ckpt)})
	endless := sim.Queue("acme/"+name, ghsim.JobSpec{Name: "endless", Labels: []string{name}, Timeout: 3 * time.Second, Script: "sleep 600"})
	failing := sim.Queue("acme/"+name, ghsim.JobSpec{Name: "broken", Labels: []string{name}, Script: "exit 1"})
	attempts := func(run int64) []ghsim.Job {
		var out []ghsim.Job
		for _, j := range sim.Jobs() {
			if j.RunID == run {
				out = append(out, j)
			}
		}
		return out
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		tr, en := attempts(resumes.ID), attempts(endless.ID)
		if len(tr) == 2 && tr[1].Status == "completed" && tr[0].Status == "completed" && len(en) == 2 && en[1].Status == "completed" {
			break
		}
		if time.Now().After(deadline) {
			for _, j := range sim.Jobs() {
				t.Logf("job %d run %d %s attempt %d: %s %s on %q", j.ID, j.RunID, j.Name, j.Attempt, j.Status, j.Conclusion, j.RunnerName)
			}
			t.Fatal("timed out waiting for train re-run and done, endless timed out twice")
		}
	}
	time.Sleep(5 * time.Second) // a wrong third attempt would show by now
	for _, run := range []int64{resumes.ID, endless.ID, failing.ID} {
		for _, j := range attempts(run) {
			t.Logf("%s attempt %d: %s", j.Name, j.Attempt, j.Conclusion)
		}
	}
	tr, en, br := attempts(resumes.ID), attempts(endless.ID), attempts(failing.ID)
	if tr[0].Conclusion != "timed_out" || tr[1].Conclusion != "success" || !strings.Contains(tr[1].Output, "resumed from the checkpoint") {
		t.Errorf("train: %s then %s (%q)", tr[0].Conclusion, tr[1].Conclusion, tr[1].Output)
	}
	if len(en) != 2 || en[1].Conclusion != "timed_out" {
		t.Errorf("endless: %d attempts, want 2, both timed out", len(en))
	}
	if len(br) != 1 || br[0].Conclusion != "failure" {
		t.Errorf("broken: %d attempts (%s), want 1 failure", len(br), br[0].Conclusion)
	}
	if r := sim.JobReruns(); len(r) != 2 {
		t.Errorf("job re-runs %v, want 2 (train's and endless's first attempts)", r)
	}
	if r := sim.Reruns(); len(r) != 0 {
		t.Errorf("runs re-run as lost: %v, want none", r)
	}
	f.stopLeavesNothing()
}
