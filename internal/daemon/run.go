package daemon

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/metrics"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider"
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
func (f *Fleet) Run(ctx context.Context) []pool.Runner { return f.RunLeader(ctx, nil) }

// standDownWait bounds how long a manager that lost its lease waits for
// its pools' passes to end before it returns: its successor may act once
// the lease expires, and the process exits after this anyway.
const standDownWait = 2 * time.Second

// RunLeader is Run for a manager that holds a lease: when lost is closed
// (the lease was lost) it stops at once, also mid-drain, and drains
// nothing: another manager now acts on the same fleet. The runners are
// left as they are, for it to adopt.
func (f *Fleet) RunLeader(ctx context.Context, lost <-chan struct{}) []pool.Runner {
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	f.mu.Lock()
	hist := f.Config.History
	f.mu.Unlock()
	f.openHistory(hist)
	defer f.closeHistory()
	// Prices are read until the history closes, the drain's runners
	// included.
	pctx, unprice := context.WithCancel(context.WithoutCancel(ctx))
	priced := make(chan struct{})
	go func() {
		defer close(priced)
		f.prices.Run(pctx)
	}()
	defer func() {
		unprice()
		<-priced
	}()
	f.mu.Lock()
	f.runCtx = runCtx
	cfg, npools := f.Config, len(f.Pools)
	for _, p := range f.Pools {
		f.startPool(p)
	}
	f.resumeOwed(runCtx)
	listened, _ := demanderPools(cfg, f.conns) // checked by New
	most := map[string]int{}
	for _, pc := range listened {
		most[pc.Name] = f.plans[pc.Name].Max
	}
	f.mu.Unlock()
	var wg sync.WaitGroup
	for forgeName, pc := range listened {
		d := f.conns[forgeName].(forge.Demander)
		wg.Go(func() { f.listen(runCtx, forgeName, d, pc.Name, most[pc.Name]) })
	}
	for _, fc := range cfg.Forges {
		if _, ok := listened[fc.Name]; ok || fc.PollOff {
			continue // the forge says itself what its pool needs
		}
		if _, ok := f.conns[fc.Name].(forge.JobLister); !ok {
			f.log.Warn("this forge's queue cannot be polled; pools scale on its webhooks only", "forge", fc.Name)
			continue
		}
		wg.Go(func() { f.poll(runCtx, fc.Name, fc.PollInterval.Duration) })
	}
	f.log.Info("runfleet started", "manager", cfg.ID, "pools", npools, "version", Version)
	f.acting.Store(actingYes)
	defer f.acting.Store(actingNot)
	select {
	case <-ctx.Done():
	case <-lost:
		f.acting.Store(actingNot)
		stop()
		f.standDown(&wg)
		return nil
	}
	f.acting.Store(actingDrain)
	stop()
	f.mu.Lock()
	for _, r := range f.runs {
		<-r.done
	}
	timeout := f.Config.DrainTimeout.Duration
	f.mu.Unlock()
	wg.Wait()
	defer f.Close()
	dctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-lost:
			f.log.Error("lease lost while draining: the drain stops, the next leader adopts what is left")
			cancel()
		case <-dctx.Done():
		}
	}()
	return f.Drain(dctx, timeout)
}

// standDown waits a little for the pools and polls to stop after their
// context was cancelled; their calls are cancelled with it.
func (f *Fleet) standDown(wg *sync.WaitGroup) {
	done := make(chan struct{})
	go func() {
		f.mu.Lock()
		runs := make([]*poolRun, 0, len(f.runs))
		for _, r := range f.runs {
			runs = append(runs, r)
		}
		f.mu.Unlock()
		for _, r := range runs {
			<-r.done
		}
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		// Another manager acts now: a re-run under way is its to make.
		stopped, cancel := context.WithCancel(context.Background())
		cancel()
		f.drainConns(stopped)
		f.Close()
	case <-time.After(standDownWait):
		f.log.Warn("stood down with passes still ending")
	}
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
	// A one-shot runner (`runfleet runner --single`) leaves none: its
	// job comes to the runner it started.
	if pc, ok := f.Config.Pool(p.Name()); ok && !pc.Single {
		if ph, ok := f.conns[pc.Forge].(forge.Placeholder); ok {
			go f.placehold(ctx, pc.Name, ph, slices.Sorted(slices.Values(f.plans[pc.Name].Runners.DemandLabels())))
		}
	}
}

