package pool

import (
	"cmp"
	"fmt"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// State of a runner, as status shows it.
type State string

const (
	StateStarting State = "starting" // machine up, not yet online at the forge
	StateIdle     State = "idle"
	StateBusy     State = "busy"
	StateStopping State = "stopping" // being removed, its agent has exited, or its machine is being taken back
	StateOrphan   State = "orphan"   // a registration without a machine, or the reverse
	// StateLost: its machine went away while it ran a job. The job is
	// reported lost (the forge re-runs it), a replacement may start, and
	// the registration goes once the forge lets it, within the bootstrap
	// timeout.
	StateLost State = "lost"
)

// Runner is one slot of the pool as seen by a pass.
type Runner struct {
	Name     string
	Pool     string
	State    State
	RunnerID int64 // at the forge; 0 without a registration
	Created  time.Time
	Machine  string   // the provider's id (pid, container id)
	GPUs     []string // the GPUs its machine was given
	// IdleSince is when the runner was first seen idle; zero unless it
	// is idle.
	IdleSince time.Time
	// Reason is the provider's word on why its machine is not running
	// (a pod that cannot be scheduled, an image that cannot be pulled).
	Reason string
	// Shape is what its job asked for (a dynamic pool's gpus=2,mem=64g);
	// "" for a runner of the pool's own shape.
	Shape string `json:",omitempty"`
}

// vanishedGrace is how long a registration whose machine vanished mid-job
// is left for the forge to fail the job and let go of it, before the pool
// asks for its removal anyway: the bootstrap timeout, or this without
// one.
const vanishedGrace = 2 * time.Minute

// facts is everything classify knows of one slot: what the provider and
// the forge listed, what the agent printed, and what earlier passes noted.
type facts struct {
	inst  *provider.Instance // nil: no machine listed
	reg   *forge.Runner      // nil: no registration listed
	phase agent.Phase        // from the agent's output, when it tells
	// preempted is the notice that the listed machine is being taken
	// back; nil when there is none.
	preempted *provider.Notice
	// hadMachine is set when the pool has seen a machine for the slot's
	// runner: a registration without one then means the machine ended.
	hadMachine bool
	// unregistered is set when the runner's agent was to register
	// itself (a registration token) and has not been listed registered:
	// if its machine ends without its agent saying it took a job, it
	// failed to start.
	unregistered bool
	memory
}

// memory is what earlier passes noted of a slot.
type memory struct {
	// missingSince is when a running machine was first seen without a
	// registration.
	missingSince time.Time
	// vanishedSince is when the slot's machine was found gone while its
	// agent ran a job.
	vanishedSince time.Time
	// idleSince is when the runner was first seen idle.
	idleSince time.Time
	// regID is the registration last listed with the slot's running
	// machine: a machine taken back after its runner's registration
	// went (its agent stopped, its job failed) still names it.
	regID int64
	// cordoned is the registration the pool cordoned (forge.Cordoner),
	// so that it is asked once.
	cordoned int64
	// unclaimedSince is when the forge was first seen to list the runner
	// busy while its agent said it waited for a job.
	unclaimedSince time.Time
}

// policy is the pool's settings that classify applies.
type policy struct {
	now              time.Time
	bootstrapTimeout time.Duration
	maxLifetime      time.Duration
	orphanGrace      time.Duration
	draining         bool
	// canEnd is set when the forge learns of an ended runner without a
	// call (forge.EndObserver).
	canEnd bool
	// cordons is set when the forge's agents may take a second job
	// (forge.Cordoner): a runner is cordoned once it takes a job, and
	// retired once that job is over (classifyCordoned).
	cordons bool
	// phases is set when the agents' output tells their phase: only then
	// can an agent that ended without a job be told from one that did.
	phases bool
}

// verdict is what a pass does about one slot.
type verdict struct {
	state State
	// retire, when set, is why the runner goes: its registration first,
	// then its machine.
	retire string
	// regGone is set when the forge deleted the registration itself (an
	// ephemeral runner after its job): retire only the machine.
	regGone bool
	// ended tells the forge that the runner's registration went with its
	// job.
	ended bool
	// lost reports the runner's job lost with its machine, for a re-run;
	// note says why, for the log.
	lost bool
	note string
	// forget drops the slot's last machine: its output tells nothing more.
	forget bool
	// crashed is set when the agent ended without taking a job (a broken
	// image, a wrong path): the pool backs off before starting more.
	crashed bool
	// unstarted is set when a machine is retired that never left its
	// backend's queue within the bootstrap timeout (a batch job still
	// pending): the pool backs off, so that a cluster with no room is not
	// sent the same machine again at once, losing its place in the queue.
	unstarted bool
	// cordon asks the forge to give the busy runner no further job.
	cordon bool
	// refused is the provider's word that it will never run the
	// machine as asked (provider.Instance.Refused): the pool starts no
	// runner until its config changes.
	refused string
	// memory is what to note of the slot for the next pass.
	memory memory
}

// classify decides a slot's state and what it needs. It is pure: no lock,
// no I/O, the same facts give the same verdict.
func classify(f facts, p policy) verdict {
	switch {
	case f.inst == nil:
		return classifyGone(f, p)
	case f.inst.State == provider.StateExited:
		return classifyExited(f, p)
	case f.inst.Refused != "" && f.phase == agent.PhaseUnknown:
		// It never ran its agent, and never will.
		return verdict{state: StateStopping, retire: "refused by the provider: " + f.inst.Refused, refused: f.inst.Refused}
	case f.reg == nil:
		return classifyUnregistered(f, p)
	}
	return classifyLive(f, p)
}

// classifyGone: a registration without a machine. The machine ended after
// its job (a container removed when it exits), ended without one (an
// agent that failed to start), vanished mid-job (killed, out of memory,
// taken back), or was never started (a crash between registering and
// starting).
func classifyGone(f facts, p policy) verdict {
	switch {
	case f.preempted != nil && (f.reg != nil || f.regID != 0):
		// Taken back and deleted already (as Azure deletes an evicted
		// Spot VM): its agent stopped, and the job it may have run
		// failed with it; the forge re-runs that job, if there was one.
		// So too when the agent said the job ended before the machine
		// went: it was stopped at the notice, as on an exited machine
		// (classifyExited); a forge re-runs no job that succeeded.
		note := "machine taken back; its runner's job, if it ran one, is re-run"
		if f.phase == agent.PhaseDone {
			note = "machine taken back as its runner's job ended; the job, if it failed, is re-run"
		}
		v := verdict{state: StateStopping, lost: true, note: note, memory: memory{regID: cmp.Or(regOf(f), f.regID)}}
		if f.reg != nil {
			v.retire = "machine taken back"
		}
		return v
	case f.reg == nil && neverRegistered(f, p) && f.hadMachine:
		return verdict{state: StateStopping, crashed: true}
	case f.reg == nil:
		return verdict{state: StateStopping} // nothing left of it
	case f.phase == agent.PhaseDone && p.canEnd:
		// The forge deleted the ephemeral registration itself.
		return verdict{state: StateStopping, ended: true, forget: true}
	case f.phase == agent.PhaseDone:
		return verdict{state: StateStopping, retire: "agent exited"}
	case f.reg.Status == forge.StatusBusy:
		// The forge still counts the runner busy: its job went with the
		// machine. The registration goes once the forge lets go of it,
		// or, at the latest, when the grace is over (or the pool drains).
		since := f.vanishedSince
		if since.IsZero() {
			since = p.now
		}
		v := verdict{state: StateLost, lost: true, note: "runner's machine vanished while it ran a job", memory: memory{vanishedSince: since}}
		if p.draining || p.now.Sub(since) >= p.lostGrace() {
			v.retire = "machine vanished mid-job"
		}
		return v
	case f.phase == agent.PhaseBusy:
		// The forge has given up on the runner (offline): nothing to
		// wait for.
		return verdict{state: StateLost, lost: true, note: "runner's machine vanished while it ran a job", retire: "machine vanished mid-job"}
	case f.hadMachine && p.phases:
		return verdict{state: StateStopping, retire: "agent exited without taking a job", crashed: true}
	}
	return verdict{state: StateOrphan, retire: "registration without a machine"}
}

func regOf(f facts) int64 {
	if f.reg == nil {
		return 0
	}
	return f.reg.ID
}

// lostGrace is how long a registration the forge counts busy is left after
// its machine vanished.
func (p policy) lostGrace() time.Duration {
	if p.bootstrapTimeout > 0 {
		return p.bootstrapTimeout
	}
	return vanishedGrace
}

// classifyExited: the agent has exited (its job is done, or it failed to
// start). The machine goes even if the forge still counts it busy: the
// agent is dead either way, and the slot is free for a fresh runner.
func classifyExited(f facts, p policy) verdict {
	v := verdict{state: StateStopping, retire: "agent exited"}
	switch {
	case f.phase == agent.PhaseDone:
		// A forge that learns of an ended runner without a call deleted
		// the ephemeral registration itself when the job ended: nothing
		// to remove there. Others are asked to.
		v.regGone = f.reg != nil && p.canEnd
		v.ended = v.regGone
		if f.preempted != nil && (f.reg != nil || f.regID != 0) {
			// Its job ended as its machine was taken back (a Slurm
			// job cancelled, signalling the job's steps with it): the
			// job failed with it, and the forge re-runs it; a forge
			// re-runs no job that succeeded.
			v.lost, v.note = true, "machine taken back as its runner's job ended; the job, if it failed, is re-run"
			v.memory.regID = cmp.Or(regOf(f), f.regID)
		}
	case f.phase == agent.PhaseBusy:
		// The registration last listed with the machine names the job,
		// also when this pass's listing lacks it.
		v.lost, v.note = true, "agent died while running a job"
		v.memory.regID = cmp.Or(regOf(f), f.regID)
	case f.preempted != nil && (f.reg != nil || f.regID != 0):
		// Taken back: its agent stopped, and the job it may have run
		// failed with it; the forge re-runs that job, if there was one.
		v.lost, v.note = true, "machine taken back; its runner's job, if it ran one, is re-run"
		v.memory.regID = cmp.Or(regOf(f), f.regID)
	case p.phases && f.reg != nil && f.reg.Status != forge.StatusBusy:
		// Still registered, so not retired by the pool (which removes
		// the registration first) nor ended after a job.
		v.retire, v.crashed = "agent exited without taking a job", true
	case neverRegistered(f, p):
		v.retire, v.crashed = "agent exited before it registered", true
	}
	return v
}

// neverRegistered says whether a runner whose agent was to register
// itself ended without doing so: no listing showed it registered and its
// output says it neither connected nor took a job (GitHub's config.sh
// failing, where just-in-time runners are not offered). Its machine's
// end is a failed start, counted as a crash after registering is. Only
// agents whose output tells can show it: a job fast enough to come and
// go between two listings would look the same.
func neverRegistered(f facts, p policy) bool {
	return p.phases && f.unregistered && f.phase == agent.PhaseUnknown && f.preempted == nil
}

// classifyUnregistered: a running machine without a registration.
func classifyUnregistered(f facts, p policy) verdict {
	if f.phase == agent.PhaseBusy {
		// The forge's list predates the job; never remove a busy runner.
		return verdict{state: StateBusy, memory: memory{regID: f.regID}}
	}
	if f.preempted != nil && f.regID != 0 {
		// Its registration went with the job its agent failed as the
		// machine was taken back: that job is re-run.
		return verdict{state: StateStopping, retire: "machine is being taken back: " + f.preempted.Reason,
			lost: true, note: "machine taken back; its runner's job, if it ran one, is re-run", memory: memory{regID: f.regID}}
	}
	if !f.unclaimedSince.IsZero() && f.regID != 0 && f.phase == agent.PhaseReady {
		// Listed busy while its agent waited (classifyUnclaimed), and now
		// gone while it still waits: the forge failed the job that never
		// reached it and deleted the runner with it, before the grace
		// ran (Gitea's zombie-task cleanup, at once after an outage
		// longer than its timeout).
		return verdict{state: StateLost, lost: true, note: "the forge failed the job it had handed the runner, which never reached its agent; the job is re-run",
			retire: "its job never reached its agent", regGone: true, memory: memory{regID: f.regID, unclaimedSince: f.unclaimedSince}}
	}
	since := f.missingSince
	if since.IsZero() {
		since = p.now
	}
	if p.now.Sub(since) >= p.orphanGrace {
		return verdict{state: StateOrphan, retire: "machine without a registration"}
	}
	// The registration it had (its ephemeral one, deleted with its job)
	// stays noted for a notice that comes with the machine's exit.
	return verdict{state: StateOrphan, memory: memory{missingSince: since, regID: f.regID}}
}

// classifyLive: a running machine with its registration.
func classifyLive(f facts, p policy) verdict {
	age := p.now.Sub(cmp.Or(f.inst.Started, f.inst.Created))
	status := f.reg.Status
	// The agent's own word is newer than any listing of the forge.
	switch f.phase {
	case agent.PhaseBusy:
		status = forge.StatusBusy
	case agent.PhaseDone:
		if p.cordons {
			v, _ := classifyCordoned(f, status, true)
			return v
		}
		// It exits by itself. Its registration is noted: if its machine
		// turns out to have been taken back (the job ended because a
		// Slurm job was cancelled), the forge may have deleted the
		// registration by the pass that sees the machine gone, and the
		// lost report still names it.
		return verdict{state: StateStopping, memory: memory{regID: f.reg.ID}}
	case agent.PhaseReady:
		if status == forge.StatusOffline {
			status = forge.StatusIdle
		}
	}
	mem := memory{regID: f.reg.ID}
	if p.cordons && f.preempted == nil {
		if v, ok := classifyCordoned(f, status, false); ok {
			return v
		}
	}
	switch {
	case f.preempted != nil && status == forge.StatusBusy:
		// Its job goes with the machine: the forge re-runs it, and a
		// replacement need not wait for the machine to go.
		return verdict{state: StateStopping, lost: true, note: "machine is being taken back while it runs a job", memory: mem}
	case f.preempted != nil:
		// Idle as far as the last listing knows; its job, if it took
		// one since (its agent may already have stopped it and failed
		// it), is re-run all the same: the forge finds none otherwise.
		// Said in the log, since a listing can lag behind a job taken
		// just before the notice.
		return verdict{state: StateStopping, retire: "machine is being taken back: " + f.preempted.Reason,
			lost: true, note: "machine taken back; its runner's job, if it ran one, is re-run", memory: mem}
	case status == forge.StatusBusy && f.phase == agent.PhaseReady && p.phases:
		return classifyUnclaimed(f, p, mem)
	case status == forge.StatusBusy:
		return verdict{state: StateBusy, memory: mem}
	case status == forge.StatusOffline && p.bootstrapTimeout > 0 && age > p.bootstrapTimeout && !f.inst.Queued:
		why := fmt.Sprintf("not online after %s", p.bootstrapTimeout)
		if f.inst.Reason != "" {
			why += ": " + f.inst.Reason
		}
		// Backed off only where the backend says why the machine waits
		// (a batch job's pending reason): a container a killed manager
		// left created says nothing of a full cluster.
		return verdict{state: StateStopping, retire: why, unstarted: f.inst.State == provider.StateCreated && f.inst.Reason != ""}
	case p.draining:
		return verdict{state: StateStopping, retire: "draining"}
	case status == forge.StatusOffline:
		return verdict{state: StateStarting, memory: mem}
	case p.maxLifetime > 0 && age > p.maxLifetime:
		return verdict{state: StateStopping, retire: fmt.Sprintf("idle past max lifetime %s", p.maxLifetime)}
	}
	since := f.idleSince
	if since.IsZero() {
		since = p.now
	}
	return verdict{state: StateIdle, memory: memory{idleSince: since, regID: f.reg.ID}}
}

// unclaimedGrace is how long the forge may list a runner busy while its
// agent says it waits for a job: far longer than an agent takes to print
// the job it received and the pool to read that, or a forge's kept
// listing to catch up with a job's end.
const unclaimedGrace = 30 * time.Second

// classifyUnclaimed: the forge lists the runner busy, and its agent says
// it waits for a job. A job handed over just now shows in the agent's
// output within seconds; one the forge assigned as the agent gave up on
// its request (Gitea answering a task fetch after gitea-runner's
// fetch_timeout, on a loaded forge) never reaches it: the forge holds the
// job until it fails it as a zombie, and the agent, whose registration
// counts as busy, takes no other. Past the grace that job is reported
// lost, so that it is re-run once it fails, and the machine goes; its
// registration stays with the forge until the forge lets go of the job.
func classifyUnclaimed(f facts, p policy, mem memory) verdict {
	mem.unclaimedSince = f.unclaimedSince
	if mem.unclaimedSince.IsZero() {
		mem.unclaimedSince = p.now
	}
	if p.now.Sub(mem.unclaimedSince) < unclaimedGrace {
		return verdict{state: StateBusy, memory: mem}
	}
	return verdict{state: StateLost, lost: true, note: "the forge handed the runner a job that never reached its agent; the job is re-run once it fails",
		retire: "its job never reached its agent", regGone: true, memory: mem}
}

// classifyCordoned applies a Cordoner forge's rules to a live runner that
// runs a job (status), or whose agent says its job ended (done): one the
// forge lists cordoned and idle has run its job and goes, exited or not
// (an agent that does not stop after its job); one not yet cordoned is,
// once, so that no other job comes to it; a done one otherwise goes when
// its agent exits, with one call. It reports whether the rules decide.
func classifyCordoned(f facts, status forge.Status, done bool) (verdict, bool) {
	mem := memory{regID: f.reg.ID, cordoned: f.cordoned}
	state := StateBusy
	if done {
		state = StateStopping
	}
	switch {
	case f.reg.Cordoned && status != forge.StatusBusy:
		return verdict{state: StateStopping, retire: "its job ended"}, true
	case status != forge.StatusBusy && !done:
		return verdict{}, false
	case !f.reg.Cordoned && f.cordoned != f.reg.ID:
		mem.cordoned = f.reg.ID
		return verdict{state: state, cordon: true, memory: mem}, true
	}
	return verdict{state: state, memory: mem}, true
}
