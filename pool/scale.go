package pool

import (
	"cmp"
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/dynamic"
)

// scaleInput is what plan needs to size the pool.
type scaleInput struct {
	// want is how many runners should be idle or starting: the pool's
	// size plus its queued jobs that no runner has taken.
	want        int
	max, size   int
	created     int // runners started so far, for once
	once        bool
	draining    bool
	idleTimeout time.Duration
	now         time.Time
	createAfter time.Time // no start before this (backoff)
	halted      bool      // no start at all: the forge refused the request
}

// plan decides how the pool's size changes, from a pass's view, in which
// idle counts the runners idle or starting and total those that count
// against max. It returns which idle runners above the wanted number go
// (indexes into view: those idle for the idle timeout, first in name
// order), and how many runners to start. It is pure.
func plan(view []Runner, idle, total int, in scaleInput) (retire []int, start int) {
	if !in.draining {
		for i, r := range view {
			if idle <= in.want {
				break
			}
			// Idle for the idle timeout, not merely older: a runner that
			// just came online is about to take the job it was started
			// for, which the forge may not have reported yet.
			if r.State == StateIdle && !r.IdleSince.IsZero() && in.now.Sub(r.IdleSince) >= in.idleTimeout {
				retire = append(retire, i)
				idle--
				total--
			}
		}
	}
	start = min(in.want-idle, in.max-total)
	if in.once {
		start = min(start, in.size-in.created)
	}
	if in.draining || in.halted || in.now.Before(in.createAfter) {
		return retire, 0
	}
	return retire, max(start, 0)
}

// scale keeps Size runners idle, plus one for each queued job matched to
// the pool that no runner has taken yet, within Max: it retires idle
// runners above that and starts runners below it. It returns the view
// with the runners it started, as starting: the next pass must know that
// they were, or one that takes a job before that pass reads would never
// have been seen starting (tookJob). Called with p.mu held.
func (p *Pool) scale(ctx context.Context, snap snapshot, prev, view []Runner, n tally, now time.Time) []Runner {
	if p.cfg.Shapes != nil && !p.cfg.Once {
		return p.scaleShapes(ctx, snap, prev, view, n, now)
	}
	in := scaleInput{
		want: p.cfg.Size, max: p.cfg.Max, size: p.cfg.Size, created: p.created, once: p.cfg.Once,
		draining: p.draining, idleTimeout: p.cfg.IdleTimeout, now: now, createAfter: p.backoff.Until, halted: p.backoff.Halted,
	}
	if p.cfg.Demand != nil && !p.cfg.Once {
		took := p.tookJob(snap, prev, view, now)
		demand := max(p.cfg.Demand(took), 0)
		in.want += demand
		if demand > 0 || len(took) > 0 {
			p.log.Debug("demand", "queued_unserved", demand, "took_job_lately", took, "idle_or_starting", n.idle, "total", n.total)
		}
	}
	retire, start := plan(view, n.idle, n.total, in)
	for _, i := range retire {
		s := snap.slots[view[i].Name]
		p.retire(ctx, s.name, s.reg, s.inst, "idle above pool size")
		view[i].State = StateStopping
	}
	free := p.freeNames(snap, n)
	for _, name := range free[:min(start, len(free))] {
		units, ok := p.takeGPUs(name, dynamic.Request{})
		if !ok {
			break
		}
		p.create(ctx, name, units, shaped{})
		view = append(view, Runner{Name: name, Pool: p.cfg.Name, State: StateStarting})
	}
	return view
}

// freeNames are the slots a runner may start in, in order. Names come
// from the fixed set <pool>-1 .. <pool>-<max>; a name is reused once its
// runner is gone from both the provider and the forge. A busy runner
// whose machine is being taken back still holds its name, so its
// replacement takes one beyond max. Called with p.mu held.
func (p *Pool) freeNames(snap snapshot, n tally) []string {
	var out []string
	for i := 1; i <= p.cfg.Max+n.taken; i++ {
		name := p.cfg.Name + "-" + strconv.Itoa(i)
		if _, used := snap.slots[name]; used {
			continue
		}
		if _, used := p.inflight(name, snap.since); used {
			continue
		}
		out = append(out, name)
	}
	return out
}

// tookJob returns the registrations of the runners seen to take a job
// within TookWindow: to go from idle or starting to busy, or straight to
// done between two passes. A runner stays listed for the window after its
// job ends: the forge's report of the job can come later still (Gitea's
// webhooks lag behind one-second jobs under load), and until it comes the
// job counts as queued. Called with p.mu held.
func (p *Pool) tookJob(snap snapshot, prev, view []Runner, now time.Time) []int64 {
	was := map[string]Runner{}
	for _, r := range prev {
		was[r.Name] = r
	}
	for _, r := range view {
		before := was[r.Name]
		if before.State != StateIdle && before.State != StateStarting {
			continue
		}
		// A runner that ran its job between two passes may be listed
		// without its registration, which the forge deleted with the
		// job: it is the one the last pass saw, or, if no listing ever
		// showed it, the one its create made.
		id := cmp.Or(r.RunnerID, before.RunnerID, p.registered[r.Name])
		if id == 0 || !p.took[id].IsZero() {
			continue
		}
		ph := agent.PhaseUnknown
		if s, ok := snap.slots[r.Name]; ok {
			ph = s.phase
		}
		if r.State == StateBusy || ph == agent.PhaseBusy || ph == agent.PhaseDone {
			p.took[id] = now
		}
	}
	var out []int64
	for id, at := range p.took {
		if now.Sub(at) > p.cfg.TookWindow {
			delete(p.took, id)
			continue
		}
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}
