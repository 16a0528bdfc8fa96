package pool

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// slot is what a pass read of one slot, and what it decided.
type slot struct {
	name  string
	inst  *provider.Instance
	reg   *forge.Runner
	phase agent.Phase
	// output is the end of its agent's output, when the provider keeps
	// it.
	output []byte
	// notice is the machine whose notice alone keeps the slot: it was
	// taken back and is listed no more.
	notice string
	// unregistered is set for a runner whose agent was to register
	// itself and that no listing has shown registered yet.
	unregistered bool
	// verdict is set when the pass classified the slot (none is in
	// flight on it).
	verdict    verdict
	classified bool
}

// snapshot is what one pass read: the pool's slots, each with its machine
// and registration as listed.
type snapshot struct {
	since uint64 // the epoch at which listing began
	slots map[string]*slot
	order []string // the slots' names, sorted
	// duplicates are older registrations of a name that has two: only a
	// crash between register and record can make that.
	duplicates []forge.Runner
}

// outputTail is how much of an agent's output is read for its phase.
const outputTail = 32 << 10

// read lists the machines and the registrations, and reads the agents'
// output. Reconcile records how many machines the pool has (act).
// machineEnded reports whether a machine of the last pass's view is not in this
// listing, or is listed ended (an instance stopping once its agent
// exited), while no runner of the pool has yet been seen to serve: only
// that question needs a fresher listing than the driver keeps, and a pool
// that has served pays no extra call per ended machine.
func (p *Pool) machineEnded(snap snapshot) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.served {
		return false
	}
	for _, r := range p.view {
		s, ok := snap.slots[r.Name]
		if r.Machine != "" && (!ok || s.inst == nil || s.inst.ID != r.Machine || s.inst.State == provider.StateExited) {
			return true
		}
	}
	return false
}

func (p *Pool) read(ctx context.Context, act bool) (snapshot, error) {
	p.mu.Lock()
	since := p.epoch
	p.mu.Unlock()
	insts, err := p.prov.List(ctx, p.cfg.Manager)
	if err != nil {
		return snapshot{}, fmt.Errorf("pool %s: list machines: %w", p.cfg.Name, err)
	}
	snap := snapshot{since: since, slots: map[string]*slot{}}
	for i := range insts {
		if insts[i].Pool == p.cfg.Name && p.Owns(insts[i].Name) {
			snap.get(insts[i].Name).inst = &insts[i]
		}
	}
	if act {
		p.mu.Lock()
		p.machines = len(snap.slots)
		p.mu.Unlock()
	}
	if r, ok := p.forge.(forge.Refresher); act && p.machineEnded(snap) && ok {
		// What its agent did before the machine ended may be newer
		// than the driver's kept listing: it came online, took a job.
		r.Refresh()
	}
	regs, err := p.forge.Runners(ctx)
	if err != nil {
		return snapshot{}, fmt.Errorf("pool %s: %w", p.cfg.Name, err)
	}
	for i := range regs {
		if !p.Owns(regs[i].Name) {
			continue
		}
		s := snap.get(regs[i].Name)
		switch {
		case s.reg == nil:
			s.reg = &regs[i]
		case s.reg.ID > regs[i].ID: // keep the newer
			snap.duplicates = append(snap.duplicates, regs[i])
		default:
			snap.duplicates = append(snap.duplicates, *s.reg)
			s.reg = &regs[i]
		}
	}
	// A machine taken back and deleted by its cloud at once (Azure's
	// Spot VMs), its registration gone too (an ephemeral one the forge
	// dropped with its job), leaves nothing listed: its notice keeps the
	// slot, so that the pass reports its job lost.
	p.mu.Lock()
	for id, n := range p.preempted {
		if _, ok := snap.slots[n.Name]; !ok && p.Owns(n.Name) {
			snap.get(n.Name).notice = id
		}
	}
	// A runner whose agent was to register itself and whose machine is
	// gone (a container removed when it exited) before any registration
	// was listed leaves nothing listed either: its slot is kept for one
	// pass, so that its last output tells whether it failed to start.
	for name := range p.unregistered {
		_, listed := snap.slots[name]
		_, starting := p.inflight(name, since)
		if !listed && !starting && p.last[name].ID != "" && p.done[name].op != opRemove {
			snap.get(name)
		}
	}
	for name, s := range snap.slots {
		s.unregistered = s.reg == nil && p.unregistered[name]
	}
	p.mu.Unlock()
	snap.order = slices.Sorted(maps.Keys(snap.slots))
	p.readPhases(ctx, snap)
	return snap, nil
}

