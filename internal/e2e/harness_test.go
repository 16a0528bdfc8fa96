// Package e2e tests runfleet end to end against a real Gitea with real
// gitea-runner agents, both built from the Go module proxy on first use and
// cached (see internal/peers).
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/moby/moby/client"

	giteadrv "github.com/runfleet/runfleet/forge/gitea"
	"github.com/runfleet/runfleet/internal/ec2sim"
	"github.com/runfleet/runfleet/internal/ghsim"
	"github.com/runfleet/runfleet/internal/glsim"
	"github.com/runfleet/runfleet/internal/peers"
)

var (
	gitea     *peers.Gitea
	runnerBin string
	fleetBin  string
	setupErr  error
)

func TestMain(m *testing.M) {
	code := func() int {
		flag.Parse()
		if testing.Short() {
			return m.Run()
		}
		ctx := context.Background()
		progress := os.Stderr
		var dir string
		dir, setupErr = os.MkdirTemp("", "runfleet-e2e-bin-")
		if setupErr == nil {
			defer os.RemoveAll(dir)
			fleetBin = filepath.Join(dir, "runfleet")
			args := []string{"build", "-o", fleetBin}
			if os.Getenv("E2E_RACE") != "" {
				// The manager itself under the race detector; a
				// report in its log fails the test (see cleanup).
				args = append(args, "-race")
			}
			out, err := exec.Command("go", append(args, "github.com/runfleet/runfleet/cmd/runfleet")...).CombinedOutput()
			if err != nil {
				setupErr = fmt.Errorf("build runfleet: %v\n%s", err, out)
			}
		}
		if setupErr == nil {
			runnerBin, setupErr = peers.RunnerBinary(ctx, progress)
		}
		if setupErr == nil {
			// On all addresses, so that runner containers reach it
			// through the bridge.
			gitea, setupErr = peers.StartGitea(ctx, peers.GiteaOptions{Progress: progress, ListenAddr: "0.0.0.0"})
		}
		if gitea != nil {
			defer gitea.Stop()
		}
		defer stopGPUEngine()
		defer stopKube()
		return m.Run()
	}()
	os.Exit(code)
}

// need skips a test when the real peers are not available, and fails it
// in CI, where they must be.
func need(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("end-to-end test: skipped with -short")
	}
	peers.Need(t, "Gitea, gitea-runner and the runfleet binary", setupErr)
}

// fleet is one test's manager setup: a repository, a config, a state dir.
type fleet struct {
	t        testing.TB
	repo     string
	dir      string
	state    string
	work     string
	config   string
	logPath  string
	cmd      *exec.Cmd
	waitErr  chan error
	startCnt int
	docker   bool
	kube     bool
	gh       *ghsim.Server // a GitHub fleet's simulator
	gl       *glsim.Server // a GitLab fleet's simulator
	hooks    string        // the webhook listener's base URL, when there is one
	// engine is the Docker engine of a Docker fleet when it is not the
	// default one (the GPU engine), and env what the manager needs to
	// reach it.
	engine *client.Client
	env    []string
	ec2    *ec2sim.Server // an EC2 fleet's stand-in
}

type fleetOptions struct {
	Size, Max int
	Extra     string // appended to the pool
	Drain     string
	// Docker, when set, is the pool's docker section (indented by six
	// spaces) and makes it a Docker pool.
	Docker string
	// Kube, when set, is the pool's kubernetes section (indented by six
	// spaces; see kubeSection) and makes it a pool of pods.
	Kube string
	// EC2, when set, makes it a pool of EC2 instances on that stand-in,
	// with AWS (indented by six spaces) added to its aws section.
	EC2 *ec2sim.Server
	AWS string
	// Top is added at the top of the config, Forge to the forge.
	Top, Forge string
}

