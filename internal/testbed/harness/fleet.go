package harness

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"
	"github.com/moby/moby/client"
	giteadrv "github.com/runfleet/runfleet/forge/gitea"
	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/internal/testbed/azsim"
	"github.com/runfleet/runfleet/internal/testbed/bbsim"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/glsim"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

var (
	Gitea     *peers.Gitea
	runnerBin string
	FleetBin  string
	setupErr  error
)

var (
	binOnce, giteaOnce sync.Once
	binErr             error
	binDir             string
)

// Main runs a package's end-to-end tests; call it from TestMain. The peers
// start on the first test that needs them, so that a package whose tests
// are all filtered out starts nothing, and stop when the tests end.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	defer func() {
		if Gitea != nil {
			Gitea.Stop()
		}
		stopGPUEngine()
		stopKube()
		stopSlurm()
		if binDir != "" {
			os.RemoveAll(binDir)
		}
	}()
	return m.Run()
}

// E2EBinaryEnv names a runfleet binary built without cgo (so that it also
// runs in FROM scratch images) that the end-to-end packages share: make
// test builds it once, where each package would otherwise link its own.
const E2EBinaryEnv = "RUNFLEET_E2E_BINARY"

// buildBinaries finds or builds runfleet and builds gitea-runner.
func buildBinaries() {
	if binDir, binErr = os.MkdirTemp("", "runfleet-e2e-bin-"); binErr != nil {
		return
	}
	FleetBin = os.Getenv(E2EBinaryEnv)
	if FleetBin == "" || os.Getenv("E2E_RACE") != "" {
		FleetBin = filepath.Join(binDir, "runfleet")
		args := []string{"build", "-trimpath", "-o", FleetBin}
		if os.Getenv("E2E_RACE") != "" {
			// The manager itself under the race detector; a report in
			// its log fails the test (see cleanup).
			args = append(args, "-race")
		}
		out, err := exec.Command("go", append(args, "github.com/runfleet/runfleet/cmd/runfleet")...).CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("build runfleet: %v\n%s", err, out)
			return
		}
	} else if _, binErr = os.Stat(FleetBin); binErr != nil {
		binErr = fmt.Errorf("%s: %w", E2EBinaryEnv, binErr)
		return
	}
	runnerBin, binErr = peers.RunnerBinary(context.Background(), os.Stderr)
}

// startGitea starts this package's Gitea, on all addresses, so that runner
// containers reach it through the bridge.
func startGitea() {
	Gitea, setupErr = peers.StartGitea(context.Background(), peers.GiteaOptions{Progress: os.Stderr, ListenAddr: "0.0.0.0"})
}

// RepoRoot is the module's root, where deploy/ and gpu/testdata are: the
// nearest directory above the test's own (go test runs a test in its
// package's) with a go.mod. Not found from the source's path, which
// -trimpath (make test's, so that Go's build cache serves every clone)
// leaves relative.
func RepoRoot() string {
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			panic("no go.mod above " + dir)
		}
	}
}

// Need skips a test when the real peers are not available, and fails it
// in CI, where they must be.
func Need(t testing.TB) {
	t.Helper()
	NeedBinaries(t)
	giteaOnce.Do(startGitea)
	peers.Need(t, "Gitea", setupErr)
}

// NeedBinaries is Need for the tests of the forges' simulators, which use
// runfleet and gitea-runner (in the instance image) but not Gitea.
func NeedBinaries(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("end-to-end test: skipped with -short")
	}
	binOnce.Do(buildBinaries)
	peers.Need(t, "gitea-runner and the runfleet binary", binErr)
}