func (s snapshot) get(name string) *slot {
	sl, ok := s.slots[name]
	if !ok {
		sl = &slot{name: name}
		s.slots[name] = sl
	}
	return sl
}

// readPhases reads what the agents' output says, for agents that tell and
// providers that keep it: of each slot's machine, or of its last machine
// seen, whose output outlives it (a container removed when it exits).
func (p *Pool) readPhases(ctx context.Context, snap snapshot) {
	rep, ok := p.agent.(agent.Reporter)
	out, ok2 := p.prov.(provider.OutputReader)
	if !ok || !ok2 {
		return
	}
	p.mu.Lock()
	last := maps.Clone(p.last)
	p.mu.Unlock()
	for name, s := range snap.slots {
		inst, ok := last[name]
		if s.inst != nil {
			inst, ok = *s.inst, true
		}
		if !ok {
			continue
		}
		if b := readOutput(ctx, out, inst); len(b) > 0 {
			s.phase, s.output = rep.Phase(b), b
		}
	}
}

// readOutput returns the end of a machine's output, nil if there is none.
func readOutput(ctx context.Context, out provider.OutputReader, inst provider.Instance) []byte {
	r, err := out.Output(ctx, inst, outputTail)
	if err != nil {
		return nil
	}
	defer r.Close()
	b, _ := io.ReadAll(io.LimitReader(r, outputTail))
	return b
}

// remember keeps what the snapshot shows for later passes: each slot's
// last machine, the GPUs machines hold; and forgets what is gone. Called
// with p.mu held.
func (p *Pool) remember(snap snapshot) {
	// A create's registration is done with once listed (the view now
	// carries it), or once its slot is gone and not just created after
	// the listing.
	maps.DeleteFunc(p.registered, func(name string, _ int64) bool {
		s, ok := snap.slots[name]
		_, inflight := p.inflight(name, snap.since)
		return (ok && s.reg != nil) || (!ok && !inflight)
	})
	maps.DeleteFunc(p.unregistered, func(name string, _ bool) bool {
		s, ok := snap.slots[name]
		_, inflight := p.inflight(name, snap.since)
		return (ok && s.reg != nil) || (!ok && !inflight)
	})
	for name := range p.last {
		if _, ok := snap.slots[name]; !ok {
			delete(p.last, name) // gone from the provider and the forge
		}
	}
	for name := range p.memory {
		if _, ok := snap.slots[name]; !ok {
			delete(p.memory, name)
		}
	}
	if _, ok := p.prov.(provider.OutputReader); ok {
		for name, s := range snap.slots {
			if s.inst != nil && p.last[name].ID != s.inst.ID {
				p.last[name] = *s.inst
			}
		}
	}
	// Notices of machines, and refusals of registrations, no longer
	// listed are done with.
	if len(p.preempted) > 0 || len(p.refused) > 0 {
		machines, regs, registered := map[string]bool{}, map[int64]bool{}, map[string]bool{}
		for name, s := range snap.slots {
			if s.inst != nil {
				machines[s.inst.ID] = true
			}
			if s.reg != nil {
				regs[s.reg.ID] = true
				registered[name] = true
			}
		}
		// A cloud that deletes what it takes back (Azure's Spot VMs)
		// leaves no machine to list: its notice holds while the runner
		// is registered, and a while after, for the pass that reports
		// its job lost.
		now := p.now()
		maps.DeleteFunc(p.preempted, func(id string, n provider.Notice) bool {
			reported := p.lost[n.Name] == "machine "+id
			return !machines[id] && !registered[n.Name] && (reported || now.Sub(n.At) > noticeHold)
		})
		maps.DeleteFunc(p.refused, func(id int64, _ refusal) bool { return !regs[id] })
	}
	p.syncGPUs(snap)
	for name, d := range p.done {
		if d.epoch <= snap.since { // this pass's snapshot shows its result
			delete(p.done, name)
		}
	}
}

