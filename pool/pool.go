// Package pool keeps a pool of fresh single-job runners: the reconciler
// that compares what the forge and the provider report with what the pool
// should have, and starts or removes runners to close the gap.
//
// Words used here, each with one meaning:
//
//   - A slot is one of the pool's names, <pool>-1 … <pool>-<max>. A slot
//     holds at most one runner at a time, and its name is reused once that
//     runner is gone from both the provider and the forge.
//   - A machine is what the provider runs for a slot: a process, a
//     container, a pod, a cloud instance. The provider lists it as a
//     provider.Instance, its record of the machine (state, id, GPUs).
//   - A registration is the runner's record at the forge (forge.Runner).
//   - A Runner is the pool's view of one slot after a pass: its machine and
//     its registration together, classified into a State.
//
// The reconciler is level-triggered: each pass reads the truth from the
// provider (the machines) and the forge (the registrations), and the
// pool's memory holds only what is in flight, so a manager killed at any
// moment and restarted adopts live runners, removes what a crash left
// half done, and carries on. A pass is split by concern: read (state.go)
// lists machines, registrations and the agents' output; classify
// (classify.go) decides each slot's state and what it needs, without
// locks or I/O; scale (scale.go) decides how many runners to start or
// retire; act (act.go) starts and retires them in the background; gpus.go
// gives runners the host's GPUs. Observe is a pass that classifies and
// acts on nothing.
package pool

import (
	"context"
	"log/slog"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/placement"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// Forge is what the pool needs from a forge driver. It may also implement
// forge.EndObserver and forge.Rerunner.
type Forge interface {
	Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error)
	Runners(ctx context.Context) ([]forge.Runner, error)
	RemoveRunner(ctx context.Context, id int64) error
}

