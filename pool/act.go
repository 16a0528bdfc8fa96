package pool

import (
	"context"
	"errors"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
)

// op is an operation under way on a slot.
type op int

const (
	opCreate op = iota + 1 // registering a runner and starting its machine
	opRemove               // removing its registration, then its machine
)

type doneOp struct {
	epoch uint64
	op    op
}

// inflight returns the operation under way on a slot, as far as a pass
// that began listing at epoch since can tell. Called with p.mu held.
func (p *Pool) inflight(name string, since uint64) (op, bool) {
	if o, ok := p.pending[name]; ok {
		return o, true
	}
	if d, ok := p.done[name]; ok && d.epoch > since {
		return d.op, true
	}
	return 0, false
}

// finish records a completed operation. Called with p.mu held.
func (p *Pool) finish(name string, o op) {
	delete(p.pending, name)
	p.epoch++
	p.done[name] = doneOp{p.epoch, o}
}

// create registers a runner and starts its machine, in the background,
// with the GPUs taken for it. Called with p.mu held.
func (p *Pool) create(ctx context.Context, name string, units []gpu.Unit, sh shaped) {
	p.pending[name] = opCreate
	p.created++
	p.wg.Go(func() {
		start := p.now()
		inst, reg, err := p.createRunner(ctx, name, units, sh)
		p.mu.Lock()
		p.finish(name, opCreate)
		if err != nil && ctx.Err() != nil {
			// Cut short by the pool's own stop (a drain, a shutdown):
			// no sign that runners fail to start, so no backoff, which
			// would be saved and hold the next manager off.
			p.cfg.Runners.Release(name)
			p.created--
			p.mu.Unlock()
			p.log.Info("create runner abandoned: the pool is stopping", "runner", name, "err", err)
			return
		}
		if err != nil {
			p.cfg.Runners.Release(name)
			p.created--
			// A job shape's machine, not the pool's registration: that
			// shape backs off, the pool's others carry on.
			shaped := sh.shape != "" && !errors.Is(err, forge.ErrRejected)
			rejected := errors.Is(err, forge.ErrRejected) || errors.Is(err, provider.ErrRejected)
			var wait time.Duration
			switch {
			case shaped:
				p.shapeFailed(sh.shape, "create runner failed: "+err.Error(), rejected, name)
			case rejected:
				p.halt(refusedBy(err) + "; fix the config and reload: " + err.Error())
			default:
				wait = p.backOff("create runner failed: " + err.Error())
			}
			p.mu.Unlock()
			if p.cfg.OnError != nil {
				p.cfg.OnError("create")
			}
			switch {
			case shaped: // said by shapeFailed
			case rejected:
				p.log.Error(refusedBy(err)+"; no runner starts until the config changes", "runner", name, "err", err)
			default:
				p.log.Error("create runner failed", "runner", name, "err", err, "retry_in", wait)
			}
			p.reportBackoff()
		} else {
			// Its machine, whose output tells what became of it even
			// if it is gone before a pass lists it.
			p.last[name] = inst
			// And its registration, which the forge may delete with a
			// one-second job before any listing shows it (tookJob).
			p.registered[name] = reg
			if reg == 0 {
				// Its agent registers itself (a registration token):
				// if it ends before it did, that is a failed start.
				p.unregistered[name] = true
			}
			if p.cfg.History != nil && reg != 0 {
				// Its end is told even if no pass sees it run.
				p.noted[reg] = noted{slot: name}
			}
			p.mu.Unlock()
			took := p.now().Sub(start)
			if p.cfg.OnStarted != nil {
				p.cfg.OnStarted(took)
			}
			p.log.Info("runner started", "runner", name, "took", took.Round(time.Millisecond))
		}
		p.Trigger()
	})
}

// refusedBy says who refused a runner for good.
func refusedBy(err error) string {
	if errors.Is(err, provider.ErrRejected) {
		return "the provider refused the runner's machine"
	}
	return "the forge refused the runner's registration"
}

// createRunner registers the runner, then starts its machine. It is never
// half-applied: a registration whose machine did not start is removed.
// It returns the machine and the registration's id.
func (p *Pool) createRunner(ctx context.Context, name string, units []gpu.Unit, sh shaped) (provider.Instance, int64, error) {
	labels := p.cfg.Runners.LabelsFor(units, sh.shape)
	cred, err := p.forge.Register(ctx, forge.RunnerRequest{Name: name, Labels: labels, OneRunnerOnly: provider.TraitsOf(p.prov).KeepsBootData})
	if err != nil {
		return provider.Instance{}, 0, err
	}
	var inst provider.Instance
	rec := p.newRecord(name, cred.RunnerID, labels, units)
	if rec != nil && p.cfg.History != nil {
		// Known before its machine is asked for, so that a job's report
		// that comes first finds it.
		p.cfg.History.Add(*rec)
	}
	spec, err := p.agent.Spec(agent.Runner{
		Name: name, Manager: p.cfg.Manager, Pool: p.cfg.Name, Labels: labels, Env: p.cfg.Env,
	}, cred)
	if err == nil {
		spec.GPUs = gpu.IDs(units)
		spec.Record, spec.Request = rec, sh.req
		inst, err = p.prov.Create(ctx, spec)
	}
	if err == nil {
		p.recordCreated(rec, inst)
	} else if rec != nil && p.cfg.History != nil {
		p.cfg.History.Drop(rec.Forge, rec.Registration)
	}
	if err != nil {
		// A fresh context: the caller's may be what ended.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		rerr := p.forge.RemoveRunner(rctx, cred.RunnerID)
		switch {
		case errors.Is(rerr, forge.ErrBusy):
			// Its machine came up after all (a provider that reported a
			// failure it could not see through) and took a job: it is
			// left to the passes, which keep a busy runner.
			p.log.Warn("a runner whose start failed took a job; keeping its machine", "runner", name, "err", err)
			return provider.Instance{}, 0, err
		case rerr != nil && !errors.Is(rerr, forge.ErrNotFound):
			p.log.Warn("could not remove registration of failed runner; the next pass will", "runner", name, "err", rerr)
		}
		_ = p.prov.Delete(rctx, name)
		return provider.Instance{}, 0, err
	}
	return inst, cred.RunnerID, nil
}

