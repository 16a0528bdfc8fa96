package pool

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// A machine that vanished mid-job, whose registration the forge already
// lists offline (it gave up on the runner), frees its slot at once: the
// job is reported lost once, the registration removed, and with max 1 a
// replacement starts in the same pass.
func TestLostRunnerFreesSlotAtOnce(t *testing.T) {
	h := newCapHarness(t, Config{Size: 1, Max: 1, RetryLost: true})
	h.settle()
	h.forge.set("gpu-1", forge.StatusBusy)
	h.out.print("gpu-1", "busy")
	h.settle()
	h.out.vanish("gpu-1")
	h.forge.set("gpu-1", forge.StatusOffline)
	h.settle()
	if !slices.Contains(h.forge.removed, "gpu-1") {
		t.Fatalf("the lost runner's registration was kept: removed %v", h.forge.removed)
	}
	if len(h.prov.running()) != 1 || h.prov.created != 2 {
		t.Fatalf("no replacement: running %v, created %d", h.prov.running(), h.prov.created)
	}
	if len(h.forge.lost) != 1 || h.forge.lost[0].ID != 1 {
		t.Fatalf("lost %v, want registration 1 once", h.forge.lost)
	}
}

// While the forge still counts a vanished machine's runner busy, a
// replacement starts at once (under a name beyond max); the registration
// is asked to go within the bootstrap timeout; and a drain does not wait
// for it.
func TestLostRunnerTheForgeCountsBusy(t *testing.T) {
	h := newCapHarness(t, Config{Size: 1, Max: 1, RetryLost: true, BootstrapTimeout: 2 * time.Minute})
	h.settle()
	h.forge.set("gpu-1", forge.StatusBusy)
	h.out.print("gpu-1", "busy")
	h.settle()
	h.out.vanish("gpu-1")
	h.settle()
	if got := sorted(h.prov.running()); !slices.Equal(got, []string{"gpu-2"}) {
		t.Fatalf("running %v, want a replacement gpu-2 at once", got)
	}
	if st := h.pool.Runners(); st[0].Name != "gpu-1" || st[0].State != StateLost {
		t.Fatalf("runners %+v, want gpu-1 lost", st)
	}
	// The forge lets go of it within the bootstrap timeout.
	h.clk.Add(2 * time.Minute)
	h.forge.set("gpu-1", forge.StatusIdle) // its job failed
	h.settle()
	if !slices.Contains(h.forge.removed, "gpu-1") {
		t.Fatalf("registration kept past the bootstrap timeout: removed %v", h.forge.removed)
	}
	if len(h.forge.lost) != 1 {
		t.Fatalf("lost reported %d times, want once", len(h.forge.lost))
	}

	// A drain does not wait on a lost runner the forge still holds.
	h2 := newCapHarness(t, Config{Size: 1, Max: 1})
	h2.settle()
	h2.forge.set("gpu-1", forge.StatusBusy)
	h2.out.print("gpu-1", "busy")
	h2.settle()
	h2.out.vanish("gpu-1")
	h2.settle()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if left := h2.pool.Drain(ctx); len(left) != 0 || ctx.Err() != nil {
		t.Fatalf("drain left %+v (%v)", left, ctx.Err())
	}
}

// An agent that exits at once, again and again, backs the pool off from
// 1s doubling: in a minute, a handful of runners, not one a pass; the
// reason, with the end of the agent's output, is the pool's Backoff and
// OnBackoff's; and a runner that takes a job ends the backoff.
func TestCrashLoopBacksOff(t *testing.T) {
	var reported atomic.Value
	h := newCapHarness(t, Config{Size: 1, OnBackoff: func(b Backoff) { reported.Store(b) }})
	crash := func() {
		for _, name := range h.prov.running() {
			h.out.print(name, "Error: exec: \"/opt/runner/run.sh\": no such file or directory")
			h.prov.exit(name)
		}
	}
	for range 60 {
		h.settle()
		crash()
		h.settle()
		h.clk.Add(time.Second)
	}
	if h.prov.created > 7 {
		t.Fatalf("%d runners started in a minute of crashes; want at most 7 (1s, 2s, 4s, ... apart)", h.prov.created)
	}
	b := h.pool.Backoff()
	if b.Failures < 5 || !strings.Contains(b.Reason, "no such file or directory") || !b.Until.After(h.clk.Now()) {
		t.Fatalf("backoff %+v; want the failures counted and the agent's last line given", b)
	}
	if r, _ := reported.Load().(Backoff); r.Failures != b.Failures {
		t.Fatalf("OnBackoff got %+v, want %+v", r, b)
	}
	// Past the wait a runner starts, and takes a job: the backoff ends.
	h.clk.Add(maxBackoff)
	h.settle()
	h.forge.set(h.prov.running()[0], forge.StatusBusy)
	h.settle()
	if b := h.pool.Backoff(); b.Failures != 0 {
		t.Fatalf("backoff %+v after a runner took a job, want none", b)
	}
}

