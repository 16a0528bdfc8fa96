// Package pool keeps a pool of fresh single-job runners: the reconciler
// that compares what the forge and the provider report with what the pool
// should have, and starts or removes runners to close the gap.
//
// It is level-triggered: each pass reads the truth from the provider (the
// machines) and the forge (the registrations). The pool's memory holds only
// what is in flight, so a manager killed at any moment and restarted adopts
// live runners, removes what a crash left half done, and carries on.
package pool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
)

// Forge is what the pool needs from a forge driver.
type Forge interface {
	Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error)
	Runners(ctx context.Context) ([]forge.Runner, error)
	RemoveRunner(ctx context.Context, id int64) error
}

// endedForge is implemented by forges whose driver keeps a list of runners
// between listings: an agent that finished its job has been deleted by the
// forge (it was ephemeral), which the driver learns without a call.
type endedForge interface {
	Ended(id int64)
}

// lostForge is implemented by forges that can re-run a job whose runner's
// machine went away mid-job (a spot instance taken back, a killed
// container). It must return at once.
type lostForge interface {
	Lost(ctx context.Context, runner string)
}

// Config is one pool's settings.
type Config struct {
	Name    string
	Manager string
	Labels  []string
	Env     map[string]string
	// Size is the number of idle runners kept ready; Max caps all
	// runners, busy ones included.
	Size, Max int
	// IdleTimeout removes idle runners above Size that are older.
	IdleTimeout time.Duration
	// MaxLifetime recycles idle runners that are older.
	MaxLifetime time.Duration
	// BootstrapTimeout replaces runners that have not come online at
	// the forge by then.
	BootstrapTimeout time.Duration
	// Resync is the period of passes when no event arrives.
	Resync time.Duration
	// OrphanGrace is how long a running machine may lack a registration
	// before it is removed. An ephemeral runner's registration is
	// deleted by the forge when its job ends, just before the agent
	// exits by itself; the grace lets it exit cleanly.
	OrphanGrace time.Duration
	// RetryLost re-runs, through the forge, a job whose runner's machine
	// went away while it ran.
	RetryLost bool
	// Once fills each of the Size slots once: a slot whose runner ended
	// stays empty (a one-shot runner, `runfleet runner --single`).
	Once bool

	// GPUs hands out the host's GPUs, shared by the pools of one host;
	// nil for a pool whose runners get none of their own.
	GPUs *gpu.Allocator
	// GPUsPerRunner is how many GPUs (or MIG devices) each runner gets;
	// -1 is all of them.
	GPUsPerRunner int
	// CUDA is the newest CUDA version the driver supports, for labels.
	CUDA gpu.Version
	// HardwareLabels adds labels that describe each runner's GPUs
	// ("gpu", "gpu-h200", "gpus-1", "cuda-12.4") to Labels.
	HardwareLabels bool

	// Demand returns the queued jobs matched to this pool that no
	// runner has taken yet: the pool keeps Size + Demand runners idle or
	// starting, within Max. Nil is no demand. It is given the runners
	// that took a job lately (within TookWindow), so that a job whose
	// start the forge has not reported yet is not counted twice: once
	// as still queued, and once more as the busy runner's replacement.
	Demand func(tookJob []int64) int
	// TookWindow is how long a runner that took a job is reported to
	// Demand; 1m by default.
	TookWindow time.Duration
	// OnStarted is called with how long a runner took to start: from
	// the pass that decided to start it (a slot freed, or demand) until
	// its machine runs.
	OnStarted func(time.Duration)
	// OnError is called when the provider fails an operation ("create",
	// "delete").
	OnError func(op string)
}

