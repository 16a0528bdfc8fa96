package pool

import (
	"context"
	"maps"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// takeWatch is how often the output of a Cordoner forge's agents is read
// for the moment one takes a job. Bitbucket gives a runner its next step
// the moment its step ends unless it was disabled first, so the disable
// must land within the step's first seconds (the runner's setup of the
// build container and the clone), not at the next resync.
const takeWatch = 250 * time.Millisecond

// watchTakes cordons a runner and triggers a pass as soon as its agent's
// output says it took a job or finished it, for forges that must be told
// at once (forge.Cordoner) and providers whose output is a local file
// (provider.LocalOutput); elsewhere a pass every Resync reads the output,
// and a forge listing shows the job.
func (p *Pool) watchTakes(ctx context.Context) {
	_, cordons := p.forge.(forge.Cordoner)
	rep, ok := p.agent.(agent.Reporter)
	out, ok2 := p.prov.(provider.LocalOutput)
	if !cordons || !ok || !ok2 {
		return
	}
	seen := map[string]agent.Phase{} // by machine id
	t := time.NewTicker(takeWatch)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		p.mu.Lock()
		last := maps.Clone(p.last)
		p.mu.Unlock()
		took, live := false, map[string]bool{}
		for name, inst := range last {
			live[inst.ID] = true
			was, known := seen[inst.ID]
			if known && was != agent.PhaseReady && was != agent.PhaseUnknown {
				continue // busy or done already: nothing more to tell
			}
			ph := agent.PhaseUnknown
			if b := readOutput(ctx, out, inst); len(b) > 0 {
				ph = rep.Phase(b)
			}
			seen[inst.ID] = ph
			// A machine first seen busy took its job since the last
			// look too (a runner asks for one the moment it starts).
			if (!known || ph != was) && (ph == agent.PhaseBusy || ph == agent.PhaseDone) {
				took = true
				p.cordonTaken(ctx, name)
			}
		}
		maps.DeleteFunc(seen, func(id string, _ agent.Phase) bool { return !live[id] })
		if took {
			p.Trigger()
		}
	}
}

// cordonTaken cordons the registration of a slot whose agent just took a
// job, without waiting for a pass, unless the pool did already.
func (p *Pool) cordonTaken(ctx context.Context, name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.memory[name]
	// The registration a create made, until a listing shows it, is newer
	// than the one last listed with the slot's machine.
	id := p.registered[name]
	if id == 0 {
		id = m.regID
	}
	if id == 0 || m.cordoned == id {
		return
	}
	m.cordoned = id
	p.memory[name] = m
	p.cordon(ctx, name, id)
}