// A machine still queued in its backend at the bootstrap timeout (a Slurm
// job pending for want of room) is retired and the pool backs off, from
// the bootstrap timeout doubling: in an hour of a full cluster, a few
// submissions, not one every bootstrap timeout.
func TestQueuedPastBootstrapBacksOff(t *testing.T) {
	h := newHarness(t, Config{Size: 1, BootstrapTimeout: 2 * time.Minute})
	h.prov.queued = true
	for range 720 {
		h.settle()
		h.clk.Add(5 * time.Second)
	}
	// 2m queued, then 2m, 4m, 5m, 5m ... between: 2+2, 2+4, 2+5 ...
	if h.prov.created > 10 || h.prov.created < 5 {
		t.Fatalf("%d machines submitted in an hour of a full queue; want 5 to 10 (one every 30 without the backoff)", h.prov.created)
	}
	if b := h.pool.Backoff(); b.Failures < 4 || !strings.Contains(b.Reason, "pending: Resources") {
		t.Fatalf("backoff %+v; want the failures counted with the backend's reason", b)
	}
}

// Where the agent registers itself (a registration token), an agent that
// fails before registering (GitHub's config.sh) is a failed start too:
// whether its machine is listed exited or was removed as it exited, the
// pool backs off as it does for a crash after registering, not a runner a
// pass. A runner that registers, takes a job and is gone between two
// passes, or that the pool removes before it registered, is no failure.
func TestSelfRegisteringCrashLoopBacksOff(t *testing.T) {
	for _, vanish := range []bool{false, true} {
		t.Run(fmt.Sprintf("removed_as_it_exits=%v", vanish), func(t *testing.T) {
			h := newCapHarness(t, Config{Size: 1})
			h.forge.selfRegister = true
			for i := range 60 {
				h.settle()
				for _, name := range h.prov.running() {
					h.out.print(name, "Http response code: NotFound from 'POST https://api.github.com/actions/runner-registration'")
					if vanish && i%2 == 0 {
						h.out.vanish(name)
					} else {
						h.prov.exit(name)
					}
				}
				h.settle()
				h.clk.Add(time.Second)
			}
			if h.prov.created > 7 {
				t.Fatalf("%d runners started in a minute of failed registrations; want at most 7 (1s, 2s, 4s, ... apart)", h.prov.created)
			}
			b := h.pool.Backoff()
			if b.Failures < 5 || !strings.Contains(b.Reason, "runner-registration") || !strings.Contains(b.Reason, "before it registered") && !strings.Contains(b.Reason, "without taking a job") {
				t.Fatalf("backoff %+v; want the failures counted and the agent's last line given", b)
			}
			// Past the wait a runner starts, registers and takes a job:
			// the backoff ends.
			h.clk.Add(maxBackoff)
			h.settle()
			name := h.prov.running()[0]
			h.forge.enrol(name)
			h.out.print(name, "ready")
			h.out.print(name, "busy")
			h.settle()
			if b := h.pool.Backoff(); b.Failures != 0 {
				t.Fatalf("backoff %+v after a runner took a job, want none", b)
			}
		})
	}
}

// A self-registering runner that took a job and went, registration and
// machine, between two passes is no failed start; nor is one the pool
// retired before it registered.
func TestSelfRegisteringRunnerThatServedIsNoCrash(t *testing.T) {
	h := newCapHarness(t, Config{Size: 1})
	h.forge.selfRegister = true
	for range 5 {
		h.settle()
		for _, name := range h.prov.running() {
			h.out.print(name, "ready")
			h.out.print(name, "busy")
			h.out.print(name, "done")
			h.out.vanish(name)
		}
		h.settle()
		h.clk.Add(time.Second)
	}
	if b := h.pool.Backoff(); b.Failures != 0 {
		t.Fatalf("backoff %+v after runners that served; want none", b)
	}
	if h.prov.created < 5 {
		t.Fatalf("%d runners started for 5 jobs", h.prov.created)
	}

	// Scaled down before it registered: retired by the pool.
	h2 := newCapHarness(t, Config{Size: 1, BootstrapTimeout: time.Minute})
	h2.forge.selfRegister = true
	h2.settle()
	h2.clk.Add(2 * time.Minute)
	h2.settle()
	h2.settle()
	if b := h2.pool.Backoff(); b.Failures != 0 {
		t.Fatalf("backoff %+v after the pool retired a runner that had not registered; want none", b)
	}
}

