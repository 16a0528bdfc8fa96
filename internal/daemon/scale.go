package daemon

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/metrics"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/server"
)

// poolRun is one pool's reconcile loop, stopped and restarted on reload.
type poolRun struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// Run reconciles every pool and polls the forges' queues until ctx ends,
// then drains the pools: no new runners, idle ones removed with their
// registrations, busy ones awaited for up to the config's drain timeout.
// It returns the runners still left after that; busy runners are never
// killed.
func (f *Fleet) Run(ctx context.Context) []pool.Runner {
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	f.mu.Lock()
	f.runCtx = runCtx
	cfg, npools := f.Config, len(f.Pools)
	for _, p := range f.Pools {
		f.startPool(p)
	}
	f.mu.Unlock()
	var wg sync.WaitGroup
	for _, fc := range cfg.Forges {
		if l, ok := f.drivers[fc.Name].(interface{ ListsJobs() bool }); ok && !l.ListsJobs() && !fc.PollOff {
			f.log.Warn("this forge's queue cannot be polled (GitHub lists queued jobs per repository); pools scale on its webhooks only", "forge", fc.Name)
			continue
		}
		if !fc.PollOff {
			wg.Go(func() { f.poll(runCtx, fc.Name, fc.PollInterval.Duration) })
		}
	}
	f.log.Info("runfleet started", "manager", cfg.ID, "pools", npools, "version", Version)
	<-ctx.Done()
	stop()
	f.mu.Lock()
	for _, r := range f.runs {
		<-r.done
	}
	timeout := f.Config.DrainTimeout.Duration
	f.mu.Unlock()
	wg.Wait()
	defer f.Close()
	return f.Drain(context.Background(), timeout)
}

// startPool starts a pool's loop. Called with f.mu held.
func (f *Fleet) startPool(p *pool.Pool) {
	ctx, cancel := context.WithCancel(f.runCtx)
	r := &poolRun{cancel: cancel, done: make(chan struct{})}
	f.runs[p.Name()] = r
	go func() {
		defer close(r.done)
		p.Run(ctx)
	}()
}

