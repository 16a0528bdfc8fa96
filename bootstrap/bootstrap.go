// Package bootstrap is the instance side of a cloud runner: on a machine
// that a cloud provider started for one runner, it writes the runner's
// files, starts the forge's agent, watches the cloud's metadata service
// for notices that the machine is being taken back, and powers the
// machine off when the agent ends, when no job came within the idle
// timeout, or at the runner's deadline. The deadline holds also when the
// manager is gone: a machine never outlives it.
//
// `runfleet agent --plan FILE` runs it; the provider writes the plan into
// the instance's user data.
package bootstrap

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Plan is what one runner's machine needs, and nothing more: the agent's
// command, its environment and files (which hold the runner's single-use
// credential), and when to give up. A plan with a Handoff carries no
// Assignment: the machine fetches it once, at its start, from where the
// Handoff says (a cloud's secret store), so that nothing secret is in its
// boot data.
type Plan struct {
	Assignment
	// Handoff says where the Assignment waits; nil: it is in the plan.
	Handoff *Handoff `json:"handoff,omitempty"`
	// Workdir is the agent's fresh working directory, made 0700.
	Workdir string `json:"workdir"`
	// IdleTimeout powers the machine off when no job came within it of
	// the agent's start; 0: never.
	IdleTimeout time.Duration `json:"idle_timeout,omitempty"`
	// Deadline is when the machine powers off whatever it runs.
	Deadline time.Time `json:"deadline"`
	// Poweroff is the command that ends the machine (with the instance's
	// shutdown behaviour set to terminate).
	Poweroff []string `json:"poweroff"`
	// Notices names the cloud whose metadata service tells of
	// interruptions (RegisterNotices); empty: none is watched.
	Notices string `json:"notices,omitempty"`
}

// registry is what the provider packages register by name, opened for
// the plans that name it.
type registry[T any] struct {
	mu   sync.Mutex
	open map[string]func() T
}

func (r *registry[T]) add(name string, open func() T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open == nil {
		r.open = map[string]func() T{}
	}
	r.open[name] = open
}

func (r *registry[T]) get(name string) (T, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	open, ok := r.open[name]
	if !ok {
		var zero T
		return zero, false
	}
	return open(), true
}

var notices registry[Notices]

// RegisterNotices makes a cloud's metadata service available to plans
// that name it. A provider package registers its own in init.
func RegisterNotices(cloud string, open func() Notices) { notices.add(cloud, open) }

// NoticesFor opens the metadata service a plan names.
func NoticesFor(p Plan) (Notices, error) {
	if p.Notices == "" {
		return nil, nil
	}
	n, ok := notices.get(p.Notices)
	if !ok {
		return nil, fmt.Errorf("plan: notices: %q is not a cloud of this build", p.Notices)
	}
	return n, nil
}

// Read reads a plan file and checks it.
func Read(path string) (Plan, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Plan{}, fmt.Errorf("plan: %w", err)
	}
	var p Plan
	if err := json.Unmarshal(b, &p); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", path, err)
	}
	var errs []error
	if p.Handoff == nil && p.Command == "" {
		errs = append(errs, errors.New("command: is empty"))
	}
	if h := p.Handoff; h != nil && (h.Source == "" || p.Command != "") {
		errs = append(errs, errors.New("handoff: a plan with a handoff names its source and holds no assignment"))
	}
	if p.Workdir == "" || !filepath.IsAbs(p.Workdir) {
		errs = append(errs, fmt.Errorf("workdir: %q is not an absolute path", p.Workdir))
	}
	if p.Deadline.IsZero() {
		errs = append(errs, errors.New("deadline: is not set"))
	}
	if len(p.Poweroff) == 0 {
		errs = append(errs, errors.New("poweroff: is empty"))
	}
	if err := errors.Join(errs...); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", path, err)
	}
	return p, nil
}

// Notices is a cloud's metadata service, asked whether the machine is
// being taken back.
type Notices interface {
	// Interruption returns when the machine will be taken back, and
	// whether it will be at all.
	Interruption(ctx context.Context) (at time.Time, ok bool, err error)
	// Rebalance says whether the cloud recommends moving work off the
	// machine (a higher risk of interruption).
	Rebalance(ctx context.Context) (bool, error)
}

// Watcher is a Notices whose metadata service holds a request until an
// answer changes (Compute Engine's wait_for_change): WatchInterruption
// returns as the machine is being taken back, with when, rather than at
// the next poll, so that the job is stopped within the notice.
type Watcher interface {
	Notices
	WatchInterruption(ctx context.Context) (at time.Time, err error)
}

