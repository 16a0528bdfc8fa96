// Package process is the host-process provider: each runner is a process on
// this host, in its own fresh working directory and process group.
//
// Runner processes outlive the manager: they are not tied to it by pipes or
// a parent-death signal, and each is recorded (pid, kernel start time,
// working directory) in a file under the state directory. A restarted
// manager reads the records and adopts the processes that still run, telling
// a live runner from a recycled pid by the kernel's start time.
package process

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/sysinfo"
)

// Options configures a Provider.
type Options struct {
	// StateDir holds the records (StateDir/process) and the agents' logs
	// (StateDir/logs).
	StateDir string
	// WorkRoot is the parent of the runners' working directories.
	WorkRoot string
	// ReadOnly: only List and Output are used; nothing is written.
	ReadOnly bool
	// StopTimeout is how long Delete waits after SIGTERM before SIGKILL.
	StopTimeout time.Duration
	// KeepLogs is how many agent logs are kept; older ones are removed.
	KeepLogs int
	Logger   *slog.Logger
}

// Provider runs runners as host processes.
type Provider struct {
	opt Options
	log *slog.Logger

	mu       sync.Mutex
	watched  map[string]record // by name: processes whose exit is being watched
	creating map[string]bool   // by name: Create calls under way
	watchers []func(string)
}

// record is what is kept on disk per runner.
type record struct {
	Name    string    `json:"name"`
	Manager string    `json:"manager"`
	Pool    string    `json:"pool"`
	PID     int       `json:"pid"`
	Start   uint64    `json:"start_ticks"` // /proc/<pid>/stat field 22
	Workdir string    `json:"workdir"`
	Log     string    `json:"log"` // the agent's output: logPath of Name and Created
	Created time.Time `json:"created"`
	GPUs    []string  `json:"gpus,omitempty"`
}

// New returns a provider. It creates its directories.
func New(opt Options) (*Provider, error) {
	if opt.StateDir == "" || opt.WorkRoot == "" {
		return nil, errors.New("process provider: state and work directories are required")
	}
	if opt.StopTimeout == 0 {
		opt.StopTimeout = 10 * time.Second
	}
	if opt.KeepLogs == 0 {
		opt.KeepLogs = 200
	}
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	p := &Provider{opt: opt, log: opt.Logger, watched: map[string]record{}, creating: map[string]bool{}}
	for _, d := range []string{p.recordDir(), p.logDir(), opt.WorkRoot} {
		if opt.ReadOnly {
			break
		}
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("process provider: %w", err)
		}
	}
	return p, nil
}

func (p *Provider) recordDir() string { return filepath.Join(p.opt.StateDir, "process") }
func (p *Provider) logDir() string    { return filepath.Join(p.opt.StateDir, "logs") }
func (p *Provider) recordPath(name string) string {
	return filepath.Join(p.recordDir(), name+".json")
}

// Create starts the agent in a fresh working directory. If a live runner
// of that name exists, it is returned instead.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if err := ctx.Err(); err != nil {
		return provider.Instance{}, err
	}
	if spec.Name == "" || strings.ContainsAny(spec.Name, "/\\") || spec.Name[0] == '.' {
		return provider.Instance{}, fmt.Errorf("create runner: invalid name %q", spec.Name)
	}
	defer p.markCreating(spec.Name)()
	if rec, err := p.readRecord(spec.Name); err == nil {
		if alive(rec) {
			return instance(rec, provider.StateRunning), nil
		}
		// A dead runner of the same name: clear it before reusing the name.
		if err := p.Delete(ctx, spec.Name); err != nil {
			return provider.Instance{}, err
		}
	}

	workdir := filepath.Join(p.opt.WorkRoot, spec.Name+"."+strconv.FormatUint(rand.Uint64(), 36))
	rec := record{
		Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool, Workdir: workdir,
		Created: time.Now().UTC(),
		GPUs:    slices.Clone(spec.GPUs),
	}
	rec.Log = p.logPath(rec.Name, rec.Created)
	// The record is written before the working directory is made and the
	// process started (pid 0), so that a crash at any point leaves a
	// trace to clean up: a record without a pid is matched to its process
	// by working directory, and names the directory to remove.
	err := p.writeRecord(rec)
	if err == nil {
		err = os.Mkdir(workdir, 0o700)
	}
	if err == nil {
		rec, err = p.start(spec, rec)
	}
	if err != nil {
		_ = os.RemoveAll(workdir)
		_ = os.Remove(p.recordPath(spec.Name))
		return provider.Instance{}, fmt.Errorf("create runner %s: %w", spec.Name, err)
	}
	provider.PruneFiles(p.logDir(), p.opt.KeepLogs)
	return instance(rec, provider.StateRunning), nil
}

