package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/provider/slurm"
)

// SlurmCluster is this package's Slurm: Debian's slurmctld and slurmd on
// this host (one node with two fake GPUs as gres), munge, and an ordinary
// user the managers of its tests run as.
type SlurmCluster struct {
	Dir, Conf, Node string
	// State is slurmctld's StateSaveLocation (the jobs' scripts and
	// environments), Spool slurmd's.
	State, Spool string
	User         string
	cred         *syscall.Credential
	home         string
	// Bin holds copies of runfleet and gitea-runner that the user can run.
	Bin  string
	cmds []*exec.Cmd
}

var (
	Slurm     *SlurmCluster
	slurmOnce sync.Once
	slurmErr  error
)

// PreemptGrace is the GraceTime of the test cluster's preemptible
// partitions (scavenger: PreemptMode=CANCEL; requeue: REQUEUE), whose jobs
// give way to those of partition urgent.
const PreemptGrace = 20 * time.Second

// SlurmUser is the unprivileged user the Slurm fleets' managers run as.
const SlurmUser = "runfleet-ci"

// NeedSlurm starts the package's Slurm cluster on first use; a missing
// Slurm fails the test in CI.
func NeedSlurm(t testing.TB) *SlurmCluster {
	t.Helper()
	NeedBinaries(t)
	slurmOnce.Do(func() { Slurm, slurmErr = startSlurm() })
	peers.Need(t, "Slurm (slurmctld, slurmd, slurmdbd, slurm-client, munge and MariaDB from Debian; make deps installs them; root to start them)", slurmErr)
	return Slurm
}