// Paced is a Notices whose cloud says how often to ask it and how long an
// answer may take (Azure's Scheduled Events: every second, and up to two
// minutes for the first call, which enables the service for the VM). Its
// first answer is waited for before the agent starts: a notice that came
// while the service was being enabled would be missed, with the job the
// agent took meanwhile.
type Paced interface {
	Notices
	Pace() (interval, timeout time.Duration)
}

// Releaser is a Notices that can let the cloud take the machine back
// before the notice's time (Azure's Scheduled Events are approved so):
// asked once the agent has stopped after an interruption notice.
type Releaser interface {
	Notices
	Release(ctx context.Context) error
}

// Options tune Run; the zero value is what a machine uses.
type Options struct {
	Notices Notices // nil: no notices are watched
	// NoticeInterval is how often the metadata service is asked (5s, as
	// AWS advises for spot notices, or the cloud's own Pace), and how
	// long an answer may take (or the cloud's Pace).
	NoticeInterval time.Duration
	// Tick is how often the agent, the idle timeout and the deadline
	// are checked (1s).
	Tick time.Duration
	// HoldGrace is how long past an interruption notice's time the
	// machine waits for the cloud before it powers itself off (1m).
	HoldGrace time.Duration
	Output    io.Writer // where the agent's output goes (stdout: the console)
	Logger    *slog.Logger
	now       func() time.Time
}

// Why the machine powers off.
const (
	EndAgent        = "the agent ended"
	EndIdle         = "no job came within the idle timeout"
	EndDeadline     = "the runner's deadline passed"
	EndInterruption = "the machine is being taken back"
	EndRebalance    = "the cloud recommends moving off the machine, and no job runs on it"
)

// Run carries out a plan and powers the machine off at its end, whatever
// the end is. It returns why, once the power-off command has been run.
func Run(ctx context.Context, p Plan, o Options) (string, error) {
	o = o.defaults()
	var err error
	if p.Handoff != nil {
		p.Assignment, err = fetch(ctx, p, o)
	}
	why := ""
	if err == nil {
		why, err = run(ctx, p, o)
	}
	if err != nil {
		o.Logger.Error("runner failed", "runner", p.Runner, "err", err)
		why = "the runner failed: " + err.Error()
	}
	o.Logger.Info("powering off", "runner", p.Runner, "why", why)
	off := exec.Command(p.Poweroff[0], p.Poweroff[1:]...)
	off.Stdout, off.Stderr = o.Output, o.Output
	if perr := off.Run(); perr != nil {
		return why, fmt.Errorf("power off (%s): %w", strings.Join(p.Poweroff, " "), perr)
	}
	return why, nil
}

func (o Options) defaults() Options {
	if o.NoticeInterval <= 0 {
		o.NoticeInterval = 5 * time.Second
	}
	if o.Tick <= 0 {
		o.Tick = time.Second
	}
	if o.HoldGrace <= 0 {
		o.HoldGrace = time.Minute
	}
	if o.Output == nil {
		o.Output = os.Stdout
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.now == nil {
		o.now = time.Now
	}
	return o
}

// run starts the agent and watches it until one of the ends.
func run(ctx context.Context, p Plan, o Options) (string, error) {
	if err := writeFiles(p.Workdir, p.Files); err != nil {
		return "", err
	}
	if !o.now().Before(p.Deadline) {
		return EndDeadline, nil
	}
	if pc, ok := o.Notices.(Paced); ok {
		enable(ctx, p, o, pc)
	}
	cmd := exec.Command(p.Command, p.Args...)
	cmd.Dir = p.Workdir
	cmd.Env = environ(p.Env)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start %s: %w", p.Command, err)
	}
	var busy atomic.Bool
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		watchOutput(out, o.Output, []byte(p.BusyMarker), &busy)
	}()
	exited := make(chan error, 1)
	go func() { <-copied; exited <- cmd.Wait() }()
	o.Logger.Info("agent started", "runner", p.Runner, "pid", cmd.Process.Pid, "deadline", p.Deadline.Format(time.RFC3339))

	why, hold := watch(ctx, p, o, exited, &busy)
	switch why {
	case EndAgent:
	case EndInterruption:
		stop(cmd.Process.Pid, exited, interruptGrace)
	default:
		stop(cmd.Process.Pid, exited, stopGrace)
	}
	if !hold.IsZero() {
		// The cloud takes the machine at the notice's time. Until then
		// it stays up, so that the manager, which reads the notice
		// from the cloud's API, sees it and has the job re-run; then
		// it powers off if the cloud has not.
		o.Logger.Info("agent stopped; waiting for the cloud to take the machine back", "runner", p.Runner, "until", hold.Format(time.RFC3339))
		if r, ok := o.Notices.(Releaser); ok {
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := r.Release(rctx)
			cancel()
			if err != nil {
				o.Logger.Warn("metadata service: could not let the cloud go ahead", "err", err)
			}
		}
		if p.Deadline.Before(hold) {
			hold = p.Deadline
		}
		waitUntil(ctx, o, hold)
	}
	return why, nil
}

