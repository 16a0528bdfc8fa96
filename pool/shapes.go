package pool

import (
	"context"
	"maps"
	"slices"
	"time"

	"github.com/runfleet/runfleet/dynamic"
)

// A dynamic pool's jobs choose their machine in their labels (package
// dynamic): each distinct set of such labels is a shape, and the pool
// keeps, for each shape, as many runners idle or starting as queued jobs
// of that shape that no runner took, besides its size of runners of the
// pool's own shape (""). A runner of a shape registers with the shape's
// labels and gets what they ask for; a shape outside the pool's limits
// starts nothing and says why (Refusals).

// shaped is what a runner of a dynamic pool is made for: its shape and
// what the shape asks for; zero for a runner of the pool's own shape.
type shaped struct {
	shape string
	req   dynamic.Request
}

// holdMax bounds how long a runner waits for a queued job whose labels
// are fewer than its own to be taken (HoldBack).
const holdMax = 5 * time.Minute

// shapeOf is the shape of a slot's runner: the one it was made with, or,
// for a runner made before a restart, the one its registration's labels
// say. Called with p.mu held.
func (p *Pool) shapeOf(name string, s *slot) string {
	if s != nil && s.reg != nil && len(s.reg.Labels) > 0 {
		return dynamic.Shape(s.reg.Labels)
	}
	return p.shapes.Of(name)
}

// scaleShapes is scale for a dynamic pool. Called with p.mu held.
func (p *Pool) scaleShapes(ctx context.Context, snap snapshot, prev, view []Runner, n tally, now time.Time) []Runner {
	return p.sizeShapes(ctx, snap, view, p.shapeDemand(snap, prev, view, now), n, now)
}

// shapeDemand is, by shape, how many runners a dynamic pool wants idle
// or starting: its queued jobs that no runner of their shape took, and
// its size of the pool's own shape (""); a shape outside its limits
// wants none. Called with p.mu held.
func (p *Pool) shapeDemand(snap snapshot, prev, view []Runner, now time.Time) map[string]int {
	took := p.tookJob(snap, prev, view, now)
	byShape := map[string][]int64{}
	shapeOfReg := map[int64]string{}
	for _, r := range view {
		if r.RunnerID != 0 {
			shapeOfReg[r.RunnerID] = r.Shape
		}
	}
	for name, reg := range p.registered {
		shapeOfReg[reg] = p.shapes.Of(name)
	}
	for _, id := range took {
		byShape[shapeOfReg[id]] = append(byShape[shapeOfReg[id]], id)
	}
	want := p.cfg.Shapes(byShape)
	p.shapes.Asked(want) // a shape whose jobs left the queue is forgotten
	want[""] += p.cfg.Size
	for shape := range want {
		if shape == "" {
			continue
		}
		if _, err := p.resolve(shape); err != nil {
			delete(want, shape)
		}
	}
	return want
}