// Pool reconciles one pool.
type Pool struct {
	cfg   Config
	forge Forge
	prov  provider.Provider
	agent agent.Agent
	log   *slog.Logger
	now   func() time.Time
	names *regexp.Regexp
	dry   bool // an observer: decides, never acts

	trigger chan struct{}
	wg      sync.WaitGroup // operations in flight

	mu      sync.Mutex
	pending map[string]string // slot name -> "create" or "remove", in flight
	// An operation that completes while a pass is between listing and
	// deciding makes that pass's snapshot stale for its slot: done holds
	// the epoch at which each operation completed, and a pass that began
	// listing before then treats the slot as still in flight.
	epoch        uint64
	done         map[string]doneOp
	missingSince map[string]time.Time // running machine seen without registration
	draining     bool
	machines     int                  // the pool's machines at the last listing
	failures     int                  // consecutive failed creates
	created      int                  // runners started or being started, for Once
	lost         map[string]bool      // runner/machine reported lost
	logs         map[string]string    // slot -> agent log of its last machine seen
	vanished     map[string]time.Time // slot whose machine vanished mid-job, since
	took         map[int64]time.Time  // registration seen to take a job, when
	createAfter  time.Time            // no create before this (backoff)
	view         []Runner             // after the last pass
	lastErr      error
}

// Option configures a Pool.
type Option func(*Pool)

// WithClock replaces time.Now, for tests.
func WithClock(now func() time.Time) Option { return func(p *Pool) { p.now = now } }

// WithLogger sets the logger.
func WithLogger(l *slog.Logger) Option { return func(p *Pool) { p.log = l } }

// New returns a pool reconciler.
func New(cfg Config, f Forge, prov provider.Provider, a agent.Agent, opts ...Option) *Pool {
	if cfg.Max < cfg.Size {
		cfg.Max = cfg.Size
	}
	if cfg.Resync <= 0 {
		cfg.Resync = 5 * time.Second
	}
	if cfg.OrphanGrace <= 0 {
		cfg.OrphanGrace = 15 * time.Second
	}
	p := &Pool{
		cfg: cfg, forge: f, prov: prov, agent: a,
		log:          slog.Default(),
		now:          time.Now,
		names:        regexp.MustCompile(`^` + regexp.QuoteMeta(cfg.Name) + `-([0-9]+)$`),
		trigger:      make(chan struct{}, 1),
		pending:      map[string]string{},
		done:         map[string]doneOp{},
		missingSince: map[string]time.Time{},
		lost:         map[string]bool{},
		logs:         map[string]string{},
		vanished:     map[string]time.Time{},
		took:         map[int64]time.Time{},
	}
	if cfg.TookWindow <= 0 {
		p.cfg.TookWindow = time.Minute
	}
	for _, o := range opts {
		o(p)
	}
	p.log = p.log.With("pool", cfg.Name)
	return p
}

// Update applies a reloaded config's settings: labels and environment
// (for runners started from now on), size, max, timeouts and retry_lost.
// The caller stops the pool's loop and waits for its operations first.
func (p *Pool) Update(c Config) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cfg.Labels, p.cfg.Env = c.Labels, c.Env
	p.cfg.Size, p.cfg.Max = c.Size, max(c.Max, c.Size)
	p.cfg.IdleTimeout, p.cfg.MaxLifetime, p.cfg.BootstrapTimeout = c.IdleTimeout, c.MaxLifetime, c.BootstrapTimeout
	p.cfg.RetryLost = c.RetryLost
	if c.Resync > 0 {
		p.cfg.Resync = c.Resync
	}
}

// Name returns the pool's name.
func (p *Pool) Name() string { return p.cfg.Name }

// Trigger asks for a pass as soon as possible. It never blocks; triggers
// that arrive during a pass are folded into one more pass.
func (p *Pool) Trigger() {
	select {
	case p.trigger <- struct{}{}:
	default:
	}
}

// Owns reports whether a runner or machine name belongs to this pool.
func (p *Pool) Owns(name string) bool { return p.names.MatchString(name) }

