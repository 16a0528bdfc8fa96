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
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/metrics"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider"
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
	// Inventory is this host's GPUs, read when a pool needs them.
	Inventory *gpu.Inventory
	// GPUs hands out the GPUs to the pools' runners; nil when no pool
	// gives runners GPUs of their own.
	GPUs *gpu.Allocator
	// Demand tracks queued jobs, from webhooks and polls.
	Demand *demand.Tracker
	// Metrics are the manager's Prometheus metrics.
	Metrics *metrics.Metrics
	log     *slog.Logger

	conns  map[string]forge.Forge // forge connections, by forge name
	mu     sync.Mutex             // guards Pools, Config and runs during a reload
	runs   map[string]*poolRun    // by pool name, while Run runs
	runCtx context.Context

	gpuMu   sync.Mutex // guards Inventory and GPUs while they are read
	closers []io.Closer
	history jobHistory
	// readOnly: the fleet is only read (Inspect).
	readOnly bool
	// stopped holds, by pool, why its forge's session stopped for good
	// (listen), for the status page.
	stopped sync.Map
}

// New builds the fleet for a validated config. It makes no network call;
// it fails only on what is wrong locally (an agent binary that is missing,
// a directory that cannot be made, GPUs the host lacks), which is a
// configuration error.
func New(cfg *config.Config, log *slog.Logger) (*Fleet, error) {
	return build(cfg, log, false)
}

// Inspect builds the fleet of a config to be read, not run (status, gc):
// it writes nothing on disk and needs no agent on this host, since none
// starts. It makes no network call.
func Inspect(cfg *config.Config, log *slog.Logger) (*Fleet, error) {
	return build(cfg, log, true)
}