// policy is what classify applies. Called with p.mu held.
func (p *Pool) policy() policy {
	_, canEnd := p.forge.(forge.EndObserver)
	_, cordons := p.forge.(forge.Cordoner)
	_, rep := p.agent.(agent.Reporter)
	_, out := p.prov.(provider.OutputReader)
	return policy{
		phases:           rep && out,
		now:              p.now(),
		bootstrapTimeout: p.cfg.BootstrapTimeout,
		maxLifetime:      p.cfg.MaxLifetime,
		orphanGrace:      p.cfg.OrphanGrace,
		draining:         p.draining,
		canEnd:           canEnd,
		cordons:          cordons,
	}
}

// tally counts a pass's runners for scaling.
type tally struct {
	idle  int // idle or starting
	total int // counting against max
	// taken counts the busy runners whose machine is being taken back:
	// each lets a replacement start under a name beyond max.
	taken int
}

// classifyAll classifies every slot of the snapshot, recording each
// verdict in its slot, and shows the slots with an operation in flight as
// starting or stopping. It returns the view and the tally. Called with
// p.mu held.
func (p *Pool) classifyAll(snap snapshot, pol policy) (view []Runner, n tally) {
	view = make([]Runner, 0, len(snap.order))
	for _, name := range snap.order {
		s := snap.slots[name]
		r := Runner{Name: name, Pool: p.cfg.Name}
		if s.reg != nil {
			r.RunnerID = s.reg.ID
		}
		if p.cfg.Shapes != nil {
			r.Shape = p.shapeOf(name, s)
		}
		if s.inst != nil {
			r.Created, r.Machine, r.GPUs, r.Reason = s.inst.Created, s.inst.ID, s.inst.GPUs, s.inst.Reason
		}
		if o, ok := p.inflight(name, snap.since); ok {
			r.State = StateStopping
			if o == opCreate {
				r.State = StateStarting
				n.idle++
			}
			n.total++
			view = append(view, r)
			continue
		}
		f := facts{inst: s.inst, reg: s.reg, phase: s.phase, hadMachine: p.last[name].ID != "", unregistered: s.unregistered}
		if len(p.memory) > 0 {
			f.memory = p.memory[name]
		}
		if len(p.preempted) > 0 {
			f.preempted = p.noticeOf(name, s.inst)
		}
		v := classify(f, pol)
		s.verdict, s.classified = v, true
		r.State, r.IdleSince = v.state, v.memory.idleSince
		switch {
		case r.State == StateStarting, r.State == StateIdle:
			n.idle++
			n.total++
		case r.State == StateBusy:
			n.total++
		case f.preempted != nil && v.retire == "", r.State == StateLost && v.retire == "":
			// Its name stays taken while the machine goes, or until
			// the forge lets go of the registration: a replacement
			// takes a name beyond max.
			n.taken++
		}
		view = append(view, r)
	}
	// Created after this pass listed: running, but not in the snapshot.
	for _, name := range p.startingUnlisted(snap) {
		view = append(view, Runner{Name: name, Pool: p.cfg.Name, State: StateStarting, RunnerID: p.registered[name], Shape: p.shapes.Of(name)})
		n.idle++
		n.total++
	}
	return view, n
}

// noticeHold is how long a notice of a machine no longer listed is kept
// after its time.
const noticeHold = time.Minute

// noticeOf is the notice that a slot's machine is being taken back: by
// the machine's ID, or, once the machine is gone, by the last machine
// seen in the slot, or, where none was kept, by the runner's name. Not
// by name where the slot's last machine is known: a notice of an earlier
// machine of the slot, kept for noticeHold, is not its successor's.
// Called with p.mu held.
func (p *Pool) noticeOf(name string, inst *provider.Instance) *provider.Notice {
	id := p.last[name].ID
	if inst != nil {
		id = inst.ID
	}
	if id != "" {
		if n, ok := p.preempted[id]; ok {
			return &n
		}
		return nil
	}
	for _, n := range p.preempted {
		if n.Name == name {
			return &n
		}
	}
	return nil
}

// startingUnlisted returns the slots being created, or created since the
// snapshot's listing, that the snapshot does not show. Called with p.mu
// held.
func (p *Pool) startingUnlisted(snap snapshot) []string {
	var out []string
	for _, name := range slices.Sorted(maps.Keys(p.pending)) {
		if _, ok := snap.slots[name]; !ok && p.pending[name] == opCreate {
			out = append(out, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(p.done)) {
		if _, ok := snap.slots[name]; !ok && p.done[name].op == opCreate && p.done[name].epoch > snap.since {
			out = append(out, name)
		}
	}
	return out
}