// Run reconciles until ctx ends. Failed passes are retried with
// exponential backoff, from 1s up to one minute.
func (p *Pool) Run(ctx context.Context) {
	if w, ok := p.prov.(provider.Watcher); ok {
		w.Watch(ctx, func(name string) {
			// "" means events may have been missed: re-read everything.
			if name == "" || p.Owns(name) {
				p.Trigger()
			}
		})
	}
	backoff := time.Duration(0)
	for {
		wait := p.cfg.Resync
		if err := p.Reconcile(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			backoff = min(max(2*backoff, time.Second), time.Minute)
			wait = backoff
			p.log.Error("reconcile failed", "err", err, "retry_in", wait)
		} else {
			backoff = 0
			p.mu.Lock()
			if d := p.createAfter.Sub(p.now()); d > 0 && d < wait {
				wait = d
			}
			p.mu.Unlock()
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-p.trigger:
		case <-t.C:
		}
		t.Stop()
	}
}

// Drain stops creating runners, removes idle ones with their
// registrations, and waits for busy ones to finish their jobs, until none
// is left or ctx ends. It returns the runners still left.
func (p *Pool) Drain(ctx context.Context) []Runner {
	p.mu.Lock()
	p.draining = true
	p.mu.Unlock()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		err := p.Reconcile(ctx)
		p.mu.Lock()
		left, inflight := slices.Clone(p.view), len(p.pending)
		p.mu.Unlock()
		if err == nil && len(left) == 0 && inflight == 0 {
			p.wg.Wait()
			return nil
		}
		if err != nil {
			p.mu.Lock()
			nothing := p.machines == 0 && len(p.pending) == 0
			p.mu.Unlock()
			if nothing {
				// No machine of ours runs: nothing to wait for, even
				// though the forge cannot be reached. Registrations it
				// may still hold are removed at the next start.
				p.log.Warn("forge unreachable while draining; no machine left", "err", err)
				p.wg.Wait()
				return nil
			}
			p.log.Warn("drain pass failed", "err", err)
		}
		select {
		case <-ctx.Done():
			p.wg.Wait()
			return left
		case <-p.trigger:
		case <-tick.C:
		}
	}
}

// Wait waits for operations in flight.
func (p *Pool) Wait() { p.wg.Wait() }

// Runners returns the pool's runners as of the last pass.
func (p *Pool) Runners() []Runner {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.view)
}

// State of a runner, as status shows it.
type State string

const (
	StateStarting State = "starting" // machine up, not yet online at the forge
	StateIdle     State = "idle"
	StateBusy     State = "busy"
	StateStopping State = "stopping" // being removed, or its agent has exited
	StateOrphan   State = "orphan"   // a registration without a machine, or the reverse
)

// Runner is one slot of the pool as seen by a pass.
type Runner struct {
	Name     string
	Pool     string
	State    State
	RunnerID int64 // at the forge; 0 without a registration
	Created  time.Time
	Machine  string   // the provider's id (pid, container id)
	GPUs     []string // the GPUs its machine was given
}

type doneOp struct {
	epoch uint64
	op    string
}

// inflight returns the operation under way on a slot, as far as a pass
// that began listing at epoch since can tell. Called with p.mu held.
func (p *Pool) inflight(name string, since uint64) (string, bool) {
	if op, ok := p.pending[name]; ok {
		return op, true
	}
	if d, ok := p.done[name]; ok && d.epoch > since {
		return d.op, true
	}
	return "", false
}

// finish records a completed operation. Called with p.mu held.
func (p *Pool) finish(name, op string) {
	delete(p.pending, name)
	p.epoch++
	p.done[name] = doneOp{p.epoch, op}
}

// vanishedGrace is how long a registration whose machine vanished mid-job
// is left for the forge to fail the job and drop it, before the pool
// removes it itself (GitHub gives up on a lost runner within minutes).
const vanishedGrace = 15 * time.Minute

type slot struct {
	name  string
	inst  *provider.Instance
	reg   *forge.Runner
	phase agent.Phase // from the agent's output, when it tells
}