// poll reads a forge's queue every interval, so that a job whose webhook
// was lost still gets a runner. Failed polls are retried with backoff.
func (f *Fleet) poll(ctx context.Context, forgeName string, every time.Duration) {
	log := f.log.With("forge", forgeName)
	backoff := time.Duration(0)
	for {
		wait := every
		if err := f.PollOnce(ctx, forgeName); err != nil {
			if ctx.Err() != nil {
				return
			}
			backoff = min(max(2*backoff, time.Second), every)
			wait = backoff
			log.Warn("poll of queued jobs failed", "err", err, "retry_in", wait)
		} else {
			backoff = 0
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// PollOnce reads one forge's queued jobs into the demand tracker.
func (f *Fleet) PollOnce(ctx context.Context, forgeName string) error {
	fd := f.drivers[forgeName]
	listed := time.Now()
	jobs, err := fd.Jobs(ctx, "queued")
	if err != nil {
		f.Metrics.Polls.WithLabelValues(forgeName, "error").Inc()
		return err
	}
	f.Metrics.Polls.WithLabelValues(forgeName, "ok").Inc()
	queued := make([]demand.Job, 0, len(jobs))
	for _, j := range jobs {
		queued = append(queued, demand.Job{ID: j.ID, RunID: j.RunID, Name: j.Name, Labels: j.Labels, Queued: server.Time(j.CreatedAt)})
	}
	f.Demand.Poll(forgeName, queued, listed)
	return nil
}

// jobChanged is told of every job that moved forward: it counts it and
// wakes the pool that serves it.
func (f *Fleet) jobChanged(e demand.Event) {
	if e.Pool == "" {
		if e.New && e.Job.Status == demand.Queued {
			f.log.Debug("queued job matches no pool", "forge", e.Job.Forge, "job", e.Job.ID, "labels", e.Job.Labels)
		}
		return
	}
	j := e.Job
	switch {
	case j.Status == demand.Queued:
		f.log.Info("job queued", "pool", e.Pool, "job", j.ID, "name", j.Name)
	case j.Status >= demand.InProgress && e.From <= demand.Queued:
		f.Metrics.JobsStarted.WithLabelValues(e.Pool).Inc()
		if start := j.Started; !start.IsZero() && !j.Queued.IsZero() && start.After(j.Queued) {
			f.Metrics.JobWait.WithLabelValues(e.Pool).Observe(start.Sub(j.Queued).Seconds())
		}
	}
	if j.Status == demand.Completed {
		conclusion := j.Conclusion
		if conclusion == "" {
			conclusion = "unknown"
		}
		f.Metrics.JobsCompleted.WithLabelValues(e.Pool, conclusion).Inc()
	}
	for _, p := range f.pools() {
		if p.Name() == e.Pool {
			p.Trigger()
		}
	}
}

func (f *Fleet) pools() []*pool.Pool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.Pools)
}

// implicitLabels are the labels a forge gives every runner of ours, which
// jobs name in runs-on without a pool listing them.
func implicitLabels(forgeType string) []string {
	if forgeType == "github" {
		return []string{"self-hosted", "linux", "x64"}
	}
	return nil
}

// demandPools describes the pools to the tracker: their labels, the
// forge's implicit ones, and the hardware labels their runners may get.
func (f *Fleet) demandPools(cfg *config.Config) []demand.Pool {
	var out []demand.Pool
	for _, pc := range cfg.Pools {
		fc, _ := cfg.Forge(pc.Forge)
		labels := slices.Concat(pc.Labels, implicitLabels(fc.Type))
		if pc.GPUsPerRunner != 0 && pc.HasHardwareLabels() && f.GPUs != nil {
			units := f.GPUs.Units()
			for i := range units {
				labels = append(labels, gpu.Labels(units[i:i+1], f.Inventory.CUDA)...)
			}
			n := len(units)
			if pc.GPUsPerRunner > 0 {
				n = int(pc.GPUsPerRunner)
			}
			labels = append(labels, fmt.Sprintf("gpus-%d", n))
		}
		out = append(out, demand.Pool{Name: pc.Name, Forge: pc.Forge, Labels: labels})
	}
	return out
}

// RunnerCounts counts the pools' runners by state, for the metrics.
func (f *Fleet) RunnerCounts() []metrics.RunnerCount {
	var out []metrics.RunnerCount
	for _, p := range f.pools() {
		n := map[pool.State]int{}
		for _, r := range p.Runners() {
			n[r.State]++
		}
		for _, st := range []pool.State{pool.StateStarting, pool.StateIdle, pool.StateBusy, pool.StateStopping, pool.StateOrphan} {
			out = append(out, metrics.RunnerCount{Pool: p.Name(), State: string(st), N: n[st]})
		}
	}
	return out
}

// ForgeStats reads what the forge drivers count, for the metrics.
func (f *Fleet) ForgeStats() []metrics.ForgeStats {
	var out []metrics.ForgeStats
	for _, name := range slices.Sorted(maps.Keys(f.drivers)) {
		st := metrics.ForgeStats{Forge: name, RateRemaining: -1}
		if c, ok := f.drivers[name].(interface{ Calls() int64 }); ok {
			st.Calls = c.Calls()
		}
		if r, ok := f.drivers[name].(interface{ RateRemaining() int64 }); ok {
			st.RateRemaining = r.RateRemaining()
		}
		out = append(out, st)
	}
	return out
}

// Handler is the manager's HTTP server: webhooks, metrics, health and the
// status page.
func (f *Fleet) Handler() http.Handler {
	hooks := map[string]server.Hook{}
	for _, fc := range f.Config.Forges {
		hooks[fc.Name] = server.Hook{Type: fc.Type, Secret: []byte(fc.WebhookSecret.Reveal())}
	}
	return server.New(server.Config{
		Hooks:   hooks,
		Report:  f.Demand.Observe,
		Metrics: f.Metrics,
		Page:    f.Page,
		Healthy: f.healthy,
		Logger:  f.log.With("component", "server"),
	})
}

// healthy fails when every pool's last pass failed: the manager cannot
// reach its forge or its provider.
func (f *Fleet) healthy() error {
	ps := f.pools()
	var errs []error
	for _, p := range ps {
		if err := p.LastError(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(ps) > 0 && len(errs) == len(ps) {
		return errors.Join(errs...)
	}
	return nil
}

// Page gathers the status page from what the manager already knows (the
// pools' last passes, the jobs reported): it makes no forge call.
func (f *Fleet) Page(ctx context.Context) server.Page {
	now := time.Now()
	f.mu.Lock()
	cfg, inventory, alloc := f.Config, f.Inventory, f.GPUs
	f.mu.Unlock()
	page := server.Page{Manager: cfg.ID, Version: Version, Now: now}
	jobs := f.Demand.Recent(30)
	byRunner := map[string]demand.JobView{}
	for _, j := range jobs {
		if j.Status == demand.InProgress && j.Runner != "" {
			byRunner[j.Runner] = j
		}
	}
	queued := f.Demand.Queued()
	for _, p := range f.pools() {
		pc, _ := cfg.Pool(p.Name())
		pv := server.PoolView{Name: p.Name(), Forge: pc.Forge, Provider: pc.Provider, Size: pc.Size, Max: pc.Max, Queued: queued[p.Name()]}
		if err := p.LastError(); err != nil {
			pv.Error = err.Error()
		}
		for _, r := range p.Runners() {
			row := server.RunnerRow{Name: r.Name, State: string(r.State), Age: "-", GPUs: strings.Join(r.GPUs, ", ")}
			if !r.Created.IsZero() {
				row.Age = now.Sub(r.Created).Round(time.Second).String()
			}
			if j, ok := byRunner[r.Name]; ok {
				row.Job = j.Name
			}
			pv.GPUs = pv.GPUs || len(r.GPUs) > 0
			pv.Runners = append(pv.Runners, row)
		}
		page.Pools = append(page.Pools, pv)
	}
	if inventory != nil {
		inv := *inventory
		gv := &server.GPUView{Summary: fmt.Sprintf("driver %s, CUDA %s, %d GPUs (%s)", inv.Driver, inv.CUDA, len(inv.GPUs), inv.Source)}
		if len(inv.GPUs) == 0 {
			gv.Summary = "no GPU: " + inv.Reason
		}
		holders := map[string]string{}
		if alloc != nil {
			for runner, ids := range alloc.Holders() {
				for _, id := range ids {
					holders[id] = runner
				}
			}
		}
		for _, u := range inv.Units() {
			row := server.GPURow{Index: fmt.Sprint(u.Device.Index), ID: u.ID, Name: u.Device.Name, Memory: fmt.Sprintf("%.0f GiB", float64(u.Device.MemoryMiB)/1024), Runner: holders[u.ID]}
			if u.MIG != nil {
				row.Index = fmt.Sprintf("%d:%d", u.Device.Index, u.MIG.Index)
				row.Name += " MIG " + u.MIG.Profile
				row.Memory = fmt.Sprintf("%.0f GiB", float64(u.MIG.MemoryMiB)/1024)
			}
			if row.Runner == "" {
				row.Runner = "-"
			}
			gv.Units = append(gv.Units, row)
		}
		page.GPUs = gv
	}
	for _, j := range jobs {
		row := server.JobRow{Name: j.Name, Pool: j.Pool, Status: j.Status.String(), Conclusion: j.Conclusion, Runner: j.Runner, Wait: "-", Duration: "-"}
		if row.Name == "" {
			row.Name = fmt.Sprintf("job %d", j.ID)
		}
		if !j.Started.IsZero() && !j.Queued.IsZero() {
			row.Wait = j.Started.Sub(j.Queued).Round(time.Second).String()
		}
		switch {
		case !j.Completed.IsZero() && !j.Started.IsZero():
			row.Duration = j.Completed.Sub(j.Started).Round(time.Second).String()
		case j.Status == demand.InProgress && !j.Started.IsZero():
			row.Duration = now.Sub(j.Started).Round(time.Second).String() + " so far"
		}
		page.Jobs = append(page.Jobs, row)
	}
	return page
}

// Reload applies a new config without touching busy runners: each pool's
// loop is paused (its operations in flight finish), given its new size,
// max, timeouts, labels and environment, and resumed; new pools start;
// removed pools drain in the background (idle runners go, busy ones
// finish their jobs). Changes that need a restart (forges, a pool's
// provider, agent, container or GPU settings, the manager id, the state
// directory) are refused as a whole: the running config stays.
func (f *Fleet) Reload(cfg *config.Config) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := f.Config
	if err := restartNeeded(old, cfg, f.written); err != nil {
		return err
	}
	byName := map[string]*pool.Pool{}
	for _, p := range f.Pools {
		byName[p.Name()] = p
	}
	var next []*pool.Pool
	var errs []error
	f.Config = cfg
	f.detectGPUs(cfg)
	for i := range cfg.Pools {
		pc := &cfg.Pools[i]
		if p, ok := byName[pc.Name]; ok {
			delete(byName, pc.Name)
			prev, _ := old.Pool(pc.Name)
			if pc.SizeFromGPUs { // as sized at start
				pc.Size, pc.Max = prev.Size, max(pc.Max, prev.Size)
			}
			if prev.Docker != nil {
				pc.Docker = prev.Docker // the image chosen at start
			}
			if reflect.DeepEqual(prev, *pc) {
				next = append(next, p)
				continue
			}
			pcfg := f.poolConfig(*pc)
			if r, ok := f.runs[pc.Name]; ok {
				r.cancel()
				<-r.done
				p.Wait()
				p.Update(pcfg)
				f.startPool(p)
			} else {
				p.Update(pcfg)
			}
			f.log.Info("pool reloaded", "pool", pc.Name, "size", pc.Size, "max", pc.Max)
			next = append(next, p)
			continue
		}
		p, err := f.buildPool(pc)
		if err != nil {
			errs = append(errs, fmt.Errorf("pools[%d]: %w", i, err))
			continue
		}
		next = append(next, p)
		if f.runCtx != nil {
			f.startPool(p)
		}
		f.log.Info("pool added", "pool", pc.Name)
	}
	for name, p := range byName {
		if r, ok := f.runs[name]; ok {
			r.cancel()
			delete(f.runs, name)
			go func() {
				<-r.done
				left := p.Drain(context.Background())
				f.log.Info("removed pool drained", "pool", name, "left", len(left))
			}()
		}
		f.log.Info("pool removed: draining it", "pool", name)
	}
	f.Pools = next
	f.Demand.SetPools(f.demandPools(cfg))
	return errors.Join(errs...)
}

// restartNeeded refuses a reload that changes what only a restart can.
func restartNeeded(old, cfg *config.Config, written map[string]*config.Docker) error {
	var why []string
	if old.ID != cfg.ID || old.StateDir != cfg.StateDir {
		why = append(why, "id or state_dir")
	}
	if old.Listen != cfg.Listen {
		why = append(why, "listen")
	}
	if !reflect.DeepEqual(old.Forges, cfg.Forges) {
		why = append(why, "forges")
	}
	for _, pc := range cfg.Pools {
		prev, ok := old.Pool(pc.Name)
		if !ok {
			continue
		}
		if prev.Forge != pc.Forge || prev.Provider != pc.Provider || prev.Workdir != pc.Workdir ||
			!reflect.DeepEqual(prev.Agent, pc.Agent) || prev.GPUsPerRunner != pc.GPUsPerRunner ||
			!reflect.DeepEqual(prev.HardwareLabels, pc.HardwareLabels) || !reflect.DeepEqual(written[pc.Name], pc.Docker) {
			why = append(why, "pool "+pc.Name+"'s forge, provider, workdir, agent, docker or GPU settings")
		}
	}
	if len(why) > 0 {
		return fmt.Errorf("reload refused: %s changed; restart runfleet to apply that", strings.Join(why, ", "))
	}
	return nil
}