// A burst of jobs starts a runner per job, and none is removed as idle
// above the pool's size while it takes its job, though the forge's list
// still shows it idle when the jobs leave the queue, and its machine is
// older than the idle timeout (an image that took long to pull).
func TestBurstRemovesNoRunnerWhileJobsStart(t *testing.T) {
	var queued atomic.Int64
	queued.Store(3)
	h := newHarness(t, Config{Size: 0, Max: 3, IdleTimeout: time.Minute, BootstrapTimeout: 5 * time.Minute,
		Demand: func([]int64) int { return int(queued.Load()) }})
	h.settle()
	if n := len(h.prov.running()); n != 3 {
		t.Fatalf("%d runners for 3 jobs", n)
	}
	h.clk.Add(90 * time.Second)
	h.online()
	h.settle()
	queued.Store(0) // the jobs were taken; the forge's list lags
	h.settle()
	if len(h.forge.removed) != 0 {
		t.Fatalf("removed %v while they took their jobs", h.forge.removed)
	}
	// Idle for the idle timeout with nothing queued: now they go.
	h.clk.Add(time.Minute)
	h.settle()
	if len(h.forge.removed) != 3 {
		t.Fatalf("removed %v after a minute idle, want all 3", h.forge.removed)
	}
}

// A registration the forge refuses as invalid is reported once and never
// retried, however long the pool runs: the pool is halted, says why, and
// tries again only after its config is reloaded.
func TestRejectedRegistrationHaltsThePool(t *testing.T) {
	h := newHarness(t, Config{Size: 2})
	h.forge.failReg = fmt.Errorf("%w: github register runner gpu-1: 422 labels must have between 1 and 100 items", forge.ErrRejected)
	var registers atomic.Int64
	h.forge.beforeRegister = func() { registers.Add(1) }
	for range 20 {
		h.settle()
		h.clk.Add(time.Minute)
	}
	if n := registers.Load(); n > 2 { // the first pass's two
		t.Fatalf("%d registrations asked for: a refused one was retried", n)
	}
	b := h.pool.Backoff()
	if !b.Halted || !strings.Contains(b.Reason, "422 labels must have between 1 and 100 items") {
		t.Fatalf("backoff %+v, want the pool halted with the forge's reason", b)
	}
	h.forge.failReg = nil
	h.pool.Update(h.pool.cfg)
	h.settle()
	if n := len(h.prov.running()); n != 2 {
		t.Fatalf("%d runners after the reload, want 2", n)
	}
}

// A machine the provider says it will never run as asked (a pod whose
// image its registry does not have) is retired, and the pool halts with
// the provider's words until its config is reloaded: no runner after
// runner registered for the same refusal.
func TestRefusedMachineHaltsThePool(t *testing.T) {
	h := newHarness(t, Config{Size: 2})
	h.settle()
	const why = `runner ErrImagePull: failed to pull and unpack image "docker.io/team/runner:9": not found`
	h.prov.mu.Lock()
	for _, in := range h.prov.insts {
		in.State, in.Refused = provider.StateCreated, why
	}
	made := h.prov.created
	h.prov.mu.Unlock()
	for range 10 {
		h.settle()
		h.clk.Add(time.Minute)
	}
	b := h.pool.Backoff()
	if !b.Halted || !strings.Contains(b.Reason, why) {
		t.Fatalf("backoff %+v, want the pool halted with the provider's reason", b)
	}
	h.prov.mu.Lock()
	left, again := len(h.prov.insts), h.prov.created-made
	h.prov.mu.Unlock()
	if left != 0 || again != 0 {
		t.Fatalf("%d refused machines left, %d made after the refusal", left, again)
	}
	h.pool.Update(h.pool.cfg)
	h.settle()
	if n := len(h.prov.running()); n != 2 {
		t.Fatalf("%d runners after the reload, want 2", n)
	}
}