// markCreating notes a Create under way, and returns what ends it: a List
// meanwhile must not take the pid-less record for one a crashed manager
// left, and look for (and rewrite) its process.
func (p *Provider) markCreating(name string) (done func()) {
	p.mu.Lock()
	p.creating[name] = true
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		delete(p.creating, name)
		p.mu.Unlock()
	}
}

// start writes the runner's files into its working directory and starts
// its agent, recording and watching the process.
func (p *Provider) start(spec provider.Spec, rec record) (record, error) {
	if spec.Record != nil {
		spec.Record.Machine.Host = provider.Hostname()
		sys := sysinfo.Local()
		spec.Record.System = &sys
	}
	spec = spec.WithRecord(rec.Workdir)
	for rel, data := range spec.Files {
		path := filepath.Join(rec.Workdir, filepath.Clean("/"+rel))
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return rec, err
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return rec, err
		}
	}
	tmp := filepath.Join(rec.Workdir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return rec, err
	}
	logf, err := os.OpenFile(rec.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return rec, err
	}
	defer logf.Close()
	cmd := exec.Command(spec.Command, spec.Args...)
	cmd.Dir = rec.Workdir
	cmd.Env = envList(agentEnv(spec, rec.Workdir, tmp))
	// Output goes to a file, not through the manager, so the agent is
	// unharmed when the manager dies.
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group: Delete stops the agent and every process
	// its job started, and the manager's signals do not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return rec, err
	}
	rec.PID = cmd.Process.Pid
	if st, err := startTicks(rec.PID); err == nil {
		rec.Start = st
	}
	// Watched before the record names the pid, so that a List in between
	// does not adopt this child as if a previous manager had started it.
	p.mu.Lock()
	p.watched[rec.Name] = rec
	p.mu.Unlock()
	if err := p.writeRecord(rec); err != nil {
		_ = unix.Kill(-rec.PID, unix.SIGKILL)
		_ = cmd.Wait()
		p.mu.Lock()
		delete(p.watched, rec.Name)
		p.mu.Unlock()
		return rec, err
	}
	go func() {
		_ = cmd.Wait()
		p.exited(rec)
	}()
	return rec, nil
}

// agentEnv is the agent's whole environment: the spec's, a home and a
// temporary directory of its own, and its GPUs.
func agentEnv(spec provider.Spec, workdir, tmp string) map[string]string {
	env := map[string]string{"HOME": workdir, "TMPDIR": tmp}
	for k, v := range spec.Env {
		env[k] = v
	}
	if len(spec.GPUs) > 0 {
		// By UUID, never by index: CUDA's default order is not NVML's.
		// NVIDIA_VISIBLE_DEVICES is for the containers a job starts
		// with NVIDIA's runtime.
		ids := strings.Join(spec.GPUs, ",")
		env["CUDA_VISIBLE_DEVICES"], env["NVIDIA_VISIBLE_DEVICES"] = ids, ids
		env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
	}
	return env
}

// exited runs once a watched process has ended: the job's leftover
// processes in its group are killed, and watchers are told.
func (p *Provider) exited(rec record) {
	_ = unix.Kill(-rec.PID, unix.SIGKILL)
	p.mu.Lock()
	fns := slices.Clone(p.watchers)
	p.mu.Unlock()
	for _, fn := range fns {
		fn(rec.Name)
	}
}

