package pool

import (
	"fmt"
	"testing"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// TestClassify walks the table of a slot's cases: its machine (none,
// running, exited) × its registration (none, offline, idle, busy) × what
// its agent printed (nothing telling, ready, busy, done) × its age and
// what earlier passes noted, and checks the state each gets and what the
// pass does about it.
var classifyNow = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

// Machine states, registration states and the notice, for the table.
const (
	none = iota
	running
	exited
	created // made, never started: a start may be under way

	off  = forge.StatusOffline
	idle = forge.StatusIdle
	busy = forge.StatusBusy
	noRg = forge.Status("")
)

func machine(state int, age time.Duration) *provider.Instance {
	switch state {
	case running:
		return &provider.Instance{Name: "p-1", State: provider.StateRunning, Created: classifyNow.Add(-age), ID: "m1"}
	case exited:
		return &provider.Instance{Name: "p-1", State: provider.StateExited, Created: classifyNow.Add(-age), ID: "m1"}
	case created:
		return &provider.Instance{Name: "p-1", State: provider.StateCreated, Created: classifyNow.Add(-age), ID: "m1"}
	}
	return nil
}

func registration(st forge.Status) *forge.Runner {
	if st == "" {
		return nil
	}
	return &forge.Runner{ID: 7, Name: "p-1", Status: st}
}

type classifyCase struct {
	name    string
	machine int
	age     time.Duration
	reg     forge.Status
	phase   agent.Phase
	mem     memory
	pol     func(*policy)
	preempt bool
	// checkReg: the case checks the registration id noted in memory
	checkReg bool
	// hadMachine: the pool saw a machine for the runner
	hadMachine bool
	want       verdict
	wantNote   bool
}

// classifyCases is the table of a slot's cases: its machine (none,
// running, exited) × its registration (none, offline, idle, busy) × what
// its agent printed (nothing telling, ready, busy, done) × its age and
// what earlier passes noted.
var classifyCases = []classifyCase{
	// A running machine with its registration.
	{name: "new, offline", machine: running, age: 10 * time.Second, reg: off, want: verdict{state: StateStarting}},
	{name: "offline past bootstrap timeout", machine: running, age: 3 * time.Minute, reg: off, want: verdict{state: StateStopping, retire: "not online after 2m0s"}},
	{name: "offline, agent says ready", machine: running, age: 3 * time.Minute, reg: off, phase: agent.PhaseReady, want: verdict{state: StateIdle, memory: memory{idleSince: classifyNow}}},
	{name: "idle", machine: running, age: time.Minute, reg: idle, want: verdict{state: StateIdle, memory: memory{idleSince: classifyNow}}},
	{name: "idle a while", machine: running, age: time.Hour / 2, reg: idle, mem: memory{idleSince: classifyNow.Add(-time.Minute)}, want: verdict{state: StateIdle, memory: memory{idleSince: classifyNow.Add(-time.Minute)}}},
	{name: "idle past max lifetime", machine: running, age: 61 * time.Minute, reg: idle, want: verdict{state: StateStopping, retire: "idle past max lifetime 1h0m0s"}},
	{name: "busy, old: never retired", machine: running, age: 5 * time.Hour, reg: busy, want: verdict{state: StateBusy}},
	{name: "forge says idle, agent says busy", machine: running, age: time.Minute, reg: idle, phase: agent.PhaseBusy, want: verdict{state: StateBusy}},
	{name: "agent says done: it exits by itself", machine: running, age: time.Minute, reg: busy, phase: agent.PhaseDone, want: verdict{state: StateStopping}},
	{name: "idle while draining", machine: running, age: time.Minute, reg: idle, pol: func(p *policy) { p.draining = true }, want: verdict{state: StateStopping, retire: "draining"}},
	{name: "starting while draining", machine: running, age: time.Second, reg: off, pol: func(p *policy) { p.draining = true }, want: verdict{state: StateStopping, retire: "draining"}},
	{name: "busy while draining", machine: running, age: time.Minute, reg: busy, pol: func(p *policy) { p.draining = true }, want: verdict{state: StateBusy}},
	{name: "no bootstrap timeout", machine: running, age: 100 * time.Hour, reg: off, pol: func(p *policy) { p.bootstrapTimeout = 0 }, want: verdict{state: StateStarting}},
	{name: "idle machine being taken back", machine: running, age: time.Minute, reg: idle, preempt: true, checkReg: true, want: verdict{state: StateStopping, retire: "machine is being taken back: spot interruption", lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "busy machine being taken back", machine: running, age: time.Minute, reg: busy, preempt: true, checkReg: true, want: verdict{state: StateStopping, lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "taken back after its registration went", machine: running, age: time.Minute, reg: noRg, mem: memory{regID: 7}, preempt: true, checkReg: true, want: verdict{state: StateStopping, retire: "machine is being taken back: spot interruption", lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "taken back, ended, registration gone", machine: exited, age: time.Minute, reg: noRg, mem: memory{regID: 7}, preempt: true, checkReg: true, want: verdict{state: StateStopping, retire: "agent exited", lost: true, memory: memory{regID: 7}}, wantNote: true},
	// A running machine without a registration.
	{name: "unregistered, first seen", machine: running, age: time.Minute, reg: noRg, want: verdict{state: StateOrphan, memory: memory{missingSince: classifyNow}}},
	{name: "unregistered within grace", machine: running, age: time.Minute, reg: noRg, mem: memory{missingSince: classifyNow.Add(-10 * time.Second)}, want: verdict{state: StateOrphan, memory: memory{missingSince: classifyNow.Add(-10 * time.Second)}}},
	{name: "unregistered past grace", machine: running, age: time.Minute, reg: noRg, mem: memory{missingSince: classifyNow.Add(-15 * time.Second)}, want: verdict{state: StateOrphan, retire: "machine without a registration"}},
	{name: "unregistered, agent ready, listed busy before: the forge failed the job", machine: running, age: time.Minute, reg: noRg, phase: agent.PhaseReady, mem: memory{regID: 7, unclaimedSince: classifyNow.Add(-10 * time.Second)}, checkReg: true,
		want: verdict{state: StateLost, lost: true, retire: "its job never reached its agent", regGone: true, memory: memory{regID: 7, unclaimedSince: classifyNow.Add(-10 * time.Second)}}, wantNote: true},
	{name: "unregistered, agent done, listed busy before: its job ran", machine: running, age: time.Minute, reg: noRg, phase: agent.PhaseDone, mem: memory{regID: 7, unclaimedSince: classifyNow.Add(-10 * time.Second)}, checkReg: true, want: verdict{state: StateOrphan, memory: memory{missingSince: classifyNow, regID: 7}}},
	{name: "unregistered, agent busy: listing predates the job", machine: running, age: time.Minute, reg: noRg, phase: agent.PhaseBusy, mem: memory{missingSince: classifyNow.Add(-time.Hour)}, want: verdict{state: StateBusy}},
	// A machine created but never started (its manager was killed
	// mid-create): it may start yet, so it is a runner coming up.
	{name: "created, registered", machine: created, age: 10 * time.Second, reg: off, want: verdict{state: StateStarting}},
	{name: "created, took a job as it started", machine: created, age: 10 * time.Second, reg: busy, want: verdict{state: StateBusy}},
	{name: "created, never started", machine: created, age: 3 * time.Minute, reg: off, want: verdict{state: StateStopping, retire: "not online after 2m0s"}},
	// An exited machine.
	{name: "exited after its job", machine: exited, age: time.Minute, reg: busy, phase: agent.PhaseDone, want: verdict{state: StateStopping, retire: "agent exited", regGone: true, ended: true}},
	{name: "exited after its job, forge must be told", machine: exited, age: time.Minute, reg: busy, phase: agent.PhaseDone, pol: func(p *policy) { p.canEnd = false }, want: verdict{state: StateStopping, retire: "agent exited"}},
	{name: "exited after its job, forge already dropped it", machine: exited, age: time.Minute, reg: noRg, phase: agent.PhaseDone, want: verdict{state: StateStopping, retire: "agent exited"}},
	{name: "exited mid-job", machine: exited, age: time.Minute, reg: busy, phase: agent.PhaseBusy, want: verdict{state: StateStopping, retire: "agent exited", lost: true}, wantNote: true},
	{name: "exited before any job", machine: exited, age: time.Minute, reg: off, want: verdict{state: StateStopping, retire: "agent exited without taking a job", crashed: true}},
	{name: "exited, ready, never took a job", machine: exited, age: time.Minute, reg: idle, phase: agent.PhaseReady, want: verdict{state: StateStopping, retire: "agent exited without taking a job", crashed: true}},
	{name: "exited without registration (the pool removed it)", machine: exited, age: time.Minute, reg: noRg, want: verdict{state: StateStopping, retire: "agent exited"}},
	{name: "exited, forge says busy, agent says nothing", machine: exited, age: time.Minute, reg: busy, want: verdict{state: StateStopping, retire: "agent exited"}},
	{name: "exited, nothing tells phases", machine: exited, age: time.Minute, reg: off, pol: func(p *policy) { p.phases = false }, want: verdict{state: StateStopping, retire: "agent exited"}},
	// A registration without a machine.
	{name: "gone after its job, forge learns without a call", machine: none, reg: busy, phase: agent.PhaseDone, want: verdict{state: StateStopping, ended: true, forget: true}},
	{name: "gone after its job, forge must be told", machine: none, reg: busy, phase: agent.PhaseDone, pol: func(p *policy) { p.canEnd = false }, want: verdict{state: StateStopping, retire: "agent exited"}},
	{name: "taken back and deleted by the cloud, forge says busy", machine: none, reg: busy, preempt: true, checkReg: true, want: verdict{state: StateStopping, retire: "machine taken back", lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "taken back and deleted by the cloud, forge says offline", machine: none, reg: off, preempt: true, checkReg: true, want: verdict{state: StateStopping, retire: "machine taken back", lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "taken back and deleted by the cloud, registration gone", machine: none, reg: noRg, mem: memory{regID: 7}, preempt: true, checkReg: true, want: verdict{state: StateStopping, lost: true, memory: memory{regID: 7}}, wantNote: true},
	// Its agent stopped the job at the notice and said it ended before
	// the cloud deleted the machine (seen in CI: gitea-runner's job killed
	// at once prints no "cancelled in progress jobs").
	{name: "taken back and deleted by the cloud after its agent ended the job", machine: none, reg: noRg, mem: memory{regID: 7}, phase: agent.PhaseDone, preempt: true, checkReg: true, want: verdict{state: StateStopping, lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "taken back and deleted by the cloud after its agent ended the job, forge says busy", machine: none, reg: busy, phase: agent.PhaseDone, preempt: true, checkReg: true, want: verdict{state: StateStopping, retire: "machine taken back", lost: true, memory: memory{regID: 7}}, wantNote: true},
	{name: "vanished mid-job, first seen", machine: none, reg: busy, phase: agent.PhaseBusy, want: verdict{state: StateLost, lost: true, memory: memory{vanishedSince: classifyNow}}, wantNote: true},
	{name: "vanished mid-job, within grace", machine: none, reg: busy, phase: agent.PhaseBusy, mem: memory{vanishedSince: classifyNow.Add(-time.Minute)}, want: verdict{state: StateLost, lost: true, memory: memory{vanishedSince: classifyNow.Add(-time.Minute)}}, wantNote: true},
	{name: "vanished mid-job, past grace (the bootstrap timeout)", machine: none, reg: busy, phase: agent.PhaseBusy, mem: memory{vanishedSince: classifyNow.Add(-2 * time.Minute)}, want: verdict{state: StateLost, lost: true, retire: "machine vanished mid-job", memory: memory{vanishedSince: classifyNow.Add(-2 * time.Minute)}}, wantNote: true},
	{name: "vanished mid-job while draining", machine: none, reg: busy, phase: agent.PhaseBusy, pol: func(p *policy) { p.draining = true }, want: verdict{state: StateLost, lost: true, retire: "machine vanished mid-job", memory: memory{vanishedSince: classifyNow}}, wantNote: true},
	{name: "vanished mid-job, forge already gave up (offline)", machine: none, reg: off, phase: agent.PhaseBusy, want: verdict{state: StateLost, lost: true, retire: "machine vanished mid-job"}, wantNote: true},
	{name: "busy registration, no machine, nothing telling", machine: none, reg: busy, want: verdict{state: StateLost, lost: true, memory: memory{vanishedSince: classifyNow}}, wantNote: true},
	{name: "idle registration without a machine", machine: none, reg: idle, want: verdict{state: StateOrphan, retire: "registration without a machine"}},
	{name: "machine ended without taking a job", machine: none, reg: off, phase: agent.PhaseReady, mem: memory{}, hadMachine: true, want: verdict{state: StateStopping, retire: "agent exited without taking a job", crashed: true}},
	{name: "offline registration without a machine (crash before start)", machine: none, reg: off, want: verdict{state: StateOrphan, retire: "registration without a machine"}},
	// The forge lists it busy; its agent still waits for a job: one
	// handed over just now, or one that never reached it.
	{name: "busy at the forge, agent ready", machine: running, age: time.Minute, reg: busy, phase: agent.PhaseReady, want: verdict{state: StateBusy, memory: memory{unclaimedSince: classifyNow}}},
	{name: "busy at the forge, agent ready past the grace", machine: running, age: time.Minute, reg: busy, phase: agent.PhaseReady, mem: memory{unclaimedSince: classifyNow.Add(-unclaimedGrace)},
		want: verdict{state: StateLost, lost: true, retire: "its job never reached its agent", regGone: true, memory: memory{unclaimedSince: classifyNow.Add(-unclaimedGrace)}}, wantNote: true},
	{name: "busy at the forge, agent busy", machine: running, age: time.Minute, reg: busy, phase: agent.PhaseBusy, mem: memory{unclaimedSince: classifyNow.Add(-time.Hour)}, want: verdict{state: StateBusy}},
	{name: "busy at the forge, agent ready, phases unknown to the pool", machine: running, age: time.Minute, reg: busy, phase: agent.PhaseReady, mem: memory{unclaimedSince: classifyNow.Add(-time.Hour)},
		pol: func(p *policy) { p.phases = false }, want: verdict{state: StateBusy}},
	{name: "a stale timer does not carry over", machine: running, age: time.Minute, reg: idle, mem: memory{missingSince: classifyNow.Add(-time.Hour), vanishedSince: classifyNow.Add(-time.Hour)}, want: verdict{state: StateIdle, memory: memory{idleSince: classifyNow}}},
}

// TestClassify walks the table, and checks the state each case gets and
// what the pass does about it.
func TestClassify(t *testing.T) {
	if len(classifyCases) < 20 {
		t.Fatalf("only %d cases", len(classifyCases))
	}
	base := policy{now: classifyNow, bootstrapTimeout: 2 * time.Minute, maxLifetime: time.Hour, orphanGrace: 15 * time.Second, canEnd: true, phases: true}
	for _, tc := range classifyCases {
		t.Run(tc.name, func(t *testing.T) {
			p := base
			if tc.pol != nil {
				tc.pol(&p)
			}
			f := facts{inst: machine(tc.machine, tc.age), reg: registration(tc.reg), phase: tc.phase, memory: tc.mem, hadMachine: tc.hadMachine}
			if tc.preempt {
				f.preempted = &provider.Notice{Name: "p-1", ID: "m1", Reason: "spot interruption"}
			}
			got := classify(f, p)
			if (got.note != "") != tc.wantNote {
				t.Errorf("note %q, want one: %v", got.note, tc.wantNote)
			}
			got.note = ""
			if !tc.checkReg {
				got.memory.regID = 0 // the cases that check it say so
			}
			if got != tc.want {
				t.Errorf("classify:\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// A machine that never came up is retired with the provider's reason.
func TestBootstrapTimeoutGivesTheReason(t *testing.T) {
	inst := machine(created, 3*time.Minute)
	inst.Reason = "Unschedulable: 0/3 nodes are available"
	got := classify(facts{inst: inst, reg: registration(off)}, policy{now: classifyNow, bootstrapTimeout: 2 * time.Minute})
	if want := "not online after 2m0s: Unschedulable: 0/3 nodes are available"; got.retire != want {
		t.Fatalf("retire %q, want %q", got.retire, want)
	}
}

// A machine waiting in its backend's queue by the pool's choice (Slurm's
// queue_wait) outlives the bootstrap timeout, which counts, once it runs,
// from its start.
func TestQueuedMachineWaits(t *testing.T) {
	pol := policy{now: classifyNow, bootstrapTimeout: 2 * time.Minute}
	inst := machine(created, time.Hour)
	inst.Queued, inst.Reason = true, "pending: Resources"
	if got := classify(facts{inst: inst, reg: registration(off)}, pol); got.retire != "" || got.state != StateStarting {
		t.Errorf("queued an hour: %+v", got)
	}
	inst = machine(running, time.Hour)
	inst.Started = classifyNow.Add(-time.Minute)
	if got := classify(facts{inst: inst, reg: registration(off)}, pol); got.retire != "" {
		t.Errorf("running a minute after an hour queued: %+v", got)
	}
	inst.Started = classifyNow.Add(-3 * time.Minute)
	if got := classify(facts{inst: inst, reg: registration(off)}, pol); got.retire == "" {
		t.Errorf("running 3 minutes, never online: %+v", got)
	}
}

// An agent that died mid-job, or ended its job as its machine was taken
// back (a Slurm job cancelled with its steps), reports the job lost with
// the registration last listed, also when this pass's listing lacks it.
func TestLostKeepsTheRegistration(t *testing.T) {
	pol := policy{now: classifyNow, bootstrapTimeout: 2 * time.Minute, canEnd: true, phases: true}
	for _, tc := range []struct {
		name    string
		phase   agent.Phase
		preempt bool
		lost    bool
	}{
		{"died busy", agent.PhaseBusy, false, true},
		{"done as taken back", agent.PhaseDone, true, true},
		{"done, not taken back", agent.PhaseDone, false, false},
	} {
		f := facts{inst: machine(exited, time.Minute), phase: tc.phase, memory: memory{regID: 7}}
		if tc.preempt {
			f.preempted = &provider.Notice{Name: "p-1", ID: "m1", Reason: "Slurm job CANCELLED"}
		}
		got := classify(f, pol)
		if got.lost != tc.lost || tc.lost && got.memory.regID != 7 {
			t.Errorf("%s: %+v", tc.name, got)
		}
	}
}

// Classification is pure: the same facts give the same verdict, and the
// facts are not changed.
func TestClassifyIsPure(t *testing.T) {
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	inst := provider.Instance{Name: "p-1", State: provider.StateRunning, Created: now.Add(-time.Hour), ID: "m"}
	reg := forge.Runner{ID: 1, Name: "p-1", Status: forge.StatusOffline}
	before := fmt.Sprint(inst, reg)
	f := facts{inst: &inst, reg: &reg}
	pol := policy{now: now, bootstrapTimeout: time.Minute}
	a, b := classify(f, pol), classify(f, pol)
	if a != b || fmt.Sprint(*f.inst, *f.reg) != before {
		t.Fatalf("%+v then %+v; facts %v, were %s", a, b, fmt.Sprint(*f.inst, *f.reg), before)
	}
}

func TestPlan(t *testing.T) {
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	old, young := now.Add(-time.Hour), now.Add(-time.Second)
	// p-3 is as old as the others but only just came online: it is not
	// idle for the idle timeout.
	view := []Runner{{Name: "p-1", State: StateBusy, Created: old}, {Name: "p-2", State: StateIdle, Created: old, IdleSince: old}, {Name: "p-3", State: StateIdle, Created: old, IdleSince: young}, {Name: "p-4", State: StateIdle, Created: old, IdleSince: old}}
	in := scaleInput{want: 1, max: 4, size: 1, idleTimeout: 10 * time.Minute, now: now}
	for _, tc := range []struct {
		name   string
		mod    func(*scaleInput)
		retire string
		start  int
	}{
		{name: "idle above want for the idle timeout, go first in name order", retire: "[1 3]"},
		{name: "young idle runners stay", mod: func(in *scaleInput) { in.idleTimeout = 2 * time.Hour }, retire: "[]"},
		{name: "more wanted: start within max", mod: func(in *scaleInput) { in.want, in.max = 6, 6 }, retire: "[]", start: 2},
		{name: "max caps the start", mod: func(in *scaleInput) { in.want = 6 }, retire: "[]", start: 0},
		{name: "draining starts and retires nothing", mod: func(in *scaleInput) { in.want, in.max, in.draining = 6, 6, true }, retire: "[]"},
		{name: "backing off", mod: func(in *scaleInput) { in.want, in.max, in.createAfter = 6, 6, now.Add(time.Second) }, retire: "[]"},
		{name: "halted by a refused registration", mod: func(in *scaleInput) { in.want, in.max, in.halted = 6, 6, true }, retire: "[]"},
		{name: "once fills size slots once", mod: func(in *scaleInput) { in.want, in.max, in.once, in.size, in.created = 6, 6, true, 1, 1 }, retire: "[]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := in
			if tc.mod != nil {
				tc.mod(&x)
			}
			retire, start := plan(view, 3, 4, x)
			if fmt.Sprint(retire) != tc.retire || start != tc.start {
				t.Errorf("retire %v start %d, want %s %d", retire, start, tc.retire, tc.start)
			}
		})
	}
}
