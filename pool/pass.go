package pool

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// Reconcile runs one pass: it reads the provider and the forge, classifies
// each slot, and starts what closes the gap.
func (p *Pool) Reconcile(ctx context.Context) error {
	snap, err := p.read(ctx, true)
	if err != nil {
		return p.fail(err)
	}
	p.pass(ctx, snap)
	p.reportBackoff()
	return nil
}

// pass decides and acts on what a snapshot shows.
func (p *Pool) pass(ctx context.Context, snap snapshot) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lastErr, p.failingSince = nil, time.Time{}
	for _, r := range snap.duplicates {
		p.removeRegistration(ctx, r)
	}
	p.endedUnseen(snap)
	p.remember(snap)
	pol := p.policy()
	view, n := p.classifyAll(snap, pol)
	debug := p.log.Enabled(ctx, slog.LevelDebug)
	var crashed, unstarted *slot
	refused := ""
	failed := map[string]bool{} // shapes backed off in this pass, once each
	for _, name := range snap.order {
		s := snap.slots[name]
		if !s.classified {
			continue
		}
		// The forge lists a registration online or busy, or says it
		// connected, only once its agent has reached it, whether or not
		// its machine is still there (a fast job's machine may be gone
		// by the next pass).
		if s.verdict.state == StateIdle || p.deletedByForge(s) || (s.reg != nil && (s.reg.Status == forge.StatusIdle || s.reg.Status == forge.StatusBusy || s.reg.Connected)) {
			p.served = true
		}
		p.apply(ctx, s, debug)
		p.recordPass(s)
		if s.unregistered && (s.inst == nil || s.inst.State == provider.StateExited) {
			delete(p.unregistered, s.name) // its end is told once
		}
		shape := "" // a dynamic pool's runner's: its failures back off its shape alone
		if p.cfg.Shapes != nil {
			shape = p.shapeOf(s.name, s)
		}
		switch {
		case s.verdict.state == StateBusy, s.phase == agent.PhaseBusy, s.phase == agent.PhaseDone:
			p.served = true
			p.recovered()
			p.shapes.Recovered(shape)
		case shape != "" && (s.verdict.crashed || s.verdict.unstarted || s.verdict.refused != ""):
			// A runner of a job's shape: that shape backs off alone.
			if !failed[shape] {
				failed[shape] = true
				p.shapeFailed(shape, failure(s), s.verdict.refused != "", s.name)
			}
		case s.verdict.crashed && crashed == nil:
			crashed = s
		case s.verdict.unstarted && unstarted == nil:
			unstarted = s
		}
		if shape == "" {
			refused = cmp.Or(refused, s.verdict.refused)
		}
	}
	p.noteShapes()
	p.lateNotices(ctx)
	p.recordGone(snap)
	switch {
	case refused != "" && !p.backoff.Halted:
		p.halt("the provider refused the runner's machine; fix the config and reload: " + refused)
		p.log.Error("the provider refused the runner's machine; no runner starts until the config changes", "reason", refused)
	case crashed != nil && !p.draining:
		// One step a pass, however many runners of a burst failed.
		p.crashed(crashed)
	case unstarted != nil && !p.draining:
		// From the bootstrap timeout: a cluster with no room for one
		// machine has none for its replacement a second later either.
		wait := p.backOffFrom(p.cfg.BootstrapTimeout, "machine not started within bootstrap_timeout: "+unstarted.verdict.retire)
		p.log.Warn("machine still queued at the bootstrap timeout; backing off", "runner", unstarted.name, "reason", unstarted.verdict.retire,
			"failures", p.backoff.Failures, "retry_in", wait)
	}
	p.view = p.scale(ctx, snap, p.view, view, n, pol.now)
}