// Watch calls changed with a runner's name when its process exits.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) {
	p.mu.Lock()
	p.watchers = append(p.watchers, changed)
	i := len(p.watchers) - 1
	p.mu.Unlock()
	go func() {
		<-ctx.Done()
		p.mu.Lock()
		p.watchers[i] = func(string) {}
		p.mu.Unlock()
	}()
}

// List returns the manager's runners, adopting live ones that this
// process did not start (after a manager restart).
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	entries, err := os.ReadDir(p.recordDir())
	if errors.Is(err, fs.ErrNotExist) && p.opt.ReadOnly {
		return nil, nil // no runner ever started here
	}
	if err != nil {
		return nil, fmt.Errorf("list runners: %w", err)
	}
	var out []provider.Instance
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			if !p.opt.ReadOnly {
				p.removeStaleTemp(e)
			}
			continue
		}
		rec, err := p.readRecord(name)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since the listing: its runner just ended
		}
		if err != nil {
			p.log.Warn("unreadable runner record", "file", e.Name(), "err", err)
			continue
		}
		if rec.Manager != manager {
			continue
		}
		p.mu.Lock()
		starting := p.creating[name]
		p.mu.Unlock()
		if starting {
			out = append(out, instance(rec, provider.StateRunning))
			continue
		}
		if rec.PID == 0 {
			// The manager stopped between writing the record and
			// starting the process: find the process, if it started.
			if pid, st, ok := findByCwd(rec.Workdir); ok {
				rec.PID, rec.Start = pid, st
				if !p.opt.ReadOnly {
					_ = p.writeRecord(rec)
				}
			}
		}
		state := provider.StateExited
		if alive(rec) {
			state = provider.StateRunning
			p.adopt(rec)
		}
		out = append(out, instance(rec, state))
	}
	return out, nil
}

// adopt watches a live process this manager did not start, through a
// pidfd, which reports the exit of any process, not only a child.
func (p *Provider) adopt(rec record) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w, ok := p.watched[rec.Name]; ok && w.PID == rec.PID {
		return
	}
	p.watched[rec.Name] = rec
	go func() {
		waitExit(rec)
		p.exited(rec)
	}()
}

// waitExit blocks until the recorded process has ended.
func waitExit(rec record) {
	fd, err := unix.PidfdOpen(rec.PID, 0)
	if err == nil {
		defer unix.Close(fd)
		// The pid could have been recycled between the liveness check
		// and the open: check again now that the pidfd pins it.
		if alive(rec) {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			for {
				_, err := unix.Poll(fds, -1)
				if err != unix.EINTR {
					break
				}
			}
		}
		return
	}
	// No pidfd (kernel before 5.3): poll.
	for alive(rec) {
		time.Sleep(250 * time.Millisecond)
	}
}

