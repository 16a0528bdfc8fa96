// Package daemon wires a configuration into forge connections, providers
// and pool reconcilers through the drivers' registries, runs them, and
// drains them on shutdown. It knows no driver by name.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/metrics"
	"github.com/runfleet/runfleet/placement"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/pricing"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/tally"
	"github.com/runfleet/runfleet/version"
)

// Version is the runfleet version (package version): on the status page,
// in runners' records, and in the User-Agent sent to forges.
var Version = version.Get().Version

// What Fleet.acting holds.
const (
	actingNot int32 = iota
	actingYes
	actingDrain
)

// Fleet is a configured set of pools.
type Fleet struct {
	Config *config.Config
	// acting is what /readyz tells: actingYes while the fleet runs (and
	// leads, where it is elected).
	acting atomic.Int32
	// findLeader reads where the leader takes webhooks (LeaderAt);
	// leaderURL is its last answer, read at leaderRead.
	findLeader func(context.Context) (string, error)
	leaderMu   sync.Mutex
	leaderURL  string
	leaderRead time.Time
	Pools      []*pool.Pool
	// Forges by pool name, for reading jobs.
	Forges map[string]forge.Forge
	// Providers by pool name.
	Providers map[string]provider.Provider
	// Host is this host's GPUs, read when a pool first needs them, and
	// their allocator.
	Host *placement.Host
	// Demand tracks queued jobs, from webhooks and polls.
	Demand *demand.Tracker
	// Metrics are the manager's Prometheus metrics.
	Metrics *metrics.Metrics
	log     *slog.Logger

	conns  map[string]forge.Forge // forge connections, by forge name
	mu     sync.Mutex             // guards Pools, Config and runs during a reload
	runs   map[string]*poolRun    // by pool name, while Run runs
	runCtx context.Context

	// plans are the pools' placements, by pool name (guarded by mu).
	plans   map[string]placement.Plan
	closers []io.Closer
	// bg is the fleet's own background work (a timed-out job's re-run),
	// waited for at drain with the connections'.
	bg      forge.Following
	history history.Handle
	// window is the history's last week in memory, for the status page
	// and the cost counters (tally.Window): filled when the history
	// opens, then told each write.
	window *tally.Window
	// prices prices the records of cloud pools without a price in their
	// config from their clouds' price lists (provider.Pricer).
	prices *pricing.Filler
	// polls holds, by forge, its polls failing in a row (pollState).
	polls sync.Map
	// readOnly: the fleet is only read (Inspect).
	readOnly bool
	// stopped holds, by pool, why its forge's session stopped for good
	// (listen), for the status page.
	stopped sync.Map
}

// New builds the fleet for a validated config. It makes no network call;
// it fails only on what is wrong locally (an agent binary that is missing,
// a directory that cannot be made, GPUs the host lacks), which is a
// configuration error. ctx bounds the opening of the connections.
func New(ctx context.Context, cfg *config.Config, log *slog.Logger) (*Fleet, error) {
	return build(ctx, cfg, log, false)
}

// Inspect builds the fleet of a config to be read, not run (status, gc):
// it writes nothing on disk and needs no agent on this host, since none
// starts. It makes no network call.
func Inspect(ctx context.Context, cfg *config.Config, log *slog.Logger) (*Fleet, error) {
	return build(ctx, cfg, log, true)
}

func build(ctx context.Context, cfg *config.Config, log *slog.Logger, readOnly bool) (*Fleet, error) {
	f := &Fleet{Config: cfg, Forges: map[string]forge.Forge{}, Providers: map[string]provider.Provider{}, log: log, runs: map[string]*poolRun{}, readOnly: readOnly, plans: map[string]placement.Plan{}}
	f.Host = &placement.Host{NvidiaSMI: cfg.GPU.NvidiaSMI, ShareVMGPUs: cfg.GPU.AllowHostVGPU, Log: log}
	f.Metrics = metrics.New(f)
	f.window = tally.NewWindow(windowSpan, f.countEnded)
	f.prices = &pricing.Filler{Pricer: f.pricer, Set: f.setPrice, Log: log.With("component", "pricing")}
	conns, err := openForges(ctx, cfg, log)
	if err != nil {
		return nil, err
	}
	f.conns = conns
	if _, err := demanderPools(cfg, conns); err != nil {
		f.Close()
		return nil, err
	}
	f.Demand = demand.New(nil, f.jobChanged)
	var errs []error
	for i := range cfg.Pools {
		p, err := f.buildPool(ctx, &cfg.Pools[i])
		if err != nil {
			errs = append(errs, fmt.Errorf("pools[%d]: %w", i, err))
			continue
		}
		f.Pools = append(f.Pools, p)
		if h, ok := f.Providers[cfg.Pools[i].Name].(provider.Handoffer); ok && h.HandoffHandler() != nil && cfg.Listen == "" && !readOnly {
			errs = append(errs, fmt.Errorf("pools[%d]: its instances claim their assignment from this manager (handoff_url), which serves them on its webhook listener: listen is not set", i))
		}
	}
	if err := errors.Join(errs...); err != nil {
		f.Close()
		return nil, err
	}
	f.Demand.SetPools(f.demandPools(cfg))
	return f, nil
}