// phases reads what the agents' output says, for agents that tell: of
// the machines listed, and of the last machine seen in each slot, whose
// log outlives it (a container removed when it exits).
func (p *Pool) phases(insts []provider.Instance) map[string]agent.Phase {
	rep, ok := p.agent.(agent.Reporter)
	if !ok {
		return nil
	}
	p.mu.Lock()
	logs := maps.Clone(p.logs)
	p.mu.Unlock()
	for _, in := range insts {
		if in.Log != "" && in.Pool == p.cfg.Name && p.Owns(in.Name) {
			logs[in.Name] = in.Log
		}
	}
	out := map[string]agent.Phase{}
	for name, log := range logs {
		if b := tail(log, 32<<10); len(b) > 0 {
			out[name] = rep.Phase(b)
		}
	}
	return out
}

// tail returns the last n bytes of a file, nil if it cannot be read.
func tail(path string, n int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil
	}
	off := max(st.Size()-n, 0)
	b := make([]byte, st.Size()-off)
	if _, err := f.ReadAt(b, off); err != nil && !errors.Is(err, io.EOF) {
		return nil
	}
	return b
}

// Reconcile runs one pass: it reads the provider and the forge and starts
// what closes the gap.
func (p *Pool) Reconcile(ctx context.Context) error {
	_, err := p.pass(ctx, true)
	return err
}

// Observe reads the provider and the forge and returns the pool's runners,
// changing nothing.
func (p *Pool) Observe(ctx context.Context) ([]Runner, error) {
	return p.pass(ctx, false)
}