// placehold keeps a pool's placeholder registration (forge.Placeholder)
// where the forge fails jobs that no registered runner could take,
// retrying from 1 s doubling to 5 minutes until it is there; an error no
// retry fixes is reported once.
func (f *Fleet) placehold(ctx context.Context, pool string, ph forge.Placeholder, labels []string) {
	wait := time.Second
	for {
		err := ph.Placehold(ctx, pool, labels)
		switch {
		case err == nil, ctx.Err() != nil:
			return
		case errors.Is(err, forge.ErrRejected):
			f.log.Error("the pool's placeholder registration was refused: its jobs fail while it has no runner", "pool", pool, "err", err)
			return
		}
		f.log.Warn("the pool's placeholder registration failed; retrying", "pool", pool, "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Minute)
	}
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
			if errors.Is(err, errors.ErrUnsupported) {
				log.Warn("this forge's queue cannot be polled; pools scale on its webhooks only", "why", err)
				return
			}
			backoff = min(max(2*backoff, time.Second), every)
			wait = backoff
			log.Warn("poll of queued jobs failed", "err", err, "retry_in", wait)
			f.pollFailed(forgeName, err, wait)
		} else {
			backoff = 0
			f.polls.Delete(forgeName)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// pollState is a forge's polls failing in a row, for the status page.
type pollState struct {
	err         error
	since, next time.Time
}

// pollFailed notes a failed poll of a forge's queue, and when the next is.
func (f *Fleet) pollFailed(forgeName string, err error, wait time.Duration) {
	now := time.Now()
	st := pollState{err: err, since: now, next: now.Add(wait)}
	if old, ok := f.polls.Load(forgeName); ok {
		st.since = old.(pollState).since
	}
	f.polls.Store(forgeName, st)
}

// PollOnce reads one forge's queued jobs into the demand tracker.
func (f *Fleet) PollOnce(ctx context.Context, forgeName string) error {
	lister, ok := f.conns[forgeName].(forge.JobLister)
	if !ok {
		return fmt.Errorf("forge %s: %w", forgeName, errors.ErrUnsupported)
	}
	listed := time.Now()
	jobs, err := lister.Jobs(ctx, forge.JobQueued)
	if errors.Is(err, errors.ErrUnsupported) {
		return err // not a failed poll: there is no queue to poll here
	}
	if err != nil {
		f.Metrics.Polls.WithLabelValues(forgeName, "error").Inc()
		return err
	}
	f.Metrics.Polls.WithLabelValues(forgeName, "ok").Inc()
	queued := make([]demand.Job, 0, len(jobs))
	for _, j := range jobs {
		queued = append(queued, demand.JobOf(forgeName, j))
	}
	f.Demand.Poll(forgeName, queued, listed)
	f.pollRunning(ctx, forgeName, lister)
	return nil
}

// pollRunning reads the forge's jobs in progress when a busy runner's job
// is unknown (no webhook named it), so that its record names the job. A
// failure is logged: the next poll asks again.
func (f *Fleet) pollRunning(ctx context.Context, forgeName string, lister forge.JobLister) {
	taken := f.Demand.Taken(forgeName)
	unknown := map[int64]bool{}
	for _, p := range f.pools() {
		if pc, ok := f.poolConfigOf(p.Name()); !ok || pc.Forge != forgeName {
			continue
		}
		for _, r := range p.Runners() {
			if r.State == pool.StateBusy && r.RunnerID != 0 && !taken[r.RunnerID] {
				unknown[r.RunnerID] = true
			}
		}
	}
	if len(unknown) == 0 {
		return
	}
	jobs, err := lister.Jobs(ctx, forge.JobInProgress)
	if err != nil {
		if !errors.Is(err, errors.ErrUnsupported) {
			f.log.Warn("could not read the jobs in progress for the history", "forge", forgeName, "err", err)
		}
		return
	}
	for _, j := range jobs {
		if unknown[j.RunnerID] {
			f.Demand.Observe(demand.JobOf(forgeName, j))
		}
	}
}

// poolConfigOf is the config of a pool by name.
func (f *Fleet) poolConfigOf(name string) (config.Pool, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.Config.Pool(name)
}

// jobChanged is told of every job that moved forward: it counts it and
// wakes the pool that serves it.
func (f *Fleet) jobChanged(e demand.Event) {
	// Whatever pool it matched: the history knows its runner.
	f.recordJob(e.Job)
	if e.Pool == "" {
		if !e.New || e.Job.Status != demand.Queued {
			return
		}
		// A forge whose jobs carry demands queues them for this
		// manager's agent pool: a job that none of its pools meets
		// waits for ever, and the user must hear of it. Elsewhere a job
		// may be another runner's (GitHub's hosted ones).
		if _, ok := f.conns[e.Job.Forge].(forge.DemandMatcher); ok {
			f.log.Warn("queued job: no pool meets its demands; it starts no runner", "forge", e.Job.Forge, "job", e.Job.ID, "name", e.Job.Name, "demands", e.Job.Labels)
		} else {
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
		if conclusion == forge.ConclusionTimedOut {
			f.rerunTimedOut(e)
		}
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

// demandPools describes the pools to the tracker: the labels their
// runners may register with (placement.Runners.DemandLabels) and the
// forge's implicit ones. A pool that could not be built is left out.
// Called with f.mu held, or before the fleet runs.
func (f *Fleet) demandPools(cfg *config.Config) []demand.Pool {
	var out []demand.Pool
	for _, pc := range cfg.Pools {
		plan, ok := f.plans[pc.Name]
		if !ok {
			continue
		}
		labels := plan.Runners.DemandLabels()
		if l, ok := f.conns[pc.Forge].(forge.Labeler); ok {
			labels = append(labels, l.ImplicitLabels()...)
		}
		dp := demand.Pool{Name: pc.Name, Forge: pc.Forge, Labels: labels}
		if m, ok := f.conns[pc.Forge].(forge.DemandMatcher); ok {
			dp.Meets = m.Meets
		}
		if pc.Dynamic != nil {
			dp.Meets = meetsDynamic(dp.Meets)
		}
		out = append(out, dp)
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
		for _, st := range []pool.State{pool.StateStarting, pool.StateIdle, pool.StateBusy, pool.StateStopping, pool.StateOrphan, pool.StateLost} {
			out = append(out, metrics.RunnerCount{Pool: p.Name(), State: string(st), N: n[st]})
		}
	}
	return out
}

// PoolBackoffs reports each pool's backoff, for the metrics.
func (f *Fleet) PoolBackoffs() []metrics.PoolBackoff {
	now := time.Now()
	var out []metrics.PoolBackoff
	for _, p := range f.pools() {
		b := p.Backoff()
		out = append(out, metrics.PoolBackoff{Pool: p.Name(), Failures: b.Failures, Seconds: max(b.Until.Sub(now).Seconds(), 0), Halted: b.Halted})
	}
	return out
}

// ProviderCalls reads what the pools' providers count, for the metrics.
func (f *Fleet) ProviderCalls() []metrics.ProviderCalls {
	var out []metrics.ProviderCalls
	for _, p := range f.pools() {
		f.mu.Lock()
		prov := f.Providers[p.Name()]
		f.mu.Unlock()
		if c, ok := prov.(provider.CallCounter); ok {
			out = append(out, metrics.ProviderCalls{Pool: p.Name(), Calls: c.Calls()})
		}
	}
	return out
}

// ForgeStats reads what the forge drivers count, for the metrics.
func (f *Fleet) ForgeStats() []metrics.ForgeStats {
	var out []metrics.ForgeStats
	for _, name := range slices.Sorted(maps.Keys(f.conns)) {
		st := metrics.ForgeStats{Forge: name, RateRemaining: -1}
		if r, ok := f.conns[name].(forge.StatsReporter); ok {
			s := r.Stats()
			st.Calls, st.RateRemaining = s.Calls, s.RateRemaining
		}
		out = append(out, st)
	}
	return out
}

// rerunTimedOut re-runs a job that hit its forge's time limit, when its
// pool says so (rerun_on_timeout), up to that many times: a job whose
// attempt is past it, or one of a pool without it, stays as it ended.
// The re-run is in the background; the tracker sees its job as a new one.
func (f *Fleet) rerunTimedOut(e demand.Event) {
	j := e.Job
	f.mu.Lock()
	most := 0
	for _, pc := range f.Config.Pools {
		if pc.Name == e.Pool {
			most = pc.RerunOnTimeout
		}
	}
	conn := f.conns[j.Forge]
	f.mu.Unlock()
	log := f.log.With("pool", e.Pool, "job", j.ID, "name", j.Name, "attempt", j.Attempt)
	r, ok := conn.(forge.JobRerunner)
	switch {
	case most == 0:
		log.Info("job hit its time limit; rerun_on_timeout is not set, so it stays as it ended")
		return
	case !ok:
		log.Warn("job hit its time limit; this forge cannot re-run one job")
		return
	case j.Attempt == 0 || j.Attempt > most:
		// An unknown attempt is never re-run: no loop without a bound.
		log.Warn("job hit its time limit again; rerun_on_timeout's re-runs are used up", "rerun_on_timeout", most)
		return
	}
	f.bg.Start(context.Background(), fmt.Sprintf("rerun %s %d", j.Forge, j.ID), func(ctx context.Context) {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := r.RerunJob(ctx, forge.Job{ID: j.ID, RunID: j.RunID, Name: j.Name, Attempt: j.Attempt}); err != nil {
			log.Error("could not re-run a job that hit its time limit", "err", err)
			return
		}
		log.Info("job hit its time limit; re-run", "rerun", j.Attempt, "of", most)
	})

}