// endedUnseen tells of the runners that the last pass listed, with a
// machine and a registration, and that this one lists neither of, though
// the pool removed neither: a fast job's, whose machine ended after it
// and whose ephemeral registration the forge deleted, between two passes.
// Such a runner served. A runner whose start ended after this pass began
// listing is not one: the listing predates it. Called with p.mu held,
// before remember.
func (p *Pool) endedUnseen(snap snapshot) {
	for _, r := range p.view {
		_, listed := snap.slots[r.Name]
		if listed || p.pending[r.Name] == opRemove || p.done[r.Name].op == opRemove {
			continue
		}
		if _, starting := p.inflight(r.Name, snap.since); starting {
			continue
		}
		reg, machine := cmp.Or(r.RunnerID, p.registered[r.Name]), cmp.Or(r.Machine, p.last[r.Name].ID)
		if reg != 0 && machine != "" {
			p.served = true
			p.log.Info("runner removed", "runner", r.Name, "reason", "its machine ended and the forge deleted its registration")
			// Its machine may yet turn out to have been taken back (a
			// notice that comes after the cloud deleted it).
			p.noteEnded(r.Name, machine, reg)
		}
	}
}

// deletedByForge says whether a slot's registration went without the
// pool removing it while its machine ran or after it ended: the forge
// deletes an ephemeral runner's registration once its job ended (GitHub's
// just-in-time runners, Gitea's ephemeral ones). A short job on a machine
// whose output the pool cannot read (a cloud instance) is known to have
// run by that alone, when no pass saw the runner online. Called with p.mu
// held.
func (p *Pool) deletedByForge(s *slot) bool {
	id := cmp.Or(p.registered[s.name], p.memory[s.name].regID)
	if i := slices.IndexFunc(p.view, func(r Runner) bool { return r.Name == s.name }); i >= 0 {
		id = cmp.Or(id, p.view[i].RunnerID) // the last pass's listing had it
	}
	hadMachine := s.inst != nil || p.last[s.name].ID != ""
	return s.reg == nil && id != 0 && hadMachine && p.pending[s.name] != opRemove && p.done[s.name].op != opRemove
}

// crashed backs the pool off after an agent ended without taking a job,
// and says why in one log line with the end of the agent's output.
// Called with p.mu held.
func (p *Pool) crashed(s *slot) {
	tail := lastLines(s.output, 5)
	wait := p.backOff(crashReason(tail))
	p.log.Warn("agent exited without taking a job; backing off", "runner", s.name, "failures", p.backoff.Failures, "retry_in", wait, "output", tail)
}

// Observe reads the provider and the forge and returns the pool's runners
// as a pass would classify them, changing nothing.
func (p *Pool) Observe(ctx context.Context) ([]Runner, error) {
	snap, err := p.read(ctx, false)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	view, _ := p.classifyAll(snap, p.policy())
	return view, nil
}

// apply carries out a slot's verdict: it notes what the next pass needs,
// tells the forge, and retires the runner. Called with p.mu held.
func (p *Pool) apply(ctx context.Context, s *slot, debug bool) {
	v := s.verdict
	// A machine whose agent said its job ended, or that ended while the
	// pool could not read its agent (a cloud machine that stopped its
	// job on a notice and was taken back before the pool read that
	// notice), may yet turn out to have been taken back.
	ended := s.phase == agent.PhaseDone || s.phase == agent.PhaseUnknown && s.inst != nil && s.inst.State == provider.StateExited
	if ended && !v.lost && (v.retire != "" || v.ended) {
		p.noteEnded(s.name, p.machineOf(s), cmp.Or(regID(s.reg), v.memory.regID, p.memory[s.name].regID))
	}
	if v.memory == (memory{}) {
		if len(p.memory) > 0 {
			delete(p.memory, s.name)
		}
	} else {
		p.memory[s.name] = v.memory
	}
	if v.forget {
		delete(p.last, s.name)
	}
	if v.ended && s.reg != nil {
		if e, ok := p.forge.(forge.EndObserver); ok {
			e.Ended(s.reg.ID)
		}
		p.Trigger()
	}
	if v.lost && p.reportLost(ctx, s, cmp.Or(regID(s.reg), v.memory.regID)) && v.note != "" {
		p.log.Warn(v.note, "runner", s.name, "registration", cmp.Or(regID(s.reg), v.memory.regID), "machine", p.machineOf(s))
	}
	if v.cordon {
		p.cordon(ctx, s.name, s.reg.ID)
	}
	if v.retire != "" && s.inst == nil && s.reg != nil && p.now().Before(p.refused[s.reg.ID].until) {
		// The forge refused this removal lately: it holds the job that
		// went with the machine. Asked again after a backoff.
		v.retire = ""
	}
	if v.retire != "" {
		reg := s.reg
		if v.regGone {
			reg = nil
		}
		p.retire(ctx, s.name, reg, s.inst, v.retire)
	}
	if debug {
		p.log.Debug("slot", "runner", s.name, "state", v.state, "machine", s.inst != nil && s.inst.State != provider.StateExited, "registered", s.reg != nil, "phase", s.phase)
	}
}