// owedOf is where a forge connection keeps the re-runs of lost runners'
// jobs it owes (forge.LedgerDir), in the state directory: a manager that
// drained or died before a run ended leaves its re-run to the next.
// Nil without a state directory.
func owedOf(cfg *config.Config, forgeName string, log *slog.Logger) *forge.LedgerDir {
	if cfg.StateDir == "" {
		return nil
	}
	return &forge.LedgerDir{Dir: filepath.Join(cfg.StateDir, "owed", forgeName), Logger: log}
}

// resumeOwed takes up the re-runs that an earlier manager on this state
// owed and did not finish: each runner is told lost again, and its
// follow-up finds its job, or nothing left to do.
func (f *Fleet) resumeOwed(ctx context.Context) {
	for _, fc := range f.Config.Forges {
		r, ok := f.conns[fc.Name].(forge.Rerunner)
		l := owedOf(f.Config, fc.Name, f.log)
		if !ok || l == nil {
			continue
		}
		for _, lost := range l.Owed() {
			f.log.Info("taking up the re-run of a lost runner's job that an earlier manager left", "forge", fc.Name, "runner", lost.Name, "id", lost.ID)
			r.Lost(ctx, lost)
		}
	}
}

// openForges opens a connection to each forge, through its type's driver.
func openForges(ctx context.Context, cfg *config.Config, log *slog.Logger) (map[string]forge.Forge, error) {
	conns := map[string]forge.Forge{}
	var errs []error
	for i, fc := range cfg.Forges {
		field := fmt.Sprintf("forges[%d]", i)
		d, ok := forge.Lookup(fc.Type)
		if !ok {
			errs = append(errs, fmt.Errorf("%s.type: %q is not in this build (known: %s)", field, fc.Type, strings.Join(forge.Types(), ", ")))
			continue
		}
		env := forge.Env{Version: Version, Manager: cfg.ID, Logger: log.With("forge", fc.Name), Budget: fc.Budget()}
		if l := owedOf(cfg, fc.Name, env.Logger); l != nil {
			env.Owed = l
		}
		conn, err := d.Open(ctx, fc.Driver(), env)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", field, err))
			continue
		}
		if _, ok := conn.(agent.Maker); !ok {
			errs = append(errs, fmt.Errorf("%s.type: the %s driver has no runner agent", field, fc.Type))
		}
		if _, ok := conn.(forge.WebhookParser); !ok && fc.WebhookSecret != "" {
			errs = append(errs, fmt.Errorf("%s.webhook_secret: forge type %s takes no webhooks", field, fc.Type))
		}
		conns[fc.Name] = conn
	}
	return conns, errors.Join(errs...)
}

// buildPool makes one pool's provider, placement, agent and reconciler.
func (f *Fleet) buildPool(ctx context.Context, pc *config.Pool) (*pool.Pool, error) {
	d, ok := provider.Lookup(pc.Provider)
	if !ok {
		return nil, fmt.Errorf("provider: %q is not in this build (known: %s)", pc.Provider, strings.Join(provider.Names(), ", "))
	}
	pconf := pc.Driver(f.Config.ID, f.Config.StateDir)
	pconf.GPUs, pconf.Logger, pconf.ReadOnly = f.Host.GPUs, f.log, f.readOnly
	if l, ok := f.conns[pc.Forge].(forge.JobLimiter); ok && pconf.JobTimeout == 0 {
		pconf.JobTimeout = l.JobLimit()
	}
	prov, err := d.Open(ctx, pconf)
	if err != nil {
		return nil, err
	}
	if c, ok := prov.(io.Closer); ok {
		f.closers = append(f.closers, c)
	}
	traits := provider.TraitsOf(prov)
	plan, err := placement.For(f.Host, pc.Want(), prov)
	if err != nil {
		return nil, err
	}
	conn := f.conns[pc.Forge]
	ag, err := conn.(agent.Maker).Agent(agent.Config{Path: pc.Agent.Path, FetchInterval: pc.Agent.FetchInterval.Duration, Local: traits.Local, IdleTimeout: pc.IdleTimeout.Duration, Inspect: f.readOnly})
	if err != nil {
		return nil, err
	}
	f.Forges[pc.Name] = conn
	f.Providers[pc.Name] = prov
	f.plans[pc.Name] = plan
	name := pc.Name
	pcfg := f.poolConfig(*pc, plan)
	pcfg.Record, pcfg.History = f.recordTemplate(*pc, plan.Runners.GPUs != nil), &f.history
	pcfg.Prices = pricesOf(*pc, f.Config.Currency)
	pcfg.TookWindow = time.Minute
	var implicit []string
	if l, ok := conn.(forge.Labeler); ok {
		implicit = l.ImplicitLabels()
	}
	jobs := f.Demand.For(name, pc.Forge, implicit, pcfg.TookWindow)
	pcfg.Demand = jobs.Unserved
	if d, ok := conn.(forge.Demander); ok {
		pcfg.Demand = d.Unserved
	}
	if pc.Dynamic != nil {
		if err := f.shapePool(ctx, *pc, &pcfg, prov, jobs); err != nil {
			return nil, err
		}
	}
	m := f.Metrics.Pool(name)
	pcfg.OnStarted, pcfg.OnError = m.Started, m.Error
	// A refusal by the forge is not carried over: a new manager tries
	// again, once.
	pcfg.Backoff = f.SavedBackoff(name)
	pcfg.Backoff.Halted, pcfg.Backoff.Shapes = false, nil
	return pool.New(pcfg, conn, prov, ag, pool.WithLogger(f.log)), nil
}

