package pool

import (
	"context"
	"maps"
	"slices"
	"strconv"
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
	return p.shapes[name]
}

// scaleShapes is scale for a dynamic pool. Called with p.mu held.
func (p *Pool) scaleShapes(ctx context.Context, snap snapshot, prev, view []Runner, n tally, now time.Time) []Runner {
	took := p.tookJob(snap, prev, view, now)
	byShape := map[string][]int64{}
	shapeOfReg := map[int64]string{}
	for _, r := range view {
		if r.RunnerID != 0 {
			shapeOfReg[r.RunnerID] = r.Shape
		}
	}
	for name, reg := range p.registered {
		shapeOfReg[reg] = p.shapes[name]
	}
	for _, id := range took {
		byShape[shapeOfReg[id]] = append(byShape[shapeOfReg[id]], id)
	}
	want := p.cfg.Shapes(byShape)
	for shape := range p.refusals {
		if _, asked := want[shape]; !asked {
			delete(p.refusals, shape) // its jobs left the queue
		}
	}
	want[""] += p.cfg.Size
	for shape := range want {
		if shape == "" {
			continue
		}
		if _, err := p.resolve(shape); err != nil {
			delete(want, shape)
		}
	}
	// Idle or starting runners of each shape.
	idle := map[string][]int{}
	for i, r := range view {
		if r.State == StateIdle || r.State == StateStarting {
			idle[r.Shape] = append(idle[r.Shape], i)
		}
	}
	total := n.total
	if !p.draining {
		for shape, is := range idle {
			extra := len(is) - want[shape]
			for _, i := range is {
				r := view[i]
				if extra <= 0 {
					break
				}
				if r.State == StateIdle && !r.IdleSince.IsZero() && now.Sub(r.IdleSince) >= p.cfg.IdleTimeout {
					s := snap.slots[r.Name]
					p.retire(ctx, s.name, s.reg, s.inst, "idle above what its shape's jobs need")
					view[i].State = StateStopping
					extra--
					total--
				}
			}
		}
	}
	if p.draining || p.backoff.Halted || now.Before(p.backoff.Until) {
		return view
	}
	next := 1
	for _, shape := range slices.Sorted(maps.Keys(want)) {
		start := min(want[shape]-len(idle[shape]), p.cfg.Max-total)
		if start <= 0 {
			continue
		}
		req, _ := p.resolve(shape)
		for ; start > 0 && next <= p.cfg.Max+n.taken; next++ {
			name := p.cfg.Name + "-" + strconv.Itoa(next)
			if _, used := snap.slots[name]; used {
				continue
			}
			if _, used := p.inflight(name, snap.since); used {
				continue
			}
			units, ok := p.takeGPUs(name, req)
			if !ok {
				break
			}
			if shape != "" && p.holdBack(shape, p.cfg.Runners.LabelsFor(units, shape), now) {
				p.cfg.Runners.Release(name)
				break
			}
			p.shapes[name] = shape
			p.create(ctx, name, units, shaped{shape, req})
			view = append(view, Runner{Name: name, Pool: p.cfg.Name, State: StateStarting, Shape: shape})
			start--
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
		if _, told := p.refusals[shape]; !told {
			p.log.Warn("a job asks for what this pool does not allow; no runner starts for it", "labels", shape, "why", err)
		}
		p.refusals[shape] = err.Error()
		return req, err
	}
	delete(p.refusals, shape)
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
		delete(p.held, shape)
		return false
	}
	since, ok := p.held[shape]
	if !ok {
		p.held[shape] = now
		p.log.Info("a runner waits: a queued job with fewer labels could take it", "labels", shape, "job", why)
		return true
	}
	if now.Sub(since) < holdMax {
		return true
	}
	p.log.Warn("a runner waited long enough for a job with fewer labels to be taken; starting it", "labels", shape, "job", why)
	return false
}

// Refusals returns, by shape, why the pool starts no runner for jobs that
// ask for it.
func (p *Pool) Refusals() map[string]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.refusals)
}