// Config is one pool's settings.
type Config struct {
	Name    string
	Manager string
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

	// Runners is what each runner gets and registers with: its labels
	// and its share of this host's GPUs (package placement).
	Runners placement.Runners

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
	// OnBackoff is called when the pool's backoff changes: a runner
	// failed, or one took a job after failures.
	OnBackoff func(Backoff)
	// Backoff is where a previous manager's backoff stood, so that a
	// restart does not reset a failing pool's wait.
	Backoff Backoff

	// Record is what every runner's environment record starts from (the
	// manager's version, the forge, the provider, the GPU driver): each
	// runner's machine gets its own, for its job to read. Nil gives
	// none.
	Record *record.Record
	// Prices says what its machines cost by the hour, for their records;
	// nil: nothing.
	Prices *record.Prices
	// History keeps the records and what becomes of each runner; nil
	// keeps none.
	History History

	// A dynamic pool's jobs choose their machine (shapes.go). Shapes
	// returns, by shape (dynamic.Shape of a job's labels; "" for jobs that
	// ask for nothing), the queued jobs matched to the pool that no
	// runner took, given by shape the runners that took a job lately; it
	// replaces Demand. Resolve reads a shape within the pool's limits.
	// HoldBack reports whether a runner with these labels must wait: a
	// queued job with fewer labels could take it (and which one).
	Shapes   func(took map[string][]int64) map[string]int
	Resolve  func(shape string) (dynamic.Request, error)
	HoldBack func(labels []string, shape string) (job string, hold bool)
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

	trigger chan struct{}
	wg      sync.WaitGroup // operations in flight

	mu      sync.Mutex
	pending map[string]op // operations in flight, by slot
	// An operation that completes while a pass is between listing and
	// deciding makes that pass's snapshot stale for its slot: done holds
	// the epoch at which each operation completed, and a pass that began
	// listing before then treats the slot as still in flight.
	epoch    uint64
	done     map[string]doneOp
	memory   map[string]memory // what earlier passes noted, by slot
	draining bool
	machines int // the pool's machines at the last listing
	created  int // runners started or being started, for Once
	// lost holds, by slot, the machine (or registration) last reported
	// lost, so that a loss is reported once.
	lost           map[string]string
	last           map[string]provider.Instance // slot -> its last machine seen, whose output outlives it
	preempted      map[string]provider.Notice   // machine id -> notice that it is being taken back
	ended          map[string]endedRunner       // machine id -> its runner, retired after its agent said its job ended (lateNotices)
	took           map[int64]time.Time          // registration seen to take a job, when
	served         bool                         // a runner came online or took a job
	registered     map[string]int64             // slot -> registration its create made, until a listing shows it
	unregistered   map[string]bool              // slot -> started without a registration (its agent makes its own), until one is listed
	refused        map[int64]refusal            // registration whose removal the forge refused after its machine went
	backoff        Backoff                      // runners failing one after another
	backoffChanged bool                         // since the last OnBackoff
	noted          map[int64]noted              // registration -> what the history was told of it
	shapes         placement.Shapes             // a dynamic pool's shapes: of each slot, refused, waiting, backing off
	view           []Runner                     // after the last pass
	lastErr        error
	failingSince   time.Time // first of the passes failing in a row; zero after a pass that worked
	nextPass       time.Time // when the next pass is due, at the latest
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
	if cfg.TookWindow <= 0 {
		cfg.TookWindow = time.Minute
	}
	p := &Pool{
		cfg: cfg, forge: f, prov: prov, agent: a,
		log:          slog.Default(),
		now:          time.Now,
		names:        regexp.MustCompile(`^` + regexp.QuoteMeta(cfg.Name) + `-([0-9]+)$`),
		trigger:      make(chan struct{}, 1),
		pending:      map[string]op{},
		done:         map[string]doneOp{},
		memory:       map[string]memory{},
		lost:         map[string]string{},
		last:         map[string]provider.Instance{},
		preempted:    map[string]provider.Notice{},
		ended:        map[string]endedRunner{},
		took:         map[int64]time.Time{},
		registered:   map[string]int64{},
		unregistered: map[string]bool{},
		refused:      map[int64]refusal{},
		noted:        map[int64]noted{},
		backoff:      cfg.Backoff,
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
	p.cfg.Runners, p.cfg.Env = c.Runners, c.Env
	p.cfg.Size, p.cfg.Max = c.Size, max(c.Max, c.Size)
	p.cfg.IdleTimeout, p.cfg.MaxLifetime, p.cfg.BootstrapTimeout = c.IdleTimeout, c.MaxLifetime, c.BootstrapTimeout
	p.cfg.RetryLost = c.RetryLost
	if c.OnBackoff != nil {
		p.cfg.OnBackoff = c.OnBackoff
	}
	if p.backoff.Halted {
		// The refused request may be fixed by the new config.
		p.backoff.Halted = false
		p.backoffChanged = true
	}
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
	p.watch(ctx)
	go p.watchTakes(ctx)
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
			if d := p.backoff.Until.Sub(p.now()); d > 0 && d < wait {
				wait = d
			}
			p.mu.Unlock()
		}
		p.mu.Lock()
		p.nextPass = p.now().Add(wait)
		p.mu.Unlock()
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

// watch subscribes to what the provider reports as it happens: machines
// that change state, and machines about to be taken back.
func (p *Pool) watch(ctx context.Context) {
	if w, ok := p.prov.(provider.Watcher); ok {
		w.Watch(ctx, func(name string) {
			// "" means events may have been missed: re-read everything.
			if name == "" || p.Owns(name) {
				p.Trigger()
			}
		})
	}
	if w, ok := p.prov.(provider.Preempter); ok {
		w.WatchPreemption(ctx, p.Preempted)
	}
}

// Preempted is told that a machine is about to be taken back. Its runner
// is retired if idle; if busy, its job is reported lost (the forge re-runs
// it), and its slot no longer counts against max, so that a replacement
// starts before the machine is gone.
func (p *Pool) Preempted(n provider.Notice) {
	if !p.Owns(n.Name) {
		return
	}
	p.mu.Lock()
	p.preempted[n.ID] = n
	p.mu.Unlock()
	p.log.Warn("machine is being taken back", "runner", n.Name, "machine", n.ID, "reason", n.Reason, "at", n.At)
	p.Trigger()
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
		// A lost runner has no machine to wait for: its registration
		// is the forge's to let go of.
		left := slices.DeleteFunc(slices.Clone(p.view), func(r Runner) bool { return r.State == StateLost })
		inflight, nothing := len(p.pending), p.machines == 0 && len(p.pending) == 0
		p.mu.Unlock()
		if err == nil && len(left) == 0 && inflight == 0 {
			p.wg.Wait()
			return nil
		}
		if err != nil {
			if nothing {
				// No machine of ours runs: nothing to wait for, even
				// though the forge cannot be reached. Registrations it
				// may still hold are removed at the next start.
				p.log.Warn("the forge could not be read while draining; no machine of this pool is left", "err", err)
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

// Created returns how many runners the pool has started (or is starting)
// since it began: with Once, a pool whose runners are all gone and that
// has started some is done, however briefly they ran.
func (p *Pool) Created() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.created
}

// Served says whether a runner of the pool has come online at its forge
// or taken a job since the pool began: seen online or busy, its agent
// saying it took a job, or its registration deleted by the forge as an
// ephemeral runner's is once its job ended.
func (p *Pool) Served() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.served
}

// LastError returns the error of the last pass, nil if it succeeded.
func (p *Pool) LastError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lastErr
}

// FailingSince returns when the passes failing now began to fail, zero
// if the last pass worked: one failed pass is an outage's first moment or
// a blip, and only its length tells them apart.
func (p *Pool) FailingSince() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failingSince
}

// NextPass is when the pool's next pass is due at the latest (an event
// may bring it sooner); zero before its first.
func (p *Pool) NextPass() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextPass
}

func (p *Pool) fail(err error) error {
	p.mu.Lock()
	p.lastErr = err
	if p.failingSince.IsZero() {
		p.failingSince = p.now()
	}
	p.mu.Unlock()
	return err
}