// Plan is a pool's placement: its size and max as its GPUs fit them, and
// what its runners get and register with.
func (f *Fleet) Plan(pool string) (placement.Plan, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.plans[pool]
	return p, ok
}

// idleLifetime is the pool's max_lifetime, or less where its machines'
// own limit leaves less room (provider.Lifetimer).
func idleLifetime(maxLifetime time.Duration, p provider.Provider) time.Duration {
	if l, ok := p.(provider.Lifetimer); ok && l.IdleLifetime() < maxLifetime {
		return l.IdleLifetime()
	}
	return maxLifetime
}

// poolConfig is the part of a pool's settings that a reload may change.
func (f *Fleet) poolConfig(pc config.Pool, plan placement.Plan) pool.Config {
	return pool.Config{
		Name:             pc.Name,
		Manager:          f.Config.ID,
		Runners:          plan.Runners,
		Env:              pc.Env,
		Size:             plan.Size,
		Max:              plan.Max,
		IdleTimeout:      pc.IdleTimeout.Duration,
		MaxLifetime:      idleLifetime(pc.MaxLifetime.Duration, f.Providers[pc.Name]),
		BootstrapTimeout: pc.BootstrapTimeout.Duration + provider.TraitsOf(f.Providers[pc.Name]).BootGrace,
		Resync:           f.Config.Resync.Duration,
		RetryLost:        pc.RetryLost == nil || *pc.RetryLost,
		Once:             pc.Single,
		// Kept with what its runners are now, also after a reload.
		OnBackoff: f.backoffFile(pc.Name).Save,
	}
}

// Holders maps each GPU id held by a runner of this manager to the
// runner, from the providers' own records (container labels, process
// records), so it holds whether or not the manager runs.
func (f *Fleet) Holders(ctx context.Context) (map[string]string, error) {
	out := map[string]string{}
	seen := map[provider.Provider]bool{}
	for _, prov := range f.Providers {
		if seen[prov] || !provider.TraitsOf(prov).HostGPUs {
			continue
		}
		seen[prov] = true
		insts, err := prov.List(ctx, f.Config.ID)
		if err != nil {
			return nil, err
		}
		for _, in := range insts {
			for _, id := range in.GPUs {
				out[id] = in.Name
			}
		}
	}
	return out, nil
}

// Close releases what the fleet holds (event streams, output copies,
// engine connections). Runners keep running.
func (f *Fleet) Close() {
	for _, c := range f.closers {
		if err := c.Close(); err != nil {
			f.log.Warn("close provider", "err", err)
		}
	}
}

// drainConns ends the work the forge connections do in the background
// (forge.Drainer) and waits for the fleet's own (a timed-out job's
// re-run, one call), until ctx ends: then that is cancelled.
func (f *Fleet) drainConns(ctx context.Context) {
	var wg sync.WaitGroup
	for _, c := range f.conns {
		if d, ok := c.(forge.Drainer); ok {
			wg.Go(func() { d.Drain(ctx) })
		}
	}
	wg.Go(func() { f.bg.Wait(ctx) })
	wg.Wait()
}

// Drain drains every pool at once, for up to timeout, then ends the
// forges' background work (a lost job's re-run, which the next manager
// takes up) within the same time.
func (f *Fleet) Drain(ctx context.Context, timeout time.Duration) []pool.Runner {
	f.log.Info("draining: removing idle runners, waiting for busy ones", "timeout", timeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var (
		mu   sync.Mutex
		left []pool.Runner
		wg   sync.WaitGroup
	)
	for _, p := range f.pools() {
		wg.Go(func() {
			l := p.Drain(ctx)
			mu.Lock()
			left = append(left, l...)
			mu.Unlock()
		})
	}
	wg.Wait()
	f.drainConns(ctx)
	if len(left) > 0 {
		names := make([]string, len(left))
		for i, r := range left {
			names[i] = r.Name + " (" + string(r.State) + ")"
		}
		f.log.Warn("drain timed out; runners left running (a restarted manager adopts them)", "runners", strings.Join(names, ", "))
	} else {
		f.log.Info("drained: no runner left")
	}
	return left
}