func build(cfg *config.Config, log *slog.Logger, readOnly bool) (*Fleet, error) {
	f := &Fleet{Config: cfg, Forges: map[string]forge.Forge{}, Providers: map[string]provider.Provider{}, log: log, runs: map[string]*poolRun{}, readOnly: readOnly}
	f.Metrics = metrics.New(f)
	conns, err := openForges(cfg, log)
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
		p, err := f.buildPool(&cfg.Pools[i])
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

// openForges opens a connection to each forge, through its type's driver.
func openForges(cfg *config.Config, log *slog.Logger) (map[string]forge.Forge, error) {
	conns := map[string]forge.Forge{}
	var errs []error
	for i, fc := range cfg.Forges {
		field := fmt.Sprintf("forges[%d]", i)
		d, ok := forge.Lookup(fc.Type)
		if !ok {
			errs = append(errs, fmt.Errorf("%s.type: %q is not in this build (known: %s)", field, fc.Type, strings.Join(forge.Types(), ", ")))
			continue
		}
		conn, err := d.Open(fc.Driver(), forge.Env{Version: Version, Manager: cfg.ID, Logger: log.With("forge", fc.Name), Budget: fc.Budget()})
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

// buildPool makes one pool's provider, agent and reconciler. It may set
// the pool's size (from its GPUs).
func (f *Fleet) buildPool(pc *config.Pool) (*pool.Pool, error) {
	d, ok := provider.Lookup(pc.Provider)
	if !ok {
		return nil, fmt.Errorf("provider: %q is not in this build (known: %s)", pc.Provider, strings.Join(provider.Names(), ", "))
	}
	pconf := pc.Driver(f.Config.ID, f.Config.StateDir)
	pconf.GPUs, pconf.Logger, pconf.ReadOnly = f.inventory, f.log, f.readOnly
	if l, ok := f.conns[pc.Forge].(forge.JobLimiter); ok && pconf.JobTimeout == 0 {
		pconf.JobTimeout = l.JobLimit()
	}
	prov, err := d.Open(pconf)
	if err != nil {
		return nil, err
	}
	if c, ok := prov.(io.Closer); ok {
		f.closers = append(f.closers, c)
	}
	traits := provider.TraitsOf(prov)
	per, err := f.poolGPUs(pc, traits)
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
	name := pc.Name
	pcfg := f.poolConfig(*pc)
	if per != 0 {
		pcfg.GPUs, pcfg.GPUsPerRunner = f.GPUs, per
		pcfg.CUDA, pcfg.HardwareLabels = f.Inventory.CUDA, pc.HasHardwareLabels()
	}
	pcfg.Record, pcfg.History = f.recordTemplate(*pc, per != 0), &f.history
	pcfg.TookWindow = time.Minute
	pcfg.Demand = func(took []int64) int { return f.Demand.Unserved(name, took, pcfg.TookWindow) }
	if d, ok := conn.(forge.Demander); ok {
		pcfg.Demand = d.Unserved
	}
	if pc.Dynamic != nil {
		if err := f.shapePool(*pc, &pcfg, prov, per != 0 && traits.HostGPUs); err != nil {
			return nil, err
		}
	}
	pcfg.OnStarted = func(d time.Duration) { f.Metrics.RunnerStart.WithLabelValues(name).Observe(d.Seconds()) }
	pcfg.OnError = func(op string) { f.Metrics.ProviderErrors.WithLabelValues(name, op).Inc() }
	pcfg.OnBackoff = func(b pool.Backoff) { f.saveBackoff(name, b) }
	// A refusal by the forge is not carried over: a new manager tries
	// again, once.
	pcfg.Backoff = f.SavedBackoff(name)
	pcfg.Backoff.Halted = false
	return pool.New(pcfg, conn, prov, ag, pool.WithLogger(f.log)), nil
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
func (f *Fleet) poolConfig(pc config.Pool) pool.Config {
	return pool.Config{
		Name:             pc.Name,
		Manager:          f.Config.ID,
		Labels:           f.providerLabels(pc),
		Env:              pc.Env,
		Size:             pc.Size,
		Max:              pc.Max,
		IdleTimeout:      pc.IdleTimeout.Duration,
		MaxLifetime:      idleLifetime(pc.MaxLifetime.Duration, f.Providers[pc.Name]),
		BootstrapTimeout: pc.BootstrapTimeout.Duration + provider.TraitsOf(f.Providers[pc.Name]).BootGrace,
		Resync:           f.Config.Resync.Duration,
		RetryLost:        pc.RetryLost == nil || *pc.RetryLost,
		Once:             pc.Single,
	}
}

// providerLabels is a pool's labels and, with hardware labels, those its
// provider gives every machine of the pool (provider.Labeler).
func (f *Fleet) providerLabels(pc config.Pool) []string {
	l, ok := f.Providers[pc.Name].(provider.Labeler)
	if !ok || !pc.HasHardwareLabels() {
		return pc.Labels
	}
	labels := slices.Clone(pc.Labels)
	for _, h := range l.HardwareLabels() {
		if !slices.Contains(labels, h) {
			labels = append(labels, h)
		}
	}
	return labels
}

// inventory reads the host's GPUs once, when a pool first needs them (its
// runners get GPUs of their own, or its provider chooses by CUDA
// version): a CPU-only configuration never runs nvidia-smi.
func (f *Fleet) inventory() gpu.Inventory {
	f.gpuMu.Lock()
	defer f.gpuMu.Unlock()
	if f.Inventory != nil {
		return *f.Inventory
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	inv := gpu.Detect(ctx, f.Config.GPU.NvidiaSMI)
	inv.ShareVMGPUs = f.Config.GPU.AllowHostVGPU
	f.Inventory = &inv
	f.GPUs = gpu.NewAllocator(inv.Units())
	for id, why := range inv.Skipped {
		if !inv.ShareVMGPUs {
			f.log.Warn("GPU not handed out", "gpu", id, "why", why)
		}
	}
	switch {
	case inv.Error != "":
		f.log.Error("could not read this host's GPUs", "err", inv.Error, "source", inv.Source)
	case len(inv.GPUs) == 0:
		f.log.Warn("no GPU found", "reason", inv.Reason, "source", inv.Source)
	default:
		f.log.Info("GPUs found", "gpus", len(inv.GPUs), "units", f.GPUs.Len(), "driver", inv.Driver, "cuda", inv.CUDA, "source", inv.Source)
	}
	return inv
}

// poolGPUs returns how many of this host's GPUs each of a pool's runners
// gets (-1 all, 0 none): none where the provider's backend gives machines
// GPUs of its own (Slurm's gres), which it is told of in its PoolConfig.
func (f *Fleet) poolGPUs(pc *config.Pool, traits provider.Traits) (int, error) {
	switch {
	case pc.GPUsPerRunner == 0:
		return 0, nil
	case traits.SchedulesGPUs && pc.SizeFromGPUs && pc.Max == 0:
		return 0, fmt.Errorf("max: not given, and provider %s gives runners GPUs of its own nodes, which this host cannot count: give max, the most runners at once (size is 0: runners start as jobs queue)", pc.Provider)
	case traits.SchedulesGPUs && pc.SizeFromGPUs:
		// No idle runner holds a cluster's GPUs, and burns its
		// account's GPU-hours, unless the pool asks for one.
		pc.Size = 0
		return 0, nil
	case traits.SchedulesGPUs:
		return 0, nil
	case !traits.HostGPUs:
		return 0, fmt.Errorf("gpus_per_runner: provider %s cannot give runners this host's GPUs", pc.Provider)
	}
	return f.fitGPUs(pc)
}

// fitGPUs checks a pool's GPUs per runner against the host, and sizes a
// pool whose size comes from its GPUs. It returns the GPUs per runner for
// the pool (-1 all, 0 none).
func (f *Fleet) fitGPUs(pc *config.Pool) (int, error) {
	per := int(pc.GPUsPerRunner)
	if per == 0 {
		return 0, nil
	}
	inv := f.inventory()
	units := f.GPUs.Len()
	switch {
	case units == 0:
		return 0, fmt.Errorf("gpus_per_runner: %s, and this host has no GPU (%s)", gpusText(per), inv.Reason)
	case per > units:
		return 0, fmt.Errorf("gpus_per_runner: %d, and this host has %d GPUs", per, units)
	}
	fit := 1 // runners the GPUs allow at once
	if per > 0 {
		fit = units / per
	}
	switch {
	case pc.SizeFromGPUs:
		pc.Size = fit
		pc.Max = max(pc.Max, pc.Size)
		f.log.Info("pool sized by its GPUs", "pool", pc.Name, "size", pc.Size, "gpus_per_runner", gpusText(per))
	case pc.Max > fit:
		f.log.Warn("the pool asks for more runners than the GPUs allow; it runs at most what they allow", "pool", pc.Name, "max", pc.Max, "runners_the_gpus_allow", fit)
	}
	return per, nil
}

func gpusText(per int) string {
	if per < 0 {
		return "all"
	}
	return strconv.Itoa(per)
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

// Drain drains every pool at once, for up to timeout.
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