func regID(r *forge.Runner) int64 {
	if r == nil {
		return 0
	}
	return r.ID
}

// machineOf names the machine a slot's runner ran on: the one listed, or
// the last one seen. Called with p.mu held.
func (p *Pool) machineOf(s *slot) string {
	if s.inst != nil {
		return s.inst.ID
	}
	return cmp.Or(p.last[s.name].ID, s.notice)
}

// reportLost tells the forge, once per machine, that a runner died
// mid-job, so that its job is re-run. It reports whether the loss is news.
// Called with p.mu held.
func (p *Pool) reportLost(ctx context.Context, s *slot, id int64) bool {
	key := fmt.Sprint("registration ", id) // its machine never seen
	if m := p.machineOf(s); m != "" {
		key = "machine " + m
	}
	return p.reportLostAs(ctx, s.name, key, id)
}

// reportLostAs is reportLost for the loss known by key (a machine, or a
// registration) of the slot name. Called with p.mu held.
func (p *Pool) reportLostAs(ctx context.Context, name, key string, id int64) bool {
	if p.lost[name] == key {
		return false
	}
	p.lost[name] = key
	if r, ok := p.forge.(forge.Rerunner); ok && p.cfg.RetryLost {
		r.Lost(context.WithoutCancel(ctx), forge.Runner{ID: id, Name: name})
	}
	return true
}

// endedRunner is a runner retired after its agent said its job ended.
type endedRunner struct {
	name  string
	regID int64
	at    time.Time
}

// noteEnded keeps, for noticeHold, the runner of a machine that may yet
// turn out to have been taken back (a provider with notices): a Slurm job
// cancelled by someone else ends its agent's job, which the agent reports
// over, before the queue shows the cancel. Called with p.mu held.
func (p *Pool) noteEnded(name, machine string, reg int64) {
	if _, ok := p.prov.(provider.Preempter); !ok || reg == 0 || machine == "" {
		return
	}
	if _, seen := p.ended[machine]; !seen {
		p.ended[machine] = endedRunner{name: name, regID: reg, at: p.now()}
	}
}

// lateNotices reports lost the job of a runner retired as ended whose
// machine's notice of being taken back came after: that job failed with
// the machine, and the forge re-runs it (a forge re-runs no job that
// succeeded). Called with p.mu held.
func (p *Pool) lateNotices(ctx context.Context) {
	now := p.now()
	for id, e := range p.ended {
		n, taken := p.preempted[id]
		switch {
		case taken:
			delete(p.ended, id)
			if !p.reportLostAs(ctx, e.name, "machine "+id, e.regID) {
				continue
			}
			p.log.Warn("machine taken back as its runner's job ended; the job, if it failed, is re-run",
				"runner", e.name, "registration", e.regID, "machine", id, "reason", n.Reason)
		case now.Sub(e.at) > noticeHold:
			delete(p.ended, id)
		}
	}
}

func crashReason(tail string) string {
	if tail == "" {
		return "agent exited without taking a job"
	}
	return "agent exited without taking a job; its output ended: " + tail
}

// failure says why a slot's runner failed: its machine refused, not
// started within the bootstrap timeout, or its agent ended without a job.
func failure(s *slot) string {
	switch {
	case s.verdict.refused != "":
		return "the provider refused the runner's machine: " + s.verdict.refused
	case s.verdict.unstarted:
		return "machine not started within bootstrap_timeout: " + s.verdict.retire
	}
	return crashReason(lastLines(s.output, 5))
}