// Delete stops a runner's process group and removes its working directory
// and record.
func (p *Provider) Delete(ctx context.Context, name string) error {
	rec, err := p.readRecord(name)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	if rec.PID == 0 {
		if pid, st, ok := findByCwd(rec.Workdir); ok {
			rec.PID, rec.Start = pid, st
		}
	}
	if rec.PID != 0 && alive(rec) {
		if err := p.stop(ctx, rec); err != nil {
			return fmt.Errorf("delete runner %s: %w", name, err)
		}
	}
	if err := removeWorkdir(rec.Workdir, p.opt.WorkRoot); err != nil {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	if err := os.Remove(p.recordPath(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	p.mu.Lock()
	if w, ok := p.watched[name]; ok && w.PID == rec.PID {
		delete(p.watched, name)
	}
	p.mu.Unlock()
	return nil
}

// stop sends SIGTERM to the group, then SIGKILL after StopTimeout.
func (p *Provider) stop(ctx context.Context, rec record) error {
	_ = unix.Kill(-rec.PID, unix.SIGTERM)
	deadline := time.NewTimer(p.opt.StopTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for alive(rec) {
		select {
		case <-ctx.Done():
			_ = unix.Kill(-rec.PID, unix.SIGKILL)
			return ctx.Err()
		case <-deadline.C:
			_ = unix.Kill(-rec.PID, unix.SIGKILL)
		case <-tick.C:
		}
	}
	// Whatever the job left in the group goes too.
	_ = unix.Kill(-rec.PID, unix.SIGKILL)
	return nil
}

// removeWorkdir removes a runner's working directory, refusing anything
// outside the work root so that a damaged record cannot remove more.
func removeWorkdir(dir, root string) error {
	if dir == "" {
		return nil
	}
	rel, err := filepath.Rel(root, dir)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") || strings.ContainsRune(rel, filepath.Separator) {
		return fmt.Errorf("refusing to remove %q: not a runner directory under %q", dir, root)
	}
	// Jobs may leave read-only trees (Go's module cache does): make
	// them writable so they can be removed.
	_ = filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			_ = os.Chmod(path, 0o700)
		}
		return nil
	})
	return os.RemoveAll(dir)
}

func (p *Provider) readRecord(name string) (record, error) {
	var rec record
	b, err := os.ReadFile(p.recordPath(name))
	if err != nil {
		return rec, err
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return rec, fmt.Errorf("record %s: %w", name, err)
	}
	return rec, nil
}

// writeRecord replaces the record atomically. Each write has its own
// temporary file, so that two writers of one record cannot rename each
// other's away.
func (p *Provider) writeRecord(rec record) error {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(p.recordDir(), rec.Name+".json.*"+tempSuffix)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), p.recordPath(rec.Name))
	}
	if err != nil {
		_ = os.Remove(f.Name())
	}
	return err
}

const tempSuffix = ".tmp"

// removeStaleTemp removes a temporary record file that a manager killed
// mid-write left behind; a recent one may still be in use.
func (p *Provider) removeStaleTemp(e os.DirEntry) {
	if !strings.HasSuffix(e.Name(), tempSuffix) {
		return
	}
	if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Minute {
		_ = os.Remove(filepath.Join(p.recordDir(), e.Name()))
	}
}

func instance(rec record, st provider.State) provider.Instance {
	return provider.Instance{
		Name: rec.Name, Manager: rec.Manager, Pool: rec.Pool, State: st,
		Created: rec.Created, ID: strconv.Itoa(rec.PID), GPUs: rec.GPUs,
	}
}

func envList(env map[string]string) []string {
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

// alive reports whether the recorded process still runs: the pid exists,
// is not a zombie, and started when the record says.
func alive(rec record) bool {
	if rec.PID <= 0 {
		return false
	}
	st, state, err := procStat(rec.PID)
	if err != nil || state == 'Z' || state == 'X' {
		return false
	}
	return rec.Start == 0 || st == rec.Start
}

func startTicks(pid int) (uint64, error) {
	st, _, err := procStat(pid)
	return st, err
}

// procStat reads a process's state and start time from /proc/<pid>/stat.
func procStat(pid int) (start uint64, state byte, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The command name (field 2) may hold spaces and parentheses: the
	// fields after it start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	fields := strings.Fields(string(b[i+1:]))
	// fields[0] is field 3 (state); start time is field 22.
	if len(fields) < 20 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	start, err = strconv.ParseUint(fields[19], 10, 64)
	return start, fields[0][0], err
}

// findByCwd finds the process group leader whose working directory is dir.
func findByCwd(dir string) (pid int, start uint64, ok bool) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, 0, false
	}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", n))
		if err != nil || cwd != dir {
			continue
		}
		if pgid, err := unix.Getpgid(n); err != nil || pgid != n {
			continue
		}
		if st, err := startTicks(n); err == nil {
			return n, st, true
		}
	}
	return 0, 0, false
}