func startSlurm() (*SlurmCluster, error) {
	for _, c := range []string{"slurmctld", "slurmd", "slurmdbd", "sbatch", "squeue", "scancel", "scontrol", "sacct", "sacctmgr",
		"munged", "mariadbd", "mariadb-install-db", "mariadb"} {
		if _, err := exec.LookPath(c); err != nil {
			return nil, fmt.Errorf("%s not found: %w", c, err)
		}
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("starting slurmctld and slurmd needs root")
	}
	host, err := os.Hostname()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "runfleet-slurm-")
	if err != nil {
		return nil, err
	}
	s := &SlurmCluster{Dir: dir, Conf: filepath.Join(dir, "slurm.conf"), Node: host,
		State: filepath.Join(dir, "state"), Spool: filepath.Join(dir, "spool"), Bin: filepath.Join(dir, "bin")}
	if err := s.setup(); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *SlurmCluster) setup() error {
	for _, d := range []string{s.State, s.Spool, s.Bin, filepath.Join(s.Dir, "log")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := os.Chmod(s.Dir, 0o755); err != nil {
		return err
	}
	if err := startMunge(); err != nil {
		return err
	}
	// Two fake GPUs: the null device twice, as gres files.
	for i := range 2 {
		p := fmt.Sprintf("/dev/fakegpu%d", i)
		if _, err := os.Stat(p); err != nil {
			if err := syscall.Mknod(p, syscall.S_IFCHR|0o666, int(unix1x3())); err != nil {
				return fmt.Errorf("mknod %s: %w", p, err)
			}
		}
	}
	ports, err := peers.FreePorts(4) // slurmctld, slurmd, MariaDB, slurmdbd
	if err != nil {
		return err
	}
	conf := fmt.Sprintf(`ClusterName=runfleet
SlurmctldHost=%[1]s
SlurmUser=root
SlurmctldPort=%[2]d
SlurmdPort=%[3]d
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
StateSaveLocation=%[4]s/state
SlurmdSpoolDir=%[4]s/spool
SlurmctldPidFile=%[4]s/slurmctld.pid
SlurmdPidFile=%[4]s/slurmd.pid
SlurmctldLogFile=%[4]s/log/slurmctld.log
SlurmdLogFile=%[4]s/log/slurmd.log
ReturnToService=2
MpiDefault=none
GresTypes=gpu
KillWait=5
MaxJobCount=20000
# As a site's: a job over its partition's MaxTime is refused at submission
# (not left pending for ever), and the partitions of lower PriorityTier
# give way to a higher one's jobs, cancelled or requeued, after a grace
# time with --signal's signal sent at once (slurm.conf(5): PreemptType,
# PreemptMode, GraceTime, preempt_send_user_signal).
EnforcePartLimits=ALL
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SchedulerParameters=preempt_send_user_signal
%[6]sNodeName=%[1]s CPUs=16 RealMemory=16000 Gres=gpu:2 State=UNKNOWN
PartitionName=gpu Nodes=%[1]s Default=YES MaxTime=04:00:00 State=UP OverSubscribe=FORCE:16 PriorityTier=1 PreemptMode=OFF
PartitionName=short Nodes=%[1]s MaxTime=00:30:00 State=UP OverSubscribe=FORCE:16 PriorityTier=1 PreemptMode=OFF
PartitionName=scavenger Nodes=%[1]s MaxTime=04:00:00 State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=%[5]d
PartitionName=requeue Nodes=%[1]s MaxTime=04:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=%[5]d
PartitionName=urgent Nodes=%[1]s MaxTime=04:00:00 State=UP PriorityTier=10 PreemptMode=OFF
`, s.Node, ports[0], ports[1], s.Dir, int(PreemptGrace/time.Second), accountingConf(s.Node, ports[3]))
	if err := os.WriteFile(s.Conf, []byte(conf), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(s.Dir, "gres.conf"), []byte("AutoDetect=off\nName=gpu File=/dev/fakegpu[0-1]\n"), 0o644); err != nil {
		return err
	}
	os.Setenv("SLURM_CONF", s.Conf) // for this process's commands and every manager it starts
	if err := s.startAccounting(ports[2], ports[3]); err != nil {
		return err
	}
	for _, daemon := range []string{"slurmctld", "slurmd"} {
		if err := s.daemon(daemon, "-D", "-f", s.Conf); err != nil {
			return err
		}
	}
	if err := s.waitIdle(); err != nil {
		return err
	}
	if err := s.makeUser(); err != nil {
		return err
	}
	if err := makeRunAs(); err != nil {
		return err
	}
	return s.addAssociations()
}

// RunAsAccounts are the local accounts of the run_as tests; the Slurm
// user may act as them, and as no one else, through sudo.
var RunAsAccounts = []string{"runfleet-j1", "runfleet-j2"}

// makeRunAs makes the run_as accounts and the sudo rule the docs give
// (docs/providers/slurm.md): the manager's user may run commands as them,
// through env, without a password.
func makeRunAs() error {
	if _, err := exec.LookPath("sudo"); err != nil {
		return fmt.Errorf("sudo not found (make deps installs it): %w", err)
	}
	for _, a := range RunAsAccounts {
		if _, err := user.Lookup(a); err == nil {
			continue
		}
		if out, err := exec.Command("useradd", "--no-create-home", "--shell", "/bin/sh", a).CombinedOutput(); err != nil {
			return fmt.Errorf("useradd %s: %v: %s", a, err, out)
		}
	}
	rule := fmt.Sprintf("%s ALL=(%s) NOPASSWD: /usr/bin/env\n", SlurmUser, strings.Join(RunAsAccounts, ","))
	return os.WriteFile("/etc/sudoers.d/runfleet-e2e", []byte(rule), 0o440)
}

// unix1x3 is /dev/null's device number.
func unix1x3() uint64 { return 1<<8 | 3 }

func startMunge() error {
	if _, err := os.Stat("/run/munge/munge.socket.2"); err == nil {
		if exec.Command("munge", "-n").Run() == nil {
			return nil
		}
	}
	if err := os.MkdirAll("/run/munge", 0o755); err != nil {
		return err
	}
	if out, err := exec.Command("chown", "munge:munge", "/run/munge").CombinedOutput(); err != nil {
		return fmt.Errorf("chown /run/munge: %v: %s", err, out)
	}
	if _, err := os.Stat("/etc/munge/munge.key"); err != nil {
		if out, err := exec.Command("runuser", "-u", "munge", "--", "mungekey", "--create").CombinedOutput(); err != nil {
			return fmt.Errorf("mungekey: %v: %s", err, out)
		}
	}
	if out, err := exec.Command("runuser", "-u", "munge", "--", "munged", "--force").CombinedOutput(); err != nil {
		return fmt.Errorf("munged: %v: %s", err, out)
	}
	return nil
}

// waitIdle waits for the node to take jobs, resuming it if an earlier
// run left it down.
func (s *SlurmCluster) waitIdle() error {
	deadline := time.Now().Add(time.Minute)
	for {
		out, _ := exec.Command("sinfo", "-h", "-n", s.Node, "-o", "%t").Output()
		state := strings.TrimSpace(string(out))
		switch {
		case state == "idle" || state == "mix" || state == "alloc":
			return nil
		case strings.HasPrefix(state, "down") || strings.HasPrefix(state, "drain"):
			_ = exec.Command("scontrol", "update", "nodename="+s.Node, "state=resume").Run()
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(s.Dir, "log", "slurmd.log"))
			return fmt.Errorf("slurm node %s not idle within a minute (state %q); slurmd log:\n%s", s.Node, state, tail(log, 2000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// makeUser makes the ordinary user the managers run as, and copies the
// binaries where it can run them.
func (s *SlurmCluster) makeUser() error {
	if _, err := user.Lookup(SlurmUser); err != nil {
		if out, err := exec.Command("useradd", "--create-home", "--shell", "/bin/sh", SlurmUser).CombinedOutput(); err != nil {
			return fmt.Errorf("useradd: %v: %s", err, out)
		}
	}
	u, err := user.Lookup(SlurmUser)
	if err != nil {
		return err
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	s.User, s.home, s.cred = u.Username, u.HomeDir, &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	for _, c := range [][2]string{{FleetBin, "runfleet"}, {runnerBin, "gitea-runner"}} {
		if err := copyFile(c[0], filepath.Join(s.Bin, c[1]), 0o755); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(from, to string, mode os.FileMode) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// Stop ends the daemons and removes the cluster's directory (munge,
// shared with the host, stays).
func (s *SlurmCluster) Stop() {
	if s == nil {
		return
	}
	for _, c := range s.cmds {
		_ = syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
		_ = c.Wait()
	}
	// What a failed test's jobs left: their processes are the user's.
	if s.User != "" {
		_ = exec.Command("pkill", "-KILL", "-u", s.User).Run()
		for _, a := range RunAsAccounts {
			_ = exec.Command("pkill", "-KILL", "-u", a).Run()
		}
	}
	_ = os.RemoveAll(s.Dir)
}

func stopSlurm() {
	if Slurm != nil {
		Slurm.Stop()
	}
}

// Jobs reads the cluster's queue.
func (s *SlurmCluster) Jobs(t testing.TB) []slurm.Job {
	t.Helper()
	out, err := exec.Command("squeue", "--json").Output()
	if err != nil {
		t.Fatalf("squeue --json: %v", err)
	}
	jobs, err := slurm.ParseQueue(out)
	if err != nil {
		t.Fatal(err)
	}
	return jobs
}

// asUser makes a fleet's manager run as the cluster's ordinary user: its
// directory becomes the user's, and the binaries are the user's copies.
func (f *Fleet) asSlurmUser() {
	s := Slurm
	f.cred, f.bin = s.cred, filepath.Join(s.Bin, "runfleet")
	f.Env = append(f.Env, "HOME="+s.home, "USER="+s.User, "LOGNAME="+s.User, "SLURM_CONF="+s.Conf)
	// The test's temporary directories are root's: the user may pass.
	for d := filepath.Dir(f.Dir); d != os.TempDir() && d != "/" && d != "."; d = filepath.Dir(d) {
		_ = os.Chmod(d, 0o711)
	}
	_ = filepath.Walk(f.Dir, func(p string, _ os.FileInfo, err error) error {
		if err == nil {
			err = os.Lchown(p, int(s.cred.Uid), int(s.cred.Gid))
		}
		return err
	})
}

// SlurmSection is a pool's slurm section (each line indented by six
// spaces) in a fleet's config.
func SlurmSection(extra string) string {
	if !strings.Contains(extra, "poll_interval:") {
		extra = "      poll_interval: 1s\n" + extra
	}
	return "    provider: slurm\n    slurm:\n" + extra
}

// SlurmJobs are the live (pending or running) jobs of this fleet's
// manager.
func (f *Fleet) SlurmJobs() []slurm.Job { return JobsOf(f.T, "e2e-"+f.Repo) }

// JobsOf are the live (pending or running) jobs of a manager.
func JobsOf(t testing.TB, manager string) []slurm.Job {
	var out []slurm.Job
	for _, j := range Slurm.Jobs(t) {
		if strings.Contains(j.Comment, "manager="+manager+" ") && !slurmEnded(j.State) {
			out = append(out, j)
		}
	}
	return out
}

func slurmEnded(state string) bool {
	switch state {
	case "PENDING", "RUNNING", "CONFIGURING", "SUSPENDED", "REQUEUED", "COMPLETING":
		return false
	}
	return true
}

// SlurmLeavesNothing checks that no job of the fleet's manager is queued
// or running, and that no record, file or credential is left in its spool.
func (f *Fleet) SlurmLeavesNothing() {
	f.T.Helper()
	Eventually(f.T, 30*time.Second, "no live Slurm job of the manager", func() bool { return len(f.SlurmJobs()) == 0 })
	for _, sub := range []string{"runners", "files"} {
		matches, _ := filepath.Glob(filepath.Join(f.State, "slurm", "*", sub, "*"))
		if len(matches) != 0 {
			f.T.Errorf("left in the Slurm spool: %v", matches)
		}
	}
}

// cancelSlurmJobs cancels, as root, the Slurm jobs a failed test's manager
// left: one left pending for GPUs held the next tests' jobs back (seen in
// CI: TestSlurmGPUPool's runners pending behind a preemption test's).
func (f *Fleet) cancelSlurmJobs() {
	var ids []string
	for _, j := range f.SlurmJobs() {
		ids = append(ids, j.ID)
	}
	if len(ids) > 0 {
		_ = exec.Command("scancel", ids...).Run()
	}
}

// SlurmSecrets collects, while a test runs, the runners' credentials from
// the spool (the .runner files before their jobs start) and what Slurm
// shows of each of the fleet's jobs (scontrol show job, the batch
// script), so that CheckSlurmSecrets can look for them.
type SlurmSecrets struct {
	mu      sync.Mutex
	creds   map[string]bool
	shown   map[string][]byte // by job id
	stop    chan struct{}
	stopped chan struct{}
}

func (f *Fleet) WatchSlurmSecrets() *SlurmSecrets {
	w := &SlurmSecrets{creds: map[string]bool{}, shown: map[string][]byte{}, stop: make(chan struct{}), stopped: make(chan struct{})}
	go func() {
		defer close(w.stopped)
		for {
			w.sample(f)
			select {
			case <-w.stop:
				return
			case <-time.After(150 * time.Millisecond):
			}
		}
	}()
	return w
}

func (w *SlurmSecrets) sample(f *Fleet) {
	files, _ := filepath.Glob(filepath.Join(f.State, "slurm", "*", "files", "*", "files", ".runner"))
	for _, p := range files {
		var reg struct {
			Token string `json:"token"`
		}
		if b, err := os.ReadFile(p); err == nil && json.Unmarshal(b, &reg) == nil && reg.Token != "" {
			w.mu.Lock()
			w.creds[reg.Token] = true
			w.mu.Unlock()
		}
	}
	out, _ := exec.Command("squeue", "--json").Output()
	jobs, _ := slurm.ParseQueue(out)
	for _, j := range jobs {
		if !strings.Contains(j.Comment, "manager=e2e-"+f.Repo+" ") {
			continue
		}
		w.mu.Lock()
		_, seen := w.shown[j.ID]
		w.mu.Unlock()
		if seen {
			continue
		}
		show, _ := exec.Command("scontrol", "show", "job", "-dd", j.ID).CombinedOutput()
		script, _ := exec.Command("scontrol", "write", "batch_script", j.ID, "-").CombinedOutput()
		w.mu.Lock()
		w.shown[j.ID] = append(show, script...)
		w.mu.Unlock()
	}
}

// Check stops the watch and looks for the forge's token and every
// runner's credential in what Slurm showed of the jobs, in Slurm's own
// state and logs (the jobs' scripts and environments), in the manager's
// logs and state and in the agents' output.
func (w *SlurmSecrets) Check(f *Fleet) {
	f.T.Helper()
	close(w.stop)
	<-w.stopped
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.creds) == 0 || len(w.shown) == 0 {
		f.T.Fatalf("the watch saw %d credentials and %d jobs: no test of secrets", len(w.creds), len(w.shown))
	}
	secrets := map[string]string{Gitea.Token: "the Gitea token"}
	for c := range w.creds {
		secrets[c] = "a runner's credential"
	}
	look := func(where string, b []byte) {
		for s, what := range secrets {
			if bytes.Contains(b, []byte(s)) {
				f.T.Errorf("%s is in %s", what, where)
			}
		}
	}
	for id, b := range w.shown {
		look("scontrol's view of job "+id, b)
	}
	for _, root := range []string{Slurm.Dir, f.Dir} {
		_ = filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
			if err != nil || info.IsDir() || p == f.Config || strings.HasPrefix(p, Slurm.Bin) || !info.Mode().IsRegular() {
				return nil
			}
			b, _ := os.ReadFile(p)
			look(p, b)
			return nil
		})
	}
	f.T.Logf("no secret in scontrol's view of %d jobs, Slurm's state and logs, or the manager's (%d credentials looked for)", len(w.shown), len(w.creds))
}

// Scancel cancels a job as someone on the cluster would.
func Scancel(t testing.TB, id string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "scancel", id).CombinedOutput(); err != nil {
		t.Fatalf("scancel %s: %v: %s", id, err, out)
	}
}

// FreezeController stops slurmctld with SIGSTOP (it accepts connections
// and answers nothing) until the returned function continues it.
func (s *SlurmCluster) FreezeController(t testing.TB) (thaw func()) {
	t.Helper()
	pid := s.proc("slurmctld").Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	thaw = func() { once.Do(func() { _ = syscall.Kill(pid, syscall.SIGCONT) }) }
	t.Cleanup(thaw)
	return thaw
}

// proc is the cluster's daemon of that name.
func (s *SlurmCluster) proc(name string) *exec.Cmd {
	for _, c := range slices.Backward(s.cmds) {
		if filepath.Base(c.Path) == name {
			return c
		}
	}
	panic("no " + name + " in the test cluster")
}

// CrashNode is the node's crash: slurmd and every process of the jobs on
// it killed at once with SIGKILL (so that no job's trap runs), then the
// node set DOWN as an admin would, which ends its jobs NODE_FAIL
// (scontrol(1): State=DOWN). The returned function brings the node back.
func (s *SlurmCluster) CrashNode(t testing.TB) (back func()) {
	t.Helper()
	// The step daemons first: one that outlived its job's processes
	// would tell slurmctld that the job FAILED.
	_ = exec.Command("pkill", "-KILL", "slurmstepd").Run()
	d := s.proc("slurmd")
	_ = syscall.Kill(-d.Process.Pid, syscall.SIGKILL)
	_ = d.Wait()
	for _, u := range append([]string{s.User}, RunAsAccounts...) {
		_ = exec.Command("pkill", "-KILL", "-u", u).Run()
	}
	Scontrol(t, "update", "NodeName="+s.Node, "State=DOWN", "Reason=runfleet-e2e-crash")
	var once sync.Once
	back = func() {
		once.Do(func() {
			if err := s.daemon("slurmd", "-D", "-f", s.Conf); err != nil {
				t.Error(err)
				return
			}
			_ = exec.Command("scontrol", "update", "NodeName="+s.Node, "State=RESUME").Run()
			if err := s.waitIdle(); err != nil {
				t.Error(err)
			}
		})
	}
	t.Cleanup(back)
	return back
}

// Exited says whether the fleet's manager has ended.
func (f *Fleet) Exited() bool {
	select {
	case <-f.exited:
		return true
	default:
		return false
	}
}

// Sbatch submits a job as root, as another user of the cluster would (a
// higher-priority job that preempts, foreign jobs in the queue), and
// returns its id.
func Sbatch(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "sbatch", append([]string{"--parsable", "--output=/dev/null"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("sbatch %v: %v: %s", args, err, out)
	}
	id, _, _ := strings.Cut(strings.TrimSpace(string(out)), ";")
	t.Cleanup(func() { _ = exec.Command("scancel", id).Run() })
	return id
}

// Scontrol runs scontrol as root (an admin's update of a job).
func Scontrol(t testing.TB, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "scontrol", args...).CombinedOutput(); err != nil {
		t.Fatalf("scontrol %v: %v: %s", args, err, out)
	}
}

// SlurmJob reads one field of a job with squeue's format (%l: its time
// limit), in any state, "" once the job has left the queue.
func SlurmJob(t testing.TB, id, format string) string {
	t.Helper()
	out, _ := exec.Command("squeue", "-h", "-t", "all", "-j", id, "-o", format).Output()
	return strings.TrimSpace(string(out))
}