// retire removes a runner in the background: the registration first, and
// only once the forge has agreed (it refuses a busy runner), the machine.
// reg or inst is nil when there is none to remove. Called with p.mu held.
func (p *Pool) retire(ctx context.Context, name string, reg *forge.Runner, inst *provider.Instance, why string) {
	p.pending[name] = opRemove
	p.wg.Go(func() {
		kept := false
		defer func() {
			p.mu.Lock()
			p.finish(name, opRemove)
			if !kept {
				delete(p.memory, name)
			}
			p.mu.Unlock()
			p.Trigger()
		}()
		exited := inst != nil && inst.State == provider.StateExited
		if reg != nil && !p.removeRegistrationFirst(ctx, name, reg.ID, exited, inst == nil, why) {
			kept = true
			return
		}
		if inst != nil {
			if err := p.prov.Delete(ctx, name); err != nil {
				p.log.Warn("delete machine failed", "runner", name, "err", err)
				if p.cfg.OnError != nil {
					p.cfg.OnError("delete")
				}
				return
			}
		}
		p.log.Info("runner removed", "runner", name, "reason", why)
	})
}

// refusal is the backoff of a registration whose machine is gone and
// whose removal the forge refused, counting the runner busy: its job went
// with the machine, and the forge lets go of it only once it gives up on
// the job, which can take minutes (Gitea's zombie task timeout). Asking on
// every pass would only spend calls.
type refusal struct {
	until time.Time
	wait  time.Duration
}

// The backoff of a refused removal doubles from refusedFirst to
// refusedMax.
const (
	refusedFirst = 5 * time.Second
	refusedMax   = 2 * time.Minute
)

// removeRegistrationFirst removes a retiring runner's registration and
// reports whether its machine may go now. A runner that took a job is
// kept; an agent that exited goes whatever the forge says. A registration
// without a machine (gone) that the forge refuses is asked for again only
// after a backoff.
func (p *Pool) removeRegistrationFirst(ctx context.Context, name string, id int64, exited, gone bool, why string) bool {
	remove := p.forge.RemoveRunner
	if e, ok := p.forge.(forge.ExitedRemover); ok && (exited || gone) {
		// No agent runs: it exited, or its machine is gone.
		remove = e.RemoveExited
	}
	err := remove(ctx, id)
	switch {
	case errors.Is(err, forge.ErrBusy) && gone:
		p.mu.Lock()
		r := p.refused[id]
		r.wait = min(max(2*r.wait, refusedFirst), refusedMax)
		r.until = p.now().Add(r.wait)
		p.refused[id] = r
		p.mu.Unlock()
		p.log.Info("the forge still holds the job of a runner whose machine is gone; asking again later", "runner", name, "reason", why, "retry_in", r.wait)
		return false
	case errors.Is(err, forge.ErrBusy) && !exited:
		p.log.Info("runner took a job; keeping it", "runner", name, "reason", why)
		return false
	case errors.Is(err, forge.ErrBusy):
		p.log.Warn("agent exited while the forge counts it busy; its job fails at the forge", "runner", name)
	case err != nil && !errors.Is(err, forge.ErrNotFound):
		p.log.Warn("remove registration failed", "runner", name, "err", err)
		return exited
	case errors.Is(err, forge.ErrNotFound) && (exited || gone):
		// The forge deleted it first, as it deletes an ephemeral
		// runner's once its job ended (deletedByForge).
		p.mu.Lock()
		p.served = true
		p.mu.Unlock()
	}
	return true
}

// removeRegistration removes a duplicate registration in the background.
func (p *Pool) removeRegistration(ctx context.Context, r forge.Runner) {
	p.wg.Go(func() {
		if err := p.forge.RemoveRunner(ctx, r.ID); err != nil && !errors.Is(err, forge.ErrNotFound) {
			p.log.Warn("remove duplicate registration failed", "runner", r.Name, "id", r.ID, "err", err)
		}
	})
}

// cordon asks the forge, in the background, to give a runner that took a
// job no other (forge.Cordoner). A failure is logged and forgotten, so
// that the next pass asks again. Called with p.mu held.
func (p *Pool) cordon(ctx context.Context, name string, id int64) {
	c, ok := p.forge.(forge.Cordoner)
	if !ok {
		return
	}
	p.wg.Go(func() {
		err := c.Cordon(ctx, id)
		if err == nil || errors.Is(err, forge.ErrNotFound) {
			return
		}
		p.log.Warn("cordon runner failed; the next pass asks again", "runner", name, "registration", id, "err", err)
		p.mu.Lock()
		if m, ok := p.memory[name]; ok && m.cordoned == id {
			m.cordoned = 0
			p.memory[name] = m
		}
		if errors.Is(err, forge.ErrRejected) && !p.backoff.Halted {
			// The forge will not cordon for this manager (a token without
			// the scope): a runner it cannot cordon may take a second
			// job, so no more start.
			p.halt("the forge refused to cordon a runner that took its job, so no more start; fix the config and reload: " + err.Error())
		}
		p.mu.Unlock()
		p.Trigger()
	})
}
