package pool

import (
	"cmp"
	"slices"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// History keeps the records of the pool's runners (package history). The
// pool tells it of each runner as it is made, and of what passes see
// become of it; the forge's reports of jobs reach it from the daemon.
// Its methods queue and never wait.
type History interface {
	Add(r record.Record)
	Update(forge string, reg int64, change func(*record.Record) bool)
	Drop(forge string, reg int64)
}

// What a manager has told the history of a registration, so that each
// change is told once.
const (
	notedOnline uint8 = 1 << iota
	notedStarted
	notedEnded
	notedSystem // the host's system, told once a listing gave it
)

type noted struct {
	slot    string
	flags   uint8
	machine record.Machine
	gpus    int
}

// newRecord is the record of a runner about to be made: the pool's
// template with the runner's name, registration, labels and GPUs. Nil
// when the pool keeps no records.
func (p *Pool) newRecord(name string, reg int64, labels []string, units []gpu.Unit) *record.Record {
	if p.cfg.Record == nil {
		return nil
	}
	r := *p.cfg.Record
	r.Runner, r.Registration, r.Manager, r.Pool = name, reg, p.cfg.Manager, p.cfg.Name
	r.Labels = slices.Clone(labels)
	r.Created = p.now().UTC()
	r.ID = record.IDOf(r)
	r.Price = p.cfg.Prices.For(r.Machine)
	r.GPUs = nil
	for _, u := range units {
		g := record.GPU{ID: u.ID, Index: u.Device.Index, UUID: u.Device.UUID, Model: u.Device.Name, MemoryMiB: u.Device.MemoryMiB}
		if u.MIG != nil {
			g.UUID, g.MIGProfile, g.MemoryMiB = u.MIG.UUID, u.MIG.Profile, u.MIG.MemoryMiB
		}
		r.GPUs = append(r.GPUs, g)
	}
	return &r
}

// recordCreated tells the history of a runner whose machine was made: what
// its provider filled in (the machine, its host's system), and the
// machine's id.
func (p *Pool) recordCreated(r *record.Record, inst provider.Instance) {
	if r == nil || p.cfg.History == nil {
		return
	}
	m := r.Machine
	m.Merge(inst.Machine)
	m.ID = cmp.Or(m.ID, inst.ID)
	var sys *record.System
	if r.System != nil {
		s := *r.System
		sys = &s
	}
	p.cfg.History.Update(r.Forge, r.Registration, func(h *record.Record) bool {
		h.Machine.Merge(m)
		if sys != nil {
			h.System = sys
		}
		p.reprice(h)
		return true
	})
}

// recordPass tells the history what a pass saw of a slot's runner: online,
// running a job, ended, and where its machine runs once a listing says
// (a pod's node, a batch job's GPUs). Called with p.mu held.
func (p *Pool) recordPass(s *slot) {
	h := p.cfg.History
	if h == nil || p.cfg.Record == nil {
		return
	}
	reg := cmp.Or(regID(s.reg), s.verdict.memory.regID, p.registered[s.name])
	if reg == 0 {
		return
	}
	n := p.noted[reg]
	n.slot = s.name
	now := p.now().UTC()
	var change []func(*record.Record) bool
	set := func(flag uint8, field func(*record.Record) *time.Time) {
		if n.flags&flag != 0 {
			return
		}
		n.flags |= flag
		change = append(change, func(r *record.Record) bool {
			if t := field(r); t.IsZero() {
				*t = now
				return true
			}
			return false
		})
	}
	v := s.verdict
	if v.state == StateIdle {
		set(notedOnline, func(r *record.Record) *time.Time { return &r.Online })
	}
	if v.state == StateBusy || s.phase == agent.PhaseBusy || s.phase == agent.PhaseDone {
		set(notedStarted, func(r *record.Record) *time.Time { return &r.JobStarted })
	}
	if v.retire != "" || v.lost || s.inst != nil && s.inst.State == provider.StateExited {
		set(notedEnded, func(r *record.Record) *time.Time { return &r.Ended })
	}
	if s.inst != nil {
		m := n.machine
		if m.Merge(s.inst.Machine) {
			n.machine = m
			change = append(change, func(r *record.Record) bool {
				changed := r.Machine.Merge(m)
				return p.reprice(r) || changed
			})
		}
		if sys := s.inst.System; sys != nil && n.flags&notedSystem == 0 {
			n.flags |= notedSystem
			got := *sys
			change = append(change, func(r *record.Record) bool {
				if r.System != nil {
					return false
				}
				r.System = &got
				return true
			})
		}
		if gpus := s.inst.GPUs; len(gpus) > n.gpus {
			// A backend that gives machines GPUs of its own nodes says
			// which once the machine runs (Slurm's node:index).
			n.gpus = len(gpus)
			change = append(change, func(r *record.Record) bool {
				if len(r.GPUs) > 0 {
					return false
				}
				for i, id := range gpus {
					r.GPUs = append(r.GPUs, record.GPU{ID: id, Index: i})
				}
				return true
			})
		}
	}
	if _, known := p.noted[reg]; len(change) == 0 && known {
		return
	}
	p.noted[reg] = n
	if n.flags&notedEnded != 0 && len(p.noted) > 4*p.cfg.Max+16 {
		p.forgetNoted()
	}
	p.tell(reg, change)
}

// reprice sets the record's price from its machine as now known (its type
// chosen at creation, read at a listing); it reports whether it changed.
func (p *Pool) reprice(r *record.Record) bool {
	pr := p.cfg.Prices.For(r.Machine)
	if pr == nil || r.Price != nil && *r.Price == *pr {
		return false
	}
	r.Price = pr
	return true
}

// tell queues the changes to a registration's record.
func (p *Pool) tell(reg int64, change []func(*record.Record) bool) {
	if len(change) == 0 {
		return
	}
	p.cfg.History.Update(p.cfg.Record.Forge, reg, func(r *record.Record) bool {
		changed := false
		for _, c := range change {
			changed = c(r) || changed
		}
		return changed
	})
}

// recordGone tells the history of the runners that ended between passes:
// a machine and registration both gone (an ephemeral runner after its
// job, its container removed) leave no slot to classify, or a slot that
// holds another runner now. Called with p.mu held.
func (p *Pool) recordGone(snap snapshot) {
	if p.cfg.History == nil || p.cfg.Record == nil {
		return
	}
	now := p.now().UTC()
	for reg, n := range p.noted {
		if n.flags&notedEnded != 0 {
			continue
		}
		if s, ok := snap.slots[n.slot]; ok {
			if cur := cmp.Or(regID(s.reg), s.verdict.memory.regID, p.registered[s.name], p.memory[s.name].regID); cur == reg || cur == 0 && s.inst != nil {
				continue
			}
		}
		n.flags |= notedEnded
		p.noted[reg] = n
		p.tell(reg, []func(*record.Record) bool{func(r *record.Record) bool {
			if !r.Ended.IsZero() {
				return false
			}
			r.Ended = now
			return true
		}})
	}
}

// forgetNoted drops what was told of runners that ended, keeping the map
// bounded. Called with p.mu held.
func (p *Pool) forgetNoted() {
	for reg, n := range p.noted {
		if n.flags&notedEnded != 0 {
			delete(p.noted, reg)
		}
	}
}