func (p *Pool) pass(ctx context.Context, act bool) ([]Runner, error) {
	p.mu.Lock()
	since := p.epoch
	p.mu.Unlock()
	insts, err := p.prov.List(ctx, p.cfg.Manager)
	if err != nil {
		return nil, p.fail(fmt.Errorf("pool %s: list machines: %w", p.cfg.Name, err))
	}
	if act {
		n := 0
		for _, in := range insts {
			if in.Pool == p.cfg.Name && p.Owns(in.Name) {
				n++
			}
		}
		p.mu.Lock()
		p.machines = n
		p.mu.Unlock()
	}
	regs, err := p.forge.Runners(ctx)
	if err != nil {
		return nil, p.fail(fmt.Errorf("pool %s: %w", p.cfg.Name, err))
	}
	phases := p.phases(insts)
	now := p.now()
	if !act {
		p = p.observer()
	}

	slots := map[string]*slot{}
	get := func(name string) *slot {
		s, ok := slots[name]
		if !ok {
			s = &slot{name: name}
			slots[name] = s
		}
		return s
	}
	for i := range insts {
		if insts[i].Pool == p.cfg.Name && p.Owns(insts[i].Name) {
			s := get(insts[i].Name)
			s.inst = &insts[i]
		}
	}
	for i := range regs {
		if !p.Owns(regs[i].Name) {
			continue
		}
		s := get(regs[i].Name)
		if s.reg != nil && act {
			// Two registrations of one name: only a crash between
			// register and record can make that. Keep the newer.
			if s.reg.ID > regs[i].ID {
				p.removeRegistration(ctx, regs[i])
				continue
			}
			p.removeRegistration(ctx, *s.reg)
		}
		s.reg = &regs[i]
	}

	for name, s := range slots {
		s.phase = phases[name]
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	p.lastErr = nil
	if act {
		for name := range p.logs {
			if _, ok := slots[name]; !ok {
				delete(p.logs, name) // gone from the provider and the forge
				delete(p.vanished, name)
			}
		}
		for _, s := range slots {
			if s.inst != nil && s.inst.Log != "" {
				p.logs[s.name] = s.inst.Log
			}
		}
		p.syncGPUs(slots, since)
		for name, d := range p.done {
			if d.epoch <= since { // this pass's snapshot shows its result
				delete(p.done, name)
			}
		}
	}
	var view []Runner
	idle, total := 0, 0
	for _, name := range slices.Sorted(maps.Keys(slots)) {
		s := slots[name]
		if s.inst == nil || s.inst.State != provider.StateRunning || s.reg != nil {
			delete(p.missingSince, name)
		}
		r := Runner{Name: name, Pool: p.cfg.Name}
		if s.reg != nil {
			r.RunnerID = s.reg.ID
		}
		if s.inst != nil {
			r.Created, r.Machine, r.GPUs = s.inst.Created, s.inst.ID, s.inst.GPUs
		}
		if op, ok := p.inflight(name, since); ok {
			r.State = StateStopping
			if op == "create" {
				r.State = StateStarting
				idle++
			}
			total++
			view = append(view, r)
			continue
		}
		r.State = p.decide(ctx, s, now)
		if act {
			p.log.Debug("slot", "runner", name, "state", r.State, "machine", s.inst != nil && s.inst.State == provider.StateRunning, "registered", s.reg != nil)
		}
		switch r.State {
		case StateStarting, StateIdle:
			idle++
			total++
		case StateBusy:
			total++
		}
		view = append(view, r)
	}
	for _, name := range slices.Sorted(maps.Keys(p.pending)) {
		if _, ok := slots[name]; !ok && p.pending[name] == "create" {
			view = append(view, Runner{Name: name, Pool: p.cfg.Name, State: StateStarting})
			idle++
			total++
		}
	}
	for _, name := range slices.Sorted(maps.Keys(p.done)) {
		// Created after this pass listed: running, but not in the snapshot.
		if _, ok := slots[name]; !ok && p.done[name].op == "create" && p.done[name].epoch > since {
			view = append(view, Runner{Name: name, Pool: p.cfg.Name, State: StateStarting})
			idle++
			total++
		}
	}
	prev := p.view
	p.view = view
	if !act {
		return view, nil
	}

	// The pool keeps Size runners idle, plus one for each queued job
	// matched to it that no runner has taken yet.
	want, demand := p.cfg.Size, 0
	if p.cfg.Demand != nil && !p.cfg.Once {
		took := p.tookJob(prev, view, now)
		demand = max(p.cfg.Demand(took), 0)
		want += demand
		if demand > 0 || len(took) > 0 {
			p.log.Debug("demand", "queued_unserved", demand, "took_job_lately", took, "idle_or_starting", idle, "total", total)
		}
	}
	// Idle runners above that, past the idle timeout, go first.
	if !p.draining {
		for i := range view {
			r := &view[i]
			if idle <= want {
				break
			}
			if r.State == StateIdle && now.Sub(r.Created) > p.cfg.IdleTimeout {
				s := slots[r.Name]
				p.retire(ctx, s, "idle above pool size")
				r.State = StateStopping
				idle--
				total--
			}
		}
	}

	need := min(want-idle, p.cfg.Max-total)
	if p.cfg.Once {
		need = min(need, p.cfg.Size-p.created)
	}
	if p.draining || need <= 0 || now.Before(p.createAfter) {
		return view, nil
	}
	// Names come from the fixed set <pool>-1 .. <pool>-<max>; a name is
	// reused once its runner is gone from both the provider and the forge.
	for n := 1; need > 0 && n <= p.cfg.Max; n++ {
		name := p.cfg.Name + "-" + strconv.Itoa(n)
		if _, used := slots[name]; used {
			continue
		}
		if _, used := p.inflight(name, since); used {
			continue
		}
		var units []gpu.Unit
		if p.cfg.GPUs != nil {
			var err error
			if units, err = p.cfg.GPUs.Take(name, p.cfg.GPUsPerRunner); err != nil {
				p.log.Debug("no runner started: its GPUs are taken", "runner", name, "err", err)
				break
			}
		}
		p.create(ctx, name, units)
		need--
	}
	return view, nil
}

// syncGPUs makes the GPU allocator agree with the machines listed: a
// running machine holds the GPUs it was given (which, after a restart, is
// how the allocator learns them), and a slot whose machine is gone frees
// its GPUs, unless an operation on it is in flight. Called with p.mu held.
func (p *Pool) syncGPUs(slots map[string]*slot, since uint64) {
	if p.cfg.GPUs == nil {
		return
	}
	for _, s := range slots {
		if s.inst == nil || len(s.inst.GPUs) == 0 {
			continue
		}
		if c := p.cfg.GPUs.Hold(s.name, s.inst.GPUs); len(c) > 0 {
			// Only a second manager on this host's GPUs, or GPUs that
			// went away, can make that.
			p.log.Error("runner holds GPUs that another runner holds, or that this host lacks", "runner", s.name, "gpus", c)
		}
	}
	for holder := range p.cfg.GPUs.Holders() {
		if !p.Owns(holder) {
			continue
		}
		if s, ok := slots[holder]; ok && s.inst != nil {
			continue
		}
		if _, busy := p.inflight(holder, since); busy {
			continue
		}
		p.cfg.GPUs.Release(holder)
	}
}

// tookJob returns the registrations of the runners seen to go from idle
// or starting to busy within TookWindow. Called with p.mu held.
func (p *Pool) tookJob(prev, view []Runner, now time.Time) []int64 {
	was := map[string]State{}
	for _, r := range prev {
		was[r.Name] = r.State
	}
	busy := map[int64]bool{}
	for _, r := range view {
		if r.State != StateBusy || r.RunnerID == 0 {
			continue
		}
		busy[r.RunnerID] = true
		if st := was[r.Name]; (st == StateIdle || st == StateStarting) && p.took[r.RunnerID].IsZero() {
			p.took[r.RunnerID] = now
		}
	}
	var out []int64
	for id, at := range p.took {
		if !busy[id] || now.Sub(at) > p.cfg.TookWindow {
			delete(p.took, id)
			continue
		}
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// observer returns a copy of the pool whose decisions change nothing: the
// retirements it would start are only recorded.
func (p *Pool) observer() *Pool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return &Pool{
		cfg: p.cfg, log: p.log, now: p.now, names: p.names, dry: true,
		pending: maps.Clone(p.pending), done: maps.Clone(p.done), epoch: p.epoch, missingSince: maps.Clone(p.missingSince), draining: p.draining,
		vanished: maps.Clone(p.vanished), logs: maps.Clone(p.logs), lost: maps.Clone(p.lost),
	}
}

func (p *Pool) fail(err error) error {
	p.mu.Lock()
	p.lastErr = err
	p.mu.Unlock()
	return err
}

// LastError returns the error of the last pass, nil if it succeeded.
func (p *Pool) LastError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lastErr
}

// decide reads a slot's state and starts what it needs: cleaning up what
// ended or was left behind, and retiring runners that are too old, did not
// come up, or are idle while the pool drains. Called with p.mu held.
func (p *Pool) decide(ctx context.Context, s *slot, now time.Time) State {
	switch {
	case s.inst == nil && s.phase == agent.PhaseDone:
		// The machine ended after its job (a container removed on exit):
		// the forge deleted the ephemeral registration itself.
		if f, ok := p.forge.(endedForge); ok && !p.dry {
			f.Ended(s.reg.ID)
			delete(p.logs, s.name)
			p.Trigger()
			return StateStopping
		}
		p.retire(ctx, s, "agent exited")
		return StateStopping

	case s.inst == nil && s.phase == agent.PhaseBusy:
		// The machine vanished mid-job (killed, out of memory, taken
		// back). The forge still counts the runner busy until it gives up
		// on it; the registration goes once it says otherwise.
		first, seen := p.vanished[s.name]
		if !seen {
			p.log.Warn("runner's machine vanished while it ran a job", "runner", s.name, "id", s.reg.ID)
			p.reportLost(ctx, s.name, fmt.Sprint("reg", s.reg.ID))
			p.vanished[s.name] = now
			first = now
		}
		if now.Sub(first) > vanishedGrace {
			delete(p.vanished, s.name)
			delete(p.logs, s.name)
			p.retire(ctx, s, "machine vanished mid-job")
		}
		return StateOrphan

	case s.inst == nil:
		// A registration without a machine: left by a crash between
		// registering and starting, or by a machine that vanished. A
		// busy one is kept: its job may still report back.
		if s.reg.Status == forge.StatusBusy {
			p.log.Warn("registration is busy but its machine is gone; leaving it to the forge", "runner", s.name, "id", s.reg.ID)
			p.reportLost(ctx, s.name, fmt.Sprint("reg", s.reg.ID))
			return StateOrphan
		}
		p.retire(ctx, s, "registration without a machine")
		return StateOrphan

	case s.inst.State != provider.StateRunning:
		// The agent has exited (its job is done, or it failed to
		// start): clean up, and the slot is free for a fresh runner.
		// Its machine goes even if the forge still counts it busy: the
		// agent is dead either way.
		switch s.phase {
		case agent.PhaseDone:
			// The forge deleted the ephemeral registration itself when
			// the job ended: nothing to remove there.
			if s.reg != nil {
				if f, ok := p.forge.(endedForge); ok && !p.dry {
					f.Ended(s.reg.ID)
				}
				cp := *s
				cp.reg = nil
				s = &cp
			}
		case agent.PhaseBusy:
			p.log.Warn("agent died while running a job", "runner", s.name)
			p.reportLost(ctx, s.name, s.inst.ID)
		}
		p.retire(ctx, s, "agent exited")
		return StateStopping

	case s.reg == nil && s.phase == agent.PhaseBusy:
		// The forge's list predates the job; never remove a busy runner.
		return StateBusy

	case s.reg == nil:
		first, seen := p.missingSince[s.name]
		if !seen {
			p.missingSince[s.name] = now
			first = now
		}
		if now.Sub(first) >= p.cfg.OrphanGrace {
			p.retire(ctx, s, "machine without a registration")
		}
		return StateOrphan
	}

	age := now.Sub(s.inst.Created)
	status := s.reg.Status
	// The agent's own word is newer than any listing of the forge.
	switch s.phase {
	case agent.PhaseBusy:
		status = forge.StatusBusy
	case agent.PhaseDone:
		return StateStopping // it exits by itself
	case agent.PhaseReady:
		if status == forge.StatusOffline {
			status = forge.StatusIdle
		}
	}
	switch status {
	case forge.StatusBusy:
		return StateBusy
	case forge.StatusOffline:
		if age > p.cfg.BootstrapTimeout && p.cfg.BootstrapTimeout > 0 {
			p.retire(ctx, s, fmt.Sprintf("not online after %s", p.cfg.BootstrapTimeout))
			return StateStopping
		}
		if p.draining {
			p.retire(ctx, s, "draining")
			return StateStopping
		}
		return StateStarting
	default:
		if p.draining {
			p.retire(ctx, s, "draining")
			return StateStopping
		}
		if p.cfg.MaxLifetime > 0 && age > p.cfg.MaxLifetime {
			p.retire(ctx, s, fmt.Sprintf("idle past max lifetime %s", p.cfg.MaxLifetime))
			return StateStopping
		}
		return StateIdle
	}
}

// reportLost tells the forge, once per machine, that a runner died
// mid-job, so that its job is re-run. Called with p.mu held.
func (p *Pool) reportLost(ctx context.Context, name, machine string) {
	f, ok := p.forge.(lostForge)
	if !ok || !p.cfg.RetryLost || p.dry {
		return
	}
	key := name + "/" + machine
	if p.lost[key] {
		return
	}
	p.lost[key] = true
	f.Lost(context.WithoutCancel(ctx), name)
}

// create registers a runner and starts its machine, in the background,
// with the GPUs taken for it. Called with p.mu held.
func (p *Pool) create(ctx context.Context, name string, units []gpu.Unit) {
	p.pending[name] = "create"
	p.created++
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		start := p.now()
		err := p.createRunner(ctx, name, units)
		p.mu.Lock()
		p.finish(name, "create")
		if err != nil {
			if p.cfg.GPUs != nil {
				p.cfg.GPUs.Release(name)
			}
			p.created--
			p.failures++
			if p.cfg.OnError != nil {
				p.cfg.OnError("create")
			}
			wait := min(time.Second<<min(p.failures-1, 6), time.Minute)
			p.createAfter = p.now().Add(wait)
			p.mu.Unlock()
			p.log.Error("create runner failed", "runner", name, "err", err, "retry_in", wait)
		} else {
			p.failures = 0
			p.createAfter = time.Time{}
			p.mu.Unlock()
			if p.cfg.OnStarted != nil {
				p.cfg.OnStarted(p.now().Sub(start))
			}
			p.log.Info("runner started", "runner", name, "took", p.now().Sub(start).Round(time.Millisecond))
		}
		p.Trigger()
	}()
}