// Fleet is one test's manager setup: a repository, a config, a state dir.
type Fleet struct {
	T testing.TB
	// Args are added to serve's (--listen, for a second manager on the
	// same config).
	Args     []string
	Repo     string
	Dir      string
	State    string
	Work     string
	Config   string
	LogPath  string
	Cmd      *exec.Cmd
	waitErr  chan error
	exited   chan struct{} // closed once the manager's Wait returned
	StartCnt int
	docker   bool
	Kube     bool
	GH       *ghsim.Server // a GitHub fleet's simulator
	GL       *glsim.Server // a GitLab fleet's simulator
	Hooks    string        // the webhook listener's base URL, when there is one
	// engine is the Docker engine of a Docker fleet when it is not the
	// default one (the GPU engine), and env what the manager needs to
	// reach it.
	engine *client.Client
	// engineDir is that engine's directory, whose dockerd.log a failed
	// test shows.
	engineDir string
	Env       []string
	EC2       *ec2sim.Server // an EC2 fleet's stand-in
	GCE       *gcesim.Server // a Compute Engine fleet's stand-in
	ARM       *armsim.Server // an Azure VM fleet's stand-in
	AZ        *azsim.Server  // an Azure Pipelines fleet's simulator
	BB        *bbsim.Server  // a Bitbucket fleet's simulator
	// Killed counts the runners a test killed mid-job on purpose: their
	// registrations may go while the forge still counts them busy.
	Killed int
	// crashes counts the managers Kill9 killed.
	crashes int
	// slurm is set for a fleet of Slurm jobs, whose manager runs as cred
	// (the cluster's ordinary user) from bin.
	slurm bool
	cred  *syscall.Credential
	bin   string
}

type FleetOptions struct {
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
	// GCE, when set, makes it a pool of Compute Engine instances on that
	// stand-in, with GCP (indented by six spaces) added to its gcp
	// section.
	GCE *gcesim.Server
	GCP string
	// ARM, when set, makes it a pool of Azure VMs on that stand-in, with
	// Azure (indented by six spaces) added to its azure section.
	ARM   *armsim.Server
	Azure string
	// Slurm, when set, makes it a pool of Slurm jobs on the package's
	// cluster (NeedSlurm), with these lines (indented by six spaces) in
	// its slurm section; its manager runs as the cluster's ordinary user.
	Slurm string
	// Top is added at the top of the config, Forge to the forge.
	Top, Forge string
	// Engine runs a Docker pool's containers instead of the default
	// engine (the GPU engine), with host networking: the section gives
	// `network: host` and the engine's image (Engine.GiteaRunnerImage).
	Engine *GPUEngine
}