// enable asks a Paced metadata service once and waits for its answer, at
// most its pace's timeout; a failure is logged, and the agent starts all
// the same.
func enable(ctx context.Context, p Plan, o Options, pc Paced) {
	_, timeout := pc.Pace()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := o.now()
	if _, _, err := pc.Interruption(ctx); err != nil {
		o.Logger.Warn("metadata service: no answer before the agent starts; notices may come late", "runner", p.Runner, "err", err)
		return
	}
	o.Logger.Info("metadata service answered", "runner", p.Runner, "after", o.now().Sub(start).Round(time.Millisecond))
}

// waitUntil sleeps until t, or until ctx ends.
func waitUntil(ctx context.Context, o Options, t time.Time) {
	tick := time.NewTicker(o.Tick)
	defer tick.Stop()
	for o.now().Before(t) {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// watch waits for the end: the agent's exit, the deadline, the idle
// timeout, or a notice. After an interruption notice it also returns
// until when the machine stays up.
func watch(ctx context.Context, p Plan, o Options, exited <-chan error, busy *atomic.Bool) (string, time.Time) {
	start := o.now()
	tick := time.NewTicker(o.Tick)
	defer tick.Stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	noticed := make(chan ended, 2)
	if o.Notices != nil {
		go pollNotices(ctx, p, o, busy, noticed)
		if w, ok := o.Notices.(Watcher); ok {
			go watchInterruption(ctx, p, o, w, busy, noticed)
		}
	}
	for {
		select {
		case err := <-exited:
			o.Logger.Info("agent exited", "runner", p.Runner, "err", err)
			return EndAgent, time.Time{}
		case <-ctx.Done():
			return "stopped: " + context.Cause(ctx).Error(), time.Time{}
		case e := <-noticed:
			return e.why, e.hold
		case <-tick.C:
		}
		now := o.now()
		switch {
		case !now.Before(p.Deadline):
			return EndDeadline, time.Time{}
		case p.IdleTimeout > 0 && p.BusyMarker != "" && !busy.Load() && now.Sub(start) >= p.IdleTimeout:
			return EndIdle, time.Time{}
		}
	}
}

// ended is why a notice ends the runner, and until when the machine
// stays up after.
type ended struct {
	why  string
	hold time.Time
}

// pollNotices asks the metadata service at the cloud's pace, apart from
// the loop that watches the agent, so that a slow answer (Azure's first
// call takes up to two minutes) delays nothing else, until one ends the
// runner or ctx ends.
func pollNotices(ctx context.Context, p Plan, o Options, busy *atomic.Bool, noticed chan<- ended) {
	interval, timeout := o.NoticeInterval, o.NoticeInterval
	if pc, ok := o.Notices.(Paced); ok {
		interval, timeout = pc.Pace()
	}
	// First at the first tick, as the agent's output has been read.
	wait := o.Tick
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if why, hold := notice(ctx, p, o, busy.Load(), timeout); why != "" {
			noticed <- ended{why, hold}
			return
		}
		wait = interval
	}
}

// watchInterruption holds a request on the metadata service until the
// machine is being taken back; should the service fail, polling goes on.
func watchInterruption(ctx context.Context, p Plan, o Options, w Watcher, busy *atomic.Bool, noticed chan<- ended) {
	at, err := w.WatchInterruption(ctx)
	if err != nil {
		if ctx.Err() == nil {
			o.Logger.Warn("metadata service: watching for an interruption; polling instead", "err", err)
		}
		return
	}
	noticed <- interrupted(p, o, at, busy.Load())
}

// notice asks the metadata service. A machine being taken back stops its
// agent at once, job or not: the job cannot finish in the time a Spot
// machine gets, and an agent stopped cleanly tells the forge at once that
// its job failed, so that it is re-run on the replacement the manager
// starts, instead of when the forge gives up on a silent runner. A
// rebalance recommendation ends an idle machine only.
func notice(ctx context.Context, p Plan, o Options, busy bool, timeout time.Duration) (string, time.Time) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	at, ok, err := o.Notices.Interruption(ctx)
	if err != nil {
		o.Logger.Warn("metadata service: interruption notice", "err", err)
	} else if ok {
		e := interrupted(p, o, at, busy)
		return e.why, e.hold
	}
	re, err := o.Notices.Rebalance(ctx)
	if err != nil {
		o.Logger.Warn("metadata service: rebalance recommendation", "err", err)
	} else if re && !busy {
		return EndRebalance, time.Time{}
	}
	return "", time.Time{}
}