func (p *Pool) createRunner(ctx context.Context, name string, units []gpu.Unit) error {
	labels := p.cfg.Labels
	if p.cfg.HardwareLabels {
		labels = slices.Clone(labels)
		for _, l := range gpu.Labels(units, p.cfg.CUDA) {
			if !slices.Contains(labels, l) {
				labels = append(labels, l)
			}
		}
	}
	cred, err := p.forge.Register(ctx, forge.RunnerRequest{Name: name, Labels: labels})
	if err != nil {
		return err
	}
	spec, err := p.agent.Spec(agent.Runner{
		Name: name, Manager: p.cfg.Manager, Pool: p.cfg.Name, Labels: labels, Env: p.cfg.Env,
	}, cred)
	if err == nil {
		spec.GPUs = gpu.IDs(units)
		_, err = p.prov.Create(ctx, spec)
	}
	if err != nil {
		// Never half-applied: a registration without its machine is
		// removed now rather than left for the next pass. A fresh
		// context: the caller's may be what ended.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if rerr := p.forge.RemoveRunner(rctx, cred.RunnerID); rerr != nil && !errors.Is(rerr, forge.ErrNotFound) {
			p.log.Warn("could not remove registration of failed runner; the next pass will", "runner", name, "err", rerr)
		}
		_ = p.prov.Delete(rctx, name)
		return err
	}
	return nil
}