// sizeShapes retires and starts a dynamic pool's runners, by shape, to
// what its jobs want. Called with p.mu held.
func (p *Pool) sizeShapes(ctx context.Context, snap snapshot, view []Runner, want map[string]int, n tally, now time.Time) []Runner {
	// Each shape is sized as a pool of its own (plan), within the
	// pool's max: its idle runners above what its jobs need retired
	// first, then its runners started, in shape order, in the pool's
	// free names.
	idle := map[string][]int{} // by shape, indexes into view
	for i, r := range view {
		if r.State == StateIdle || r.State == StateStarting {
			idle[r.Shape] = append(idle[r.Shape], i)
		}
	}
	in := scaleInput{
		max: p.cfg.Max, draining: p.draining, idleTimeout: p.cfg.IdleTimeout, now: now,
		createAfter: p.backoff.Until, halted: p.backoff.Halted,
	}
	total := n.total
	left := map[string]int{} // by shape, idle or starting after the retirements
	for shape, is := range idle {
		sub := make([]Runner, len(is))
		for j, i := range is {
			sub[j] = view[i]
		}
		in.want = want[shape]
		retire, _ := plan(sub, len(sub), total, in)
		for _, j := range retire {
			s := snap.slots[sub[j].Name]
			p.retire(ctx, s.name, s.reg, s.inst, "idle above what its shape's jobs need")
			view[is[j]].State = StateStopping
		}
		left[shape] = len(is) - len(retire)
		total -= len(retire)
	}
	free := p.freeNames(snap, n)
	for _, shape := range slices.Sorted(maps.Keys(want)) {
		in.want = want[shape]
		_, start := plan(nil, left[shape], total, in)
		if start == 0 || shape != "" && !p.shapes.Ready(shape, now) {
			continue
		}
		req, _ := p.resolve(shape)
		for ; start > 0 && len(free) > 0; start-- {
			name := free[0]
			units, ok := p.takeGPUs(name, req)
			if !ok {
				break
			}
			if shape != "" && p.holdBack(shape, p.cfg.Runners.LabelsFor(units, shape), now) {
				p.cfg.Runners.Release(name)
				break
			}
			free = free[1:]
			p.shapes.Made(name, shape)
			p.create(ctx, name, units, shaped{shape, req})
			view = append(view, Runner{Name: name, Pool: p.cfg.Name, State: StateStarting, Shape: shape})
			total++
		}
	}
	return view
}

// resolve reads a shape, noting (and logging, once) why one is refused.
// Called with p.mu held.
func (p *Pool) resolve(shape string) (dynamic.Request, error) {
	if shape == "" {
		return dynamic.Request{}, nil
	}
	req, err := p.cfg.Resolve(shape)
	if err != nil {
		if p.shapes.Refuse(shape, err.Error()) {
			p.log.Warn("a job asks for what this pool does not allow; no runner starts for it", "labels", shape, "why", err)
		}
		return req, err
	}
	p.shapes.Allow(shape)
	return req, nil
}

// holdBack reports whether a shape's runner must wait: a queued job whose
// labels are fewer than the runner's could take it, and is let go first
// (at most holdMax). Called with p.mu held.
func (p *Pool) holdBack(shape string, labels []string, now time.Time) bool {
	if p.cfg.HoldBack == nil {
		return false
	}
	why, hold := p.cfg.HoldBack(labels, shape)
	if !hold {
		p.shapes.Unhold(shape)
		return false
	}
	since, first := p.shapes.Hold(shape, now)
	if first {
		p.log.Info("a runner waits: a queued job with fewer labels could take it", "labels", shape, "job", why)
		return true
	}
	if now.Sub(since) < holdMax {
		return true
	}
	p.log.Warn("a runner waited long enough for a job with fewer labels to be taken; starting it", "labels", shape, "job", why)
	return false
}

// shapeFailed backs off a shape whose runner failed to start or to take a
// job, and says so once a failure: the pool's other shapes, and its own,
// start as before. refused is the provider's refusal (no machine can be
// what the shape asks). Called with p.mu held.
func (p *Pool) shapeFailed(shape, reason string, refused bool, runner string) {
	wait := p.shapes.Failed(shape, reason, refused, p.now())
	p.noteShapes()
	p.log.Warn("a runner of a job's shape failed; that shape backs off, the pool's others start as before",
		"labels", shape, "runner", runner, "why", reason, "retry_in", wait)
}

// noteShapes keeps the shapes' backoffs in the pool's Backoff, which is
// saved for `runfleet status` (Config.OnBackoff). Called with p.mu held.
func (p *Pool) noteShapes() {
	if b := p.shapes.Backoffs(); !maps.Equal(b, p.backoff.Shapes) {
		p.backoff.Shapes = b
		p.backoffChanged = true
	}
}

// Refusals returns, by shape, why the pool starts no runner for jobs that
// ask for it.
func (p *Pool) Refusals() map[string]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shapes.Refusals()
}