func NewFleet(t testing.TB, name string, opt FleetOptions) *Fleet {
	t.Helper()
	Need(t)
	if err := Gitea.CreateRepo(name); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f := &Fleet{T: t, Repo: name, Dir: dir, State: filepath.Join(dir, "state"), Work: filepath.Join(dir, "work")}
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
`, name, f.State, Gitea.URL, Gitea.User, opt.Size, opt.Max, f.Work, runnerBin, opt.Drain, opt.Forge)
	if opt.Docker != "" {
		f.docker = true
		// The agent is the image's; the forge is reached from the bridge.
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		runnerURL := dockerForgeURL()
		if opt.Engine != nil {
			runnerURL = Gitea.URL // host networking
			f.engine, f.Env = opt.Engine.cli, []string{"DOCKER_HOST=" + opt.Engine.host}
			f.engineDir = opt.Engine.dir
		}
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+runnerURL+"\n    repo: ", 1)
		cfg += "    docker:\n" + opt.Docker
	}
	if opt.Kube != "" {
		f.Kube = true
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += "    provider: kubernetes\n    kubernetes:\n" + opt.Kube
	}
	if opt.EC2 != nil {
		f.EC2 = opt.EC2
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += AWSSection(opt.EC2, opt.AWS)
		f.Env = append(f.Env, AWSEnv()...)
	}
	if opt.GCE != nil {
		f.GCE = opt.GCE
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += GCPSection(opt.GCE, opt.GCP)
		f.Env = append(f.Env, GCPEnv(opt.GCE)...)
	}
	if opt.ARM != nil {
		f.ARM = opt.ARM
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "", 1)
		cfg = strings.Replace(cfg, "    repo: ", "    runner_url: "+dockerForgeURL()+"\n    repo: ", 1)
		cfg += AzureVMSection(opt.ARM, opt.Azure)
		f.Env = append(f.Env, opt.ARM.Env()...)
	}
	if opt.Slurm != "" {
		f.slurm = true
		cfg = strings.Replace(cfg, "      path: "+runnerBin+"\n", "      path: "+filepath.Join(Slurm.Bin, "gitea-runner")+"\n", 1)
		cfg += SlurmSection(opt.Slurm)
	}
	cfg += opt.Extra
	f.Config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.Config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	if f.slurm {
		f.asSlurmUser()
	}
	t.Cleanup(f.Cleanup)
	return f
}

// Cleanup kills what a test left running: the manager, runner processes
// and containers, after dumping the logs of a failed test.
func (f *Fleet) Cleanup() {
	if f.Cmd != nil {
		select {
		case <-f.exited:
		default:
			_ = f.Cmd.Process.Signal(syscall.SIGKILL)
			<-f.exited
		}
	}
	for i := 1; i <= f.StartCnt; i++ {
		if b, _ := os.ReadFile(filepath.Join(f.Dir, fmt.Sprintf("manager-%d.log", i))); bytes.Contains(b, []byte("WARNING: DATA RACE")) {
			f.T.Errorf("the manager reported a data race (manager log %d)", i)
		}
	}
	if f.T.Failed() || os.Getenv("E2E_LOGS") != "" {
		f.dumpLogs()
	}
	if dir := os.Getenv("E2E_KEEP_LOGS"); dir != "" {
		f.keepLogs(dir)
	}
	// Whatever a failed test left, no runner process may outlive it.
	for _, p := range f.RunnerPIDs() {
		_ = syscall.Kill(-p, syscall.SIGKILL)
	}
	if f.docker {
		f.removeContainers()
	}
	if f.Kube {
		f.removePods()
	}
	if f.slurm {
		f.cancelSlurmJobs()
	}
}

// keepLogs copies the managers' whole logs into dir/<test>/, for reading
// after a run (E2E_KEEP_LOGS): a failed test's dump shows only their ends.
func (f *Fleet) keepLogs(dir string) {
	to := filepath.Join(dir, strings.ReplaceAll(f.T.Name(), "/", "_"))
	if err := os.MkdirAll(to, 0o755); err != nil {
		f.T.Logf("keep logs: %v", err)
		return
	}
	for i := 1; i <= f.StartCnt; i++ {
		name := fmt.Sprintf("manager-%d.log", i)
		if b, err := os.ReadFile(filepath.Join(f.Dir, name)); err == nil {
			_ = os.WriteFile(filepath.Join(to, name), b, 0o644)
		}
	}
}

// Start runs `runfleet serve` with the token only in its environment.
func (f *Fleet) Start() {
	f.T.Helper()
	f.StartCnt++
	f.LogPath = filepath.Join(f.Dir, fmt.Sprintf("manager-%d.log", f.StartCnt))
	logf, err := os.Create(f.LogPath)
	if err != nil {
		f.T.Fatal(err)
	}
	f.Cmd = exec.Command(cmp.Or(f.bin, FleetBin), append([]string{"serve", "-c", f.Config, "--log-level", "debug"}, f.Args...)...)
	f.Cmd.Env = append(f.env(), "E2E_GITHUB_TOKEN="+GHToken)
	if f.cred != nil {
		f.Cmd.SysProcAttr = &syscall.SysProcAttr{Credential: f.cred}
	}
	f.Cmd.Stdout, f.Cmd.Stderr = logf, logf
	if err := f.Cmd.Start(); err != nil {
		f.T.Fatal(err)
	}
	// The channels of this start: a restart makes new ones while this
	// goroutine may still be at its end.
	cmd, waitErr, exited := f.Cmd, make(chan error, 1), make(chan struct{})
	f.waitErr, f.exited = waitErr, exited
	go func() {
		err := cmd.Wait()
		logf.Close()
		waitErr <- err
		close(exited)
	}()
}

// UseBinary runs the manager from another runfleet binary than the
// package's, from the next Start.
func (f *Fleet) UseBinary(path string) { f.bin = path }

// Driver is the Gitea driver on the fleet's repository, acting as the
// test itself: to plant registrations and to ask for removals.
func (f *Fleet) Driver() *giteadrv.Forge {
	return giteadrv.New(giteadrv.Config{URL: Gitea.URL, Token: Gitea.Token,
		Scope: giteadrv.Scope{Kind: "repo", Owner: Gitea.User, Repo: f.Repo}})
}

// Stop sends SIGTERM and waits for the drain to finish. A manager that
// was just started gets it once it catches signals: a process killed by
// a SIGTERM before its runtime let it catch one has made nothing to
// drain, and is no test of a drain.
func (f *Fleet) Stop(timeout time.Duration) error {
	f.T.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if b, _ := os.ReadFile(f.LogPath); bytes.Contains(b, []byte("SIGTERM drains from here on")) {
			break
		}
	}
	_ = f.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-f.waitErr:
		return err
	case <-time.After(timeout):
	}
	// What it waits on: the Go runtime writes every goroutine's stack
	// into its log on SIGQUIT, and exits.
	_ = f.Cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-f.waitErr:
	case <-time.After(10 * time.Second):
	}
	b, _ := os.ReadFile(f.LogPath)
	f.T.Logf("the manager's own goroutines %s after SIGTERM:\n%s", timeout, OwnGoroutines(string(b), 40000))
	return fmt.Errorf("manager did not exit within %s of SIGTERM", timeout)
}

// OwnGoroutines is the stacks of a Go program's SIGQUIT dump that run
// runfleet's code (not the runtime's or a library's alone), at most max
// bytes of them.
func OwnGoroutines(log string, max int) string {
	_, dump, ok := strings.Cut(log, "SIGQUIT: quit")
	if !ok {
		return "(no goroutine dump in the log)"
	}
	var out strings.Builder
	for g := range strings.SplitSeq(dump, "\n\n") {
		if !strings.Contains(g, "github.com/runfleet/runfleet/") || out.Len()+len(g) > max {
			continue
		}
		out.WriteString(g)
		out.WriteString("\n\n")
	}
	return out.String()
}

// StopLeavesNothing drains the manager with SIGTERM and checks that no
// registration, runner process, working directory or record is left.
func (f *Fleet) StopLeavesNothing() {
	f.T.Helper()
	if err := f.Stop(time.Minute); err != nil {
		f.T.Fatalf("manager exit after SIGTERM: %v", err)
	}
	if f.GH != nil {
		if r := f.GH.Runners(); len(r) != 0 {
			f.T.Errorf("%d registrations left at GitHub after shutdown: %+v", len(r), r)
		}
	} else if f.GL != nil {
		if r := f.GL.Runners(); len(r) != 0 {
			f.T.Errorf("%d runners left at GitLab after shutdown: %+v", len(r), r)
		}
	} else if f.AZ != nil {
		// The pools' placeholders stay, by design: never run, and
		// what keeps the pools' jobs queued while they have no agent.
		if a := AZRunners(f.AZ); len(a) != 0 {
			f.T.Errorf("%d agents left at Azure DevOps after shutdown: %+v", len(a), a)
		}
		for _, a := range f.AZ.AllAgents() {
			if a.DeletedBusy {
				f.T.Errorf("agent %s was deleted while it ran a job", a.Name)
			}
		}
	} else if f.BB != nil {
		checkBitbucketLeftNothing(f.T, f.BB, f.Killed, f.crashes > 0)
	} else if r := f.Runners(); len(r) != 0 {
		f.T.Errorf("%d registrations left after shutdown", len(r))
	}
	if p := f.RunnerPIDs(); len(p) != 0 {
		f.T.Errorf("runner processes left after shutdown: %v", p)
	}
	if left, _ := os.ReadDir(f.Work); len(left) != 0 {
		f.T.Errorf("workdirs left after shutdown: %d", len(left))
	}
	if recs := f.Records(); len(recs) != 0 {
		f.T.Errorf("runner records left after shutdown: %v", recs)
	}
	if f.docker {
		if c := f.Containers(); len(c) != 0 {
			f.T.Errorf("%d containers left after shutdown", len(c))
		}
		// The runners' registration files, bind-mounted from here.
		if left, _ := os.ReadDir(filepath.Join(f.State, "docker")); len(left) != 0 {
			f.T.Errorf("container files left after shutdown: %d", len(left))
		}
	}
	if f.Kube {
		f.KubeLeavesNothing()
	}
	if f.EC2 != nil {
		f.EC2LeavesNothing()
	}
	if f.GCE != nil {
		f.GCELeavesNothing()
	}
	if f.ARM != nil {
		f.AzureLeavesNothing()
	}
	if f.slurm {
		f.SlurmLeavesNothing()
	}
}

// Kill9 kills the manager as a crash would.
func (f *Fleet) Kill9() {
	f.T.Helper()
	_ = f.Cmd.Process.Signal(syscall.SIGKILL)
	<-f.waitErr
	f.crashes++
}

func (f *Fleet) dumpLogs() {
	for i := 1; i <= f.StartCnt; i++ {
		b, _ := os.ReadFile(filepath.Join(f.Dir, fmt.Sprintf("manager-%d.log", i)))
		f.T.Logf("manager log %d, less its per-pass lines:\n%s", i, TailString(withoutPassLines(string(b)), 16000))
	}
	logs, _ := filepath.Glob(filepath.Join(f.State, "logs", "*.log"))
	for _, l := range logs {
		// A GitHub runner that took a job and never finished it.
		if b, _ := os.ReadFile(l); !strings.Contains(string(b), "completed with result") && strings.Contains(string(b), "Running job") {
			f.T.Logf("unfinished agent log %s:\n%s", filepath.Base(l), TailString(string(b), 3000))
		}
	}
	for _, l := range logs[max(0, len(logs)-4):] {
		b, _ := os.ReadFile(l)
		f.T.Logf("agent log %s:\n%s", filepath.Base(l), TailString(string(b), 1500))
	}
	if f.engineDir != "" {
		// What the private engine did with the containers (a removal
		// that did not end, ...).
		b, _ := os.ReadFile(filepath.Join(f.engineDir, "dockerd.log"))
		f.T.Logf("the private engine's log:\n%s", TailString(string(b), 6000))
	}
}

// withoutPassLines drops the debug lines every pass writes for each slot
// and each pool's demand, which would crowd out of a failed test's output
// what the manager did, unless the line says something new: a slot's or a
// pool's first line, and each change of what it says, stay, so that the
// slots' course can be followed.
func withoutPassLines(log string) string {
	last := map[string]string{} // what a slot or a pool's demand last said
	lines := strings.SplitAfter(log, "\n")
	lines = slices.DeleteFunc(lines, func(l string) bool {
		for _, m := range []string{"level=DEBUG msg=slot ", "level=DEBUG msg=demand "} {
			if _, said, ok := strings.Cut(l, m); ok {
				key := m + passSubject(said)
				if last[key] == said {
					return true
				}
				last[key] = said
			}
		}
		return false
	})
	return strings.Join(lines, "")
}

// passSubject is the pool and the runner a pass line is about.
func passSubject(said string) string {
	var subject []string
	for f := range strings.FieldsSeq(said) {
		if strings.HasPrefix(f, "pool=") || strings.HasPrefix(f, "runner=") {
			subject = append(subject, f)
		}
	}
	return strings.Join(subject, " ")
}

func TailString(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

type Record struct {
	Name    string `json:"name"`
	PID     int    `json:"pid"`
	Workdir string `json:"workdir"`
}

// Records reads the process provider's runner records.
func (f *Fleet) Records() []Record {
	files, _ := filepath.Glob(filepath.Join(f.State, "process", "*.json"))
	var out []Record
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		var r Record
		if json.Unmarshal(b, &r) == nil {
			out = append(out, r)
		}
	}
	return out
}

// RunnerPIDs returns the live processes that run in the fleet's runner
// working directories (agents and their jobs' steps), oldest first: a
// test that kills their process groups in this order kills an agent
// before its job's shell, which the agent would otherwise report failed
// before it died (a finished job, not a lost runner). PIDs are not in
// that order once they wrap; start times are.
func (f *Fleet) RunnerPIDs() []int {
	type proc struct {
		pid   int
		start uint64
	}
	var procs []proc
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
		if err != nil || !strings.HasPrefix(cwd, f.Work+"/") {
			continue
		}
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		// After the command's name, in parentheses: the state, then
		// the fields from ppid on; the start time is the 22nd field.
		rest := st[bytes.LastIndexByte(st, ')')+1:]
		fields := strings.Fields(string(rest))
		if len(fields) < 20 || fields[0] == "Z" {
			continue
		}
		start, _ := strconv.ParseUint(fields[19], 10, 64)
		procs = append(procs, proc{pid, start})
	}
	slices.SortStableFunc(procs, func(a, b proc) int { return cmp.Compare(a.start, b.start) })
	out := make([]int, len(procs))
	for i, p := range procs {
		out[i] = p.pid
	}
	return out
}

func (f *Fleet) Client() *sdk.Client {
	c, err := Gitea.Client()
	if err != nil {
		f.T.Fatal(err)
	}
	return c
}

func (f *Fleet) Runners() []*sdk.ActionRunner {
	f.T.Helper()
	r, _, err := f.Client().ListRepoActionRunners(Gitea.User, f.Repo, sdk.ListActionRunnersOptions{ListOptions: sdk.ListOptions{PageSize: 100}})
	if err != nil {
		f.T.Fatalf("list runners: %v", err)
	}
	return r.Runners
}

// Jobs lists the repository's jobs, every page (Gitea gives 50 a page).
func (f *Fleet) Jobs() []*sdk.ActionWorkflowJob {
	f.T.Helper()
	var out []*sdk.ActionWorkflowJob
	for page := 1; ; page++ {
		r, _, err := f.Client().ListRepoActionJobs(Gitea.User, f.Repo, sdk.ListRepoActionJobsOptions{ListOptions: sdk.ListOptions{Page: page, PageSize: 50}})
		if err != nil {
			f.T.Fatalf("list jobs: %v", err)
		}
		out = append(out, r.Jobs...)
		if len(r.Jobs) < 50 {
			return out
		}
	}
}

// IdleOnline counts registrations that are online and have no job.
func (f *Fleet) IdleOnline() int {
	return f.countRunners(func(r *sdk.ActionRunner) bool { return r.Status == "online" && !r.Busy })
}

// ready counts the runners that can take a job now: online, idle and not
// disabled (a disabled one is being removed).
func (f *Fleet) ready() int {
	return f.countRunners(func(r *sdk.ActionRunner) bool { return r.Status == "online" && !r.Busy && !r.Disabled })
}

func (f *Fleet) countRunners(ok func(*sdk.ActionRunner) bool) int {
	n := 0
	for _, r := range f.Runners() {
		if ok(r) {
			n++
		}
	}
	return n
}

func (f *Fleet) Push(workflow string) {
	f.T.Helper()
	if err := Gitea.PutFile(f.Repo, ".gitea/workflows/ci.yaml", workflow, "ci"); err != nil {
		f.T.Fatal(err)
	}
}

func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Matrix returns a workflow of n jobs on the given label running script.
func Matrix(label string, n int, script string) string {
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

// WaitJobs waits until n jobs are completed and returns them.
func (f *Fleet) WaitJobs(n int, timeout time.Duration) []*sdk.ActionWorkflowJob {
	f.T.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(100 * time.Millisecond) {
		jobs := f.Jobs()
		open := openJobs(jobs)
		if len(jobs) >= n && len(jobs)-len(open) >= n && f.rerunsPending() == 0 && !freshFailure(jobs) {
			return jobs
		}
		if time.Now().After(deadline) {
			// Name the jobs, so that a failure says where to look.
			f.T.Fatalf("timed out after %s waiting for %d jobs to complete; Gitea lists %d, not completed: %v", timeout, n, len(jobs), open)
		}
	}
}

// lostSettle is how long a job's failure is left for the manager to find
// its runner lost before a test takes it as the job's result: a job the
// forge itself failed (Gitea's zombie cleanup of a task that never
// reached its runner) reads failed a pass or two before the manager says
// it will re-run it.
const lostSettle = 15 * time.Second

// freshFailure says whether a job failed within lostSettle.
func freshFailure(jobs []*sdk.ActionWorkflowJob) bool {
	for _, j := range jobs {
		if j.Conclusion == "failure" && time.Since(j.CompletedAt) < lostSettle {
			return true
		}
	}
	return false
}

// rerunsPending counts the runners the current manager found lost
// mid-job and whose run it has yet to re-run: a job Gitea handed to a
// runner that never got it (a fetch Gitea answered after the runner had
// given up on it) or that died with it fails, and the manager re-runs it
// once its run ends; until then the job reads as completed, failed. A
// killed manager's intentions are not counted: what it left, the next
// one finds or the test fails.
func (f *Fleet) rerunsPending() int {
	lost := map[string]bool{}
	for _, l := range LogLines(f.LogPath, "gitea: runner lost mid-job", "gitea: re-ran the failed jobs", "gitea: could not re-run", "gitea: the lost runner's run succeeded") {
		if id := rerunID.FindStringSubmatch(l); id != nil {
			lost[id[1]] = strings.Contains(l, "runner lost mid-job")
		}
	}
	n := 0
	for _, pending := range lost {
		if pending {
			n++
		}
	}
	return n
}

var rerunID = regexp.MustCompile(` id=(\d+)`)

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

// WaitInProgress waits until n jobs are in progress.
func (f *Fleet) WaitInProgress(n int) {
	f.T.Helper()
	Eventually(f.T, time.Minute, fmt.Sprintf("%d jobs in progress", n), func() bool {
		c := 0
		for _, j := range f.Jobs() {
			if j.Status == "in_progress" {
				c++
			}
		}
		return c == n
	})
}

type StatusDoc struct {
	Pools []struct {
		Name    string   `json:"name"`
		Refused []string `json:"refused"`
		Backoff *struct {
			Halted bool   `json:"halted"`
			Reason string `json:"reason"`
		} `json:"backoff"`
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

// env is the environment of a runfleet command of this fleet: the forge's
// token (the simulators' fleets have no Gitea) and the fleet's own.
func (f *Fleet) env() []string {
	env := os.Environ()
	if Gitea != nil {
		env = append(env, "E2E_GITEA_TOKEN="+Gitea.Token)
	}
	if f.GH != nil {
		env = append(env, "E2E_GITHUB_TOKEN="+GHToken)
	}
	return append(env, f.Env...)
}

// Status runs `runfleet status -o json`.
func (f *Fleet) Status() StatusDoc {
	f.T.Helper()
	cmd := exec.Command(FleetBin, "status", "-c", f.Config, "-o", "json")
	cmd.Env = f.env()
	out, err := cmd.Output()
	if err != nil {
		f.T.Fatalf("status: %v\n%s", err, out)
	}
	var doc StatusDoc
	if err := json.Unmarshal(out, &doc); err != nil || len(doc.Pools) != 1 {
		f.T.Fatalf("status output: %v\n%s", err, out)
	}
	return doc
}

func (f *Fleet) StatusTable() string {
	f.T.Helper()
	cmd := exec.Command(FleetBin, "status", "-c", f.Config)
	cmd.Env = f.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		f.T.Fatalf("status: %v\n%s", err, out)
	}
	return string(out)
}

// LiveRunners counts the runners with a live process.
func (f *Fleet) LiveRunners() int { return len(f.LiveDirs()) }

// LiveDirs is the set of working directories (under the work root) that
// live processes run in: one per live runner, since an agent and its
// job's steps share one.
func (f *Fleet) LiveDirs() map[string]bool {
	dirs := map[string]bool{}
	for _, pid := range f.RunnerPIDs() {
		cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
		if err != nil {
			continue
		}
		rel, _ := strings.CutPrefix(cwd, f.Work+"/")
		top, _, _ := strings.Cut(rel, "/")
		dirs[top] = true
	}
	return dirs
}

func Itoa(i int) string { return strconv.Itoa(i) }

// Rewrite edits the fleet's config file and sends SIGHUP.
func (f *Fleet) Rewrite(old, new string) {
	f.T.Helper()
	b, err := os.ReadFile(f.Config)
	if err != nil {
		f.T.Fatal(err)
	}
	if !strings.Contains(string(b), old) {
		f.T.Fatalf("config lacks %q", old)
	}
	if err := os.WriteFile(f.Config, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		f.T.Fatal(err)
	}
	if err := f.Cmd.Process.Signal(syscall.SIGHUP); err != nil {
		f.T.Fatal(err)
	}
}

func (f *Fleet) LogHas(s string) bool { return f.LogCount(s) > 0 }

// LogCount counts s in the current manager's log.
func (f *Fleet) LogCount(s string) int {
	b, _ := os.ReadFile(f.LogPath)
	return strings.Count(string(b), s)
}

func CountJobs(f *Fleet, status string) int {
	n := 0
	for _, j := range f.Jobs() {
		if j.Status == status {
			n++
		}
	}
	return n
}

func NeedBinary(t *testing.T) {
	t.Helper()
	NeedBinaries(t)
}

// RunnerBin is the gitea-runner the fleets' host processes run (after
// NeedBinaries).
func RunnerBin() string { return runnerBin }

// DockerForgeURL is Gitea as a runner container on the default bridge
// reaches it.
func DockerForgeURL() string { return dockerForgeURL() }