// retire removes a runner in the background: the registration first, and
// only once the forge has agreed (it refuses a busy runner), the machine.
// Called with p.mu held.
func (p *Pool) retire(ctx context.Context, s *slot, why string) {
	if p.dry {
		return
	}
	p.pending[s.name] = "remove"
	reg, inst := s.reg, s.inst
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer func() {
			p.mu.Lock()
			p.finish(s.name, "remove")
			delete(p.missingSince, s.name)
			p.mu.Unlock()
			p.Trigger()
		}()
		exited := inst != nil && inst.State != provider.StateRunning
		if reg != nil {
			err := p.forge.RemoveRunner(ctx, reg.ID)
			switch {
			case errors.Is(err, forge.ErrBusy) && !exited:
				p.log.Info("runner took a job; keeping it", "runner", s.name, "reason", why)
				return
			case errors.Is(err, forge.ErrBusy):
				p.log.Warn("agent exited while the forge counts it busy; its job fails at the forge", "runner", s.name)
			case err != nil && !errors.Is(err, forge.ErrNotFound):
				p.log.Warn("remove registration failed", "runner", s.name, "err", err)
				if !exited {
					return
				}
			}
		}
		if inst != nil {
			if err := p.prov.Delete(ctx, s.name); err != nil {
				p.log.Warn("delete machine failed", "runner", s.name, "err", err)
				if p.cfg.OnError != nil {
					p.cfg.OnError("delete")
				}
				return
			}
		}
		p.log.Info("runner removed", "runner", s.name, "reason", why)
	}()
}

// removeRegistration removes a duplicate registration in the background.
func (p *Pool) removeRegistration(ctx context.Context, r forge.Runner) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		if err := p.forge.RemoveRunner(ctx, r.ID); err != nil && !errors.Is(err, forge.ErrNotFound) {
			p.log.Warn("remove duplicate registration failed", "runner", r.Name, "id", r.ID, "err", err)
		}
	}()
}