func newFleet(t testing.TB, name string, opt fleetOptions) *fleet {
	t.Helper()
	need(t)
	if err := gitea.CreateRepo(name); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f := &fleet{t: t, repo: name, dir: dir, state: filepath.Join(dir, "state"), work: filepath.Join(dir, "work")}
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	if opt.Drain == "" {
		opt.Drain = "2m"
	}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: %[9]s
forges:
  - name: local
    type: gitea
    url: %[3]s
    token: ${E2E_GITEA_TOKEN}
    repo: %[4]s/%[1]s
%[10]spools:
  - name: %[1]s
    labels: [%[1]s]
    size: %[5]d
    max: %[6]d
    workdir: %[7]s
    bootstrap_timeout: 1m
    agent:
      path: %[8]s
      fetch_interval: 1s
`, name, f.state, gitea.URL, gitea.User, opt.Size, opt.Max, f.work, runnerBin, opt.Drain, opt.Forge)
	if opt.Docker != "" {
		f.docker = true
		// The agent is the image's; the forge is reached from the bridge.
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += "    docker:\n" + opt.Docker
	}
	if opt.Kube != "" {
		f.kube = true
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += "    provider: kubernetes\n    kubernetes:\n" + opt.Kube
	}
	if opt.EC2 != nil {
		f.ec2 = opt.EC2
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += awsSection(opt.EC2, opt.AWS)
		f.env = append(f.env, awsEnv()...)
	}
	cfg += opt.Extra
	f.config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.cleanup)
	return f
}

// cleanup kills what a test left running: the manager, runner processes
// and containers, after dumping the logs of a failed test.
func (f *fleet) cleanup() {
	if f.cmd != nil && f.cmd.ProcessState == nil {
		_ = f.cmd.Process.Signal(syscall.SIGKILL)
		<-f.waitErr
	}
	for i := 1; i <= f.startCnt; i++ {
		if b, _ := os.ReadFile(filepath.Join(f.dir, fmt.Sprintf("manager-%d.log", i))); bytes.Contains(b, []byte("WARNING: DATA RACE")) {
			f.t.Errorf("the manager reported a data race (manager log %d)", i)
		}
	}
	if f.t.Failed() || os.Getenv("E2E_LOGS") != "" {
		f.dumpLogs()
	}
	if dir := os.Getenv("E2E_KEEP_LOGS"); dir != "" {
		f.keepLogs(dir)
	}
	// Whatever a failed test left, no runner process may outlive it.
	for _, p := range f.runnerPIDs() {
		_ = syscall.Kill(-p, syscall.SIGKILL)
	}
	if f.docker {
		f.removeContainers()
	}
	if f.kube {
		f.removePods()
	}
}

// keepLogs copies the managers' whole logs into dir/<test>/, for reading
// after a run (E2E_KEEP_LOGS): a failed test's dump shows only their ends.
func (f *fleet) keepLogs(dir string) {
	to := filepath.Join(dir, strings.ReplaceAll(f.t.Name(), "/", "_"))
	if err := os.MkdirAll(to, 0o755); err != nil {
		f.t.Logf("keep logs: %v", err)
		return
	}
	for i := 1; i <= f.startCnt; i++ {
		name := fmt.Sprintf("manager-%d.log", i)
		if b, err := os.ReadFile(filepath.Join(f.dir, name)); err == nil {
			_ = os.WriteFile(filepath.Join(to, name), b, 0o644)
		}
	}
}

// start runs `runfleet serve` with the token only in its environment.
func (f *fleet) start() {
	f.t.Helper()
	f.startCnt++
	f.logPath = filepath.Join(f.dir, fmt.Sprintf("manager-%d.log", f.startCnt))
	logf, err := os.Create(f.logPath)
	if err != nil {
		f.t.Fatal(err)
	}
	f.cmd = exec.Command(fleetBin, "serve", "-c", f.config, "--log-level", "debug")
	f.cmd.Env = append(os.Environ(), "E2E_GITEA_TOKEN="+gitea.Token, "E2E_GITHUB_TOKEN="+ghToken)
	f.cmd.Env = append(f.cmd.Env, f.env...)
	f.cmd.Stdout, f.cmd.Stderr = logf, logf
	if err := f.cmd.Start(); err != nil {
		f.t.Fatal(err)
	}
	f.waitErr = make(chan error, 1)
	go func() { f.waitErr <- f.cmd.Wait(); logf.Close() }()
}

// driver is the Gitea driver on the fleet's repository, acting as the
// test itself: to plant registrations and to ask for removals.
func (f *fleet) driver() *giteadrv.Driver {
	return giteadrv.New(giteadrv.Config{URL: gitea.URL, Token: gitea.Token,
		Scope: giteadrv.Scope{Kind: "repo", Owner: gitea.User, Repo: f.repo}})
}

// stop sends SIGTERM and waits for the drain to finish. A manager that
// was just started gets it once it catches signals: a process killed by
// a SIGTERM before its runtime let it catch one has made nothing to
// drain, and is no test of a drain.
func (f *fleet) stop(timeout time.Duration) error {
	f.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if b, _ := os.ReadFile(f.logPath); bytes.Contains(b, []byte("SIGTERM drains from here on")) {
			break
		}
	}
	_ = f.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-f.waitErr:
		return err
	case <-time.After(timeout):
		return fmt.Errorf("manager did not exit within %s of SIGTERM", timeout)
	}
}

// stopLeavesNothing drains the manager with SIGTERM and checks that no
// registration, runner process, working directory or record is left.
func (f *fleet) stopLeavesNothing() {
	f.t.Helper()
	if err := f.stop(time.Minute); err != nil {
		f.t.Fatalf("manager exit after SIGTERM: %v", err)
	}
	if f.gh != nil {
		if r := f.gh.Runners(); len(r) != 0 {
			f.t.Errorf("%d registrations left at GitHub after shutdown: %+v", len(r), r)
		}
	} else if f.gl != nil {
		if r := f.gl.Runners(); len(r) != 0 {
			f.t.Errorf("%d runners left at GitLab after shutdown: %+v", len(r), r)
		}
	} else if r := f.runners(); len(r) != 0 {
		f.t.Errorf("%d registrations left after shutdown", len(r))
	}
	if p := f.runnerPIDs(); len(p) != 0 {
		f.t.Errorf("runner processes left after shutdown: %v", p)
	}
	if left, _ := os.ReadDir(f.work); len(left) != 0 {
		f.t.Errorf("workdirs left after shutdown: %d", len(left))
	}
	if recs := f.records(); len(recs) != 0 {
		f.t.Errorf("runner records left after shutdown: %v", recs)
	}
	if f.docker {
		if c := f.containers(); len(c) != 0 {
			f.t.Errorf("%d containers left after shutdown", len(c))
		}
		// The runners' registration files, bind-mounted from here.
		if left, _ := os.ReadDir(filepath.Join(f.state, "docker")); len(left) != 0 {
			f.t.Errorf("container files left after shutdown: %d", len(left))
		}
	}
	if f.kube {
		f.kubeLeavesNothing()
	}
	if f.ec2 != nil {
		f.ec2LeavesNothing()
	}
}

// kill9 kills the manager as a crash would.
func (f *fleet) kill9() {
	f.t.Helper()
	_ = f.cmd.Process.Signal(syscall.SIGKILL)
	<-f.waitErr
}

func (f *fleet) dumpLogs() {
	for i := 1; i <= f.startCnt; i++ {
		b, _ := os.ReadFile(filepath.Join(f.dir, fmt.Sprintf("manager-%d.log", i)))
		f.t.Logf("manager log %d:\n%s", i, tailString(string(b), 6000))
	}
	logs, _ := filepath.Glob(filepath.Join(f.state, "logs", "*.log"))
	for _, l := range logs {
		// A GitHub runner that took a job and never finished it.
		if b, _ := os.ReadFile(l); !strings.Contains(string(b), "completed with result") && strings.Contains(string(b), "Running job") {
			f.t.Logf("unfinished agent log %s:\n%s", filepath.Base(l), tailString(string(b), 3000))
		}
	}
	for _, l := range logs[max(0, len(logs)-4):] {
		b, _ := os.ReadFile(l)
		f.t.Logf("agent log %s:\n%s", filepath.Base(l), tailString(string(b), 1500))
	}
}

func tailString(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

type record struct {
	Name    string `json:"name"`
	PID     int    `json:"pid"`
	Workdir string `json:"workdir"`
}

// records reads the process provider's runner records.
func (f *fleet) records() []record {
	files, _ := filepath.Glob(filepath.Join(f.state, "process", "*.json"))
	var out []record
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		var r record
		if json.Unmarshal(b, &r) == nil {
			out = append(out, r)
		}
	}
	return out
}

// runnerPIDs finds live processes whose working directory is under this
// fleet's work root, whatever the records say.
func (f *fleet) runnerPIDs() []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
		if err != nil || !strings.HasPrefix(cwd, f.work+"/") {
			continue
		}
		if st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); bytes.Contains(st, []byte(") Z ")) {
			continue
		}
		out = append(out, pid)
	}
	return out
}

func (f *fleet) client() *sdk.Client {
	c, err := gitea.Client()
	if err != nil {
		f.t.Fatal(err)
	}
	return c
}

func (f *fleet) runners() []*sdk.ActionRunner {
	f.t.Helper()
	r, _, err := f.client().ListRepoActionRunners(gitea.User, f.repo, sdk.ListActionRunnersOptions{ListOptions: sdk.ListOptions{PageSize: 100}})
	if err != nil {
		f.t.Fatalf("list runners: %v", err)
	}
	return r.Runners
}

// jobs lists the repository's jobs, every page (Gitea gives 50 a page).
func (f *fleet) jobs() []*sdk.ActionWorkflowJob {
	f.t.Helper()
	var out []*sdk.ActionWorkflowJob
	for page := 1; ; page++ {
		r, _, err := f.client().ListRepoActionJobs(gitea.User, f.repo, sdk.ListRepoActionJobsOptions{ListOptions: sdk.ListOptions{Page: page, PageSize: 50}})
		if err != nil {
			f.t.Fatalf("list jobs: %v", err)
		}
		out = append(out, r.Jobs...)
		if len(r.Jobs) < 50 {
			return out
		}
	}
}

// idleOnline counts registrations that are online and have no job.
func (f *fleet) idleOnline() int {
	return f.countRunners(func(r *sdk.ActionRunner) bool { return r.Status == "online" && !r.Busy })
}

// ready counts the runners that can take a job now: online, idle and not
// disabled (a disabled one is being removed).
func (f *fleet) ready() int {
	return f.countRunners(func(r *sdk.ActionRunner) bool { return r.Status == "online" && !r.Busy && !r.Disabled })
}

func (f *fleet) countRunners(ok func(*sdk.ActionRunner) bool) int {
	n := 0
	for _, r := range f.runners() {
		if ok(r) {
			n++
		}
	}
	return n
}

func (f *fleet) push(workflow string) {
	f.t.Helper()
	if err := gitea.PutFile(f.repo, ".gitea/workflows/ci.yaml", workflow, "ci"); err != nil {
		f.t.Fatal(err)
	}
}

func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// matrix returns a workflow of n jobs on the given label running script.
func matrix(label string, n int, script string) string {
	ns := make([]string, n)
	for i := range ns {
		ns[i] = fmt.Sprint(i + 1)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "name: ci\non: [push]\njobs:\n  job:\n    runs-on: %s\n    strategy:\n      matrix:\n        n: [%s]\n    steps:\n      - run: |\n", label, strings.Join(ns, ", "))
	sc := bufio.NewScanner(strings.NewReader(script))
	for sc.Scan() {
		fmt.Fprintf(&b, "          %s\n", sc.Text())
	}
	return b.String()
}

// waitJobs waits until n jobs are completed and returns them.
func (f *fleet) waitJobs(n int, timeout time.Duration) []*sdk.ActionWorkflowJob {
	f.t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(100 * time.Millisecond) {
		jobs := f.jobs()
		open := openJobs(jobs)
		if len(jobs) >= n && len(jobs)-len(open) >= n {
			return jobs
		}
		if time.Now().After(deadline) {
			// Name the jobs, so that a failure says where to look.
			f.t.Fatalf("timed out after %s waiting for %d jobs to complete; Gitea lists %d, not completed: %v", timeout, n, len(jobs), open)
		}
	}
}

// openJobs names the jobs not completed, with their status and runner.
func openJobs(jobs []*sdk.ActionWorkflowJob) []string {
	var open []string
	for _, j := range jobs {
		if j.Status != "completed" {
			open = append(open, fmt.Sprintf("%s (run %d) %s on %q", j.Name, j.RunID, j.Status, j.RunnerName))
		}
	}
	return open
}

// waitInProgress waits until n jobs are in progress.
func (f *fleet) waitInProgress(n int) {
	f.t.Helper()
	eventually(f.t, time.Minute, fmt.Sprintf("%d jobs in progress", n), func() bool {
		c := 0
		for _, j := range f.jobs() {
			if j.Status == "in_progress" {
				c++
			}
		}
		return c == n
	})
}

type statusDoc struct {
	Pools []struct {
		Name    string `json:"name"`
		Runners []struct {
			Name     string `json:"name"`
			State    string `json:"state"`
			RunnerID int64  `json:"runner_id"`
			Reason   string `json:"reason"`
			Job      *struct {
				Name string `json:"name"`
			} `json:"job"`
		} `json:"runners"`
	} `json:"pools"`
}

// status runs `runfleet status -o json`.
func (f *fleet) status() statusDoc {
	f.t.Helper()
	cmd := exec.Command(fleetBin, "status", "-c", f.config, "-o", "json")
	cmd.Env = append(append(os.Environ(), "E2E_GITEA_TOKEN="+gitea.Token), f.env...)
	out, err := cmd.Output()
	if err != nil {
		f.t.Fatalf("status: %v\n%s", err, out)
	}
	var doc statusDoc
	if err := json.Unmarshal(out, &doc); err != nil || len(doc.Pools) != 1 {
		f.t.Fatalf("status output: %v\n%s", err, out)
	}
	return doc
}

func (f *fleet) statusTable() string {
	f.t.Helper()
	cmd := exec.Command(fleetBin, "status", "-c", f.config)
	cmd.Env = append(append(os.Environ(), "E2E_GITEA_TOKEN="+gitea.Token), f.env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		f.t.Fatalf("status: %v\n%s", err, out)
	}
	return string(out)
}

// liveRunners counts the runners with a live process.
func (f *fleet) liveRunners() int { return len(f.liveDirs()) }

// liveDirs is the set of working directories (under the work root) that
// live processes run in: one per live runner, since an agent and its
// job's steps share one.
func (f *fleet) liveDirs() map[string]bool {
	dirs := map[string]bool{}
	for _, pid := range f.runnerPIDs() {
		cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
		if err != nil {
			continue
		}
		rel, _ := strings.CutPrefix(cwd, f.work+"/")
		top, _, _ := strings.Cut(rel, "/")
		dirs[top] = true
	}
	return dirs
}