// interrupted is the end an interruption notice brings: the machine stays
// up until the notice's time and the grace.
func interrupted(p Plan, o Options, at time.Time, busy bool) ended {
	o.Logger.Warn("interruption notice: the machine is being taken back", "runner", p.Runner, "at", at.Format(time.RFC3339), "busy", busy)
	if at.IsZero() {
		at = o.now().Add(2 * time.Minute)
	}
	return ended{EndInterruption, at.Add(o.HoldGrace)}
}

// watchOutput copies the agent's output and notes when it says that it
// took a job.
func watchOutput(r io.Reader, w io.Writer, marker []byte, busy *atomic.Bool) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(marker) > 0 && bytes.Contains(line, marker) {
			busy.Store(true)
		}
		_, _ = w.Write(append(line, '\n'))
	}
	_, _ = io.Copy(w, r) // a line too long for the scanner
}

// stopGrace is how long a stopped agent gets to tell the forge about its
// job before it is killed, at each of the two steps of stop.
const stopGrace = 30 * time.Second

// interruptGrace is stopGrace for a machine being taken back: the shortest
// notice, Compute Engine's and Azure's Preempt, is 30 s, so that the job's
// steps, then the agent, get 10 s each and everything is stopped within
// 25 s of the notice, while the agent can still report the job failed.
const interruptGrace = 10 * time.Second

// stop ends the agent. A job it runs is failed first: its steps, which
// agents start in process groups or sessions of their own, are sent
// SIGTERM, so that the agent reports the job failed (gitea-runner reports
// a job it cancels on its own shutdown as a success) and exits after it,
// as a single-job agent does. An agent still up after the grace gets
// SIGTERM, and SIGKILL with everything under it after another.
func stop(pid int, exited <-chan error, grace time.Duration) {
	procs := descendants(pid)
	var steps []int
	for _, p := range procs {
		if g, err := syscall.Getpgid(p); err == nil && g != pid {
			steps = append(steps, p)
		}
	}
	if len(steps) > 0 {
		for _, p := range steps {
			_ = syscall.Kill(p, syscall.SIGTERM)
		}
		select {
		case <-exited:
			return
		case <-time.After(grace):
		}
	}
	_ = syscall.Kill(-pid, syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(grace):
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		for _, p := range procs {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		<-exited
	}
}

// descendants lists the processes under pid, from /proc.
func descendants(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parens.
		rest := b[bytes.LastIndexByte(b, ')')+1:]
		f := strings.Fields(string(rest))
		if len(f) < 2 {
			continue
		}
		if ppid, err := strconv.Atoi(f[1]); err == nil {
			children[ppid] = append(children[ppid], p)
		}
	}
	var out []int
	for queue := children[pid]; len(queue) > 0; queue = queue[1:] {
		out = append(out, queue[0])
		queue = append(queue, children[queue[0]]...)
	}
	return out
}

// environ is the agent's environment: the plan's, with a search path and
// home where it has none. Nothing is inherited.
func environ(env map[string]string) []string {
	base := map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
	out := make([]string, 0, len(env)+len(base))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	for k, v := range base {
		if _, ok := env[k]; !ok {
			out = append(out, k+"="+v)
		}
	}
	return out
}

// writeFiles makes the working directory (0700) and writes the runner's
// files into it (0600), refusing paths that leave it.
func writeFiles(dir string, files map[string][]byte) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("workdir: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("workdir: %w", err)
	}
	defer root.Close()
	for name, data := range files {
		if d := filepath.Dir(name); d != "." {
			if err := root.MkdirAll(d, 0o700); err != nil {
				return fmt.Errorf("file %s: %w", name, err)
			}
		}
		if err := root.WriteFile(name, data, 0o600); err != nil {
			return fmt.Errorf("file %s: %w", name, err)
		}
	}
	return nil
}
