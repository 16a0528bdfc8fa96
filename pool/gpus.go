package pool

import (
	"slices"

	"github.com/runfleet/runfleet/gpu"
)

// takeGPUs takes the GPUs of a runner about to start; ok is false when
// they are all taken. A pool whose runners get no GPUs of their own takes
// none. Called with p.mu held.
func (p *Pool) takeGPUs(name string) (units []gpu.Unit, ok bool) {
	if p.cfg.GPUs == nil {
		return nil, true
	}
	units, err := p.cfg.GPUs.Take(name, p.cfg.GPUsPerRunner)
	if err != nil {
		p.log.Debug("no runner started: its GPUs are taken", "runner", name, "err", err)
		return nil, false
	}
	return units, true
}

// releaseGPUs frees the GPUs of a runner that did not start. Called with
// p.mu held.
func (p *Pool) releaseGPUs(name string) {
	if p.cfg.GPUs != nil {
		p.cfg.GPUs.Release(name)
	}
}

// labels are the pool's labels and, with hardware labels, those that
// describe the runner's GPUs.
func (p *Pool) labels(units []gpu.Unit) []string {
	if !p.cfg.HardwareLabels {
		return p.cfg.Labels
	}
	labels := slices.Clone(p.cfg.Labels)
	for _, l := range gpu.Labels(units, p.cfg.CUDA) {
		if !slices.Contains(labels, l) {
			labels = append(labels, l)
		}
	}
	return labels
}

// syncGPUs makes the GPU allocator agree with the machines listed: a
// running machine holds the GPUs it was given (which, after a restart, is
// how the allocator learns them), and a slot whose machine is gone frees
// its GPUs, unless an operation on it is in flight. Called with p.mu held.
func (p *Pool) syncGPUs(snap snapshot) {
	if p.cfg.GPUs == nil {
		return
	}
	for _, s := range snap.slots {
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
		if s, ok := snap.slots[holder]; ok && s.inst != nil {
			continue
		}
		if _, busy := p.inflight(holder, snap.since); busy {
			continue
		}
		p.cfg.GPUs.Release(holder)
	}
}
