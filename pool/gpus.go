package pool

import (
	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
)

// takeGPUs takes the GPUs of a runner about to start (the pool's number,
// or what its shape asks for); ok is false when they are all taken. A
// pool whose runners get no GPUs of their own takes none. Called with
// p.mu held.
func (p *Pool) takeGPUs(name string, req dynamic.Request) (units []gpu.Unit, ok bool) {
	units, err := p.cfg.Runners.Take(name, req)
	if err != nil {
		p.log.Debug("no runner started: its GPUs are taken", "runner", name, "err", err)
		return nil, false
	}
	return units, true
}

// syncGPUs makes the GPU allocator agree with the machines listed
// (placement.Runners.Sync): a slot whose machine is gone frees its GPUs
// unless an operation on it is in flight. Called with p.mu held.
func (p *Pool) syncGPUs(snap snapshot) {
	if p.cfg.Runners.GPUs == nil {
		return // every pass of a pool without this host's GPUs
	}
	running := map[string][]string{}
	for _, s := range snap.slots {
		if s.inst != nil {
			running[s.name] = s.inst.GPUs
		}
	}
	busy := func(name string) bool {
		_, busy := p.inflight(name, snap.since)
		return busy
	}
	for runner, gpus := range p.cfg.Runners.Sync(running, p.Owns, busy) {
		p.log.Error("runner holds GPUs that another runner holds, or that this host lacks", "runner", runner, "gpus", gpus)
	}
}
