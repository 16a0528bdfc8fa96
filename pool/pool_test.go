package pool

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

type harness struct {
	t     *testing.T
	clk   *clock
	forge *fakeForge
	prov  *fakeProvider
	pool  *Pool
}

func newHarness(t *testing.T, cfg Config) *harness {
	t.Helper()
	clk := &clock{t: time.Date(2026, 11, 20, 12, 0, 0, 0, time.UTC)}
	if cfg.Name == "" {
		cfg.Name = "gpu"
	}
	if cfg.Manager == "" {
		cfg.Manager = "m1"
	}
	if cfg.Runners.Labels == nil {
		cfg.Runners.Labels = []string{"gpu"}
	}
	if cfg.BootstrapTimeout == 0 {
		cfg.BootstrapTimeout = 2 * time.Minute
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = 10 * time.Minute
	}
	h := &harness{t: t, clk: clk, forge: newFakeForge(), prov: newFakeProvider(clk.Now)}
	h.pool = New(cfg, h.forge, h.prov, fakeAgent{}, WithClock(clk.Now), WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	return h
}

// settle runs passes until nothing is in flight.
func (h *harness) settle() {
	h.t.Helper()
	for range 10 {
		if err := h.pool.Reconcile(context.Background()); err != nil {
			h.t.Fatalf("reconcile: %v", err)
		}
		h.pool.Wait()
		h.pool.mu.Lock()
		n := len(h.pool.pending)
		h.pool.mu.Unlock()
		if n == 0 {
			if err := h.pool.Reconcile(context.Background()); err != nil {
				h.t.Fatalf("reconcile: %v", err)
			}
			h.pool.Wait()
			return
		}
	}
}

// online marks every registered runner idle, as agents that connected.
func (h *harness) online() {
	h.forge.mu.Lock()
	defer h.forge.mu.Unlock()
	for _, r := range h.forge.runners {
		if r.Status == forge.StatusOffline {
			r.Status = forge.StatusIdle
		}
	}
}

func (h *harness) states() map[State]int {
	out := map[State]int{}
	for _, r := range h.pool.Runners() {
		out[r.State]++
	}
	return out
}

func sorted(s []string) []string { slices.Sort(s); return s }

func TestFillsToSize(t *testing.T) {
	h := newHarness(t, Config{Size: 3})
	h.settle()
	if got := sorted(h.prov.running()); !slices.Equal(got, []string{"gpu-1", "gpu-2", "gpu-3"}) {
		t.Fatalf("running = %v, want gpu-1..3", got)
	}
	if h.forge.count() != 3 {
		t.Fatalf("registrations = %d, want 3", h.forge.count())
	}
	// The agent got the runner's own credential and nothing else.
	if spec := h.prov.specs["gpu-1"]; len(spec.Files) != 1 {
		t.Fatalf("files = %v", spec.Files)
	}
}

func TestReplenishesWhenJobEnds(t *testing.T) {
	h := newHarness(t, Config{Size: 2})
	h.settle()
	h.online()
	h.forge.set("gpu-1", forge.StatusBusy)
	h.settle()
	if s := h.states(); s[StateBusy] != 1 || s[StateIdle] != 1 {
		t.Fatalf("states = %v, want 1 busy 1 idle (max = size: no third runner)", s)
	}
	h.forge.finish("gpu-1", h.prov)
	h.settle()
	if got := sorted(h.prov.running()); !slices.Equal(got, []string{"gpu-1", "gpu-2"}) {
		t.Fatalf("running = %v: the freed name gpu-1 should be reused", got)
	}
	if !slices.Contains(h.prov.deleted, "gpu-1") {
		t.Fatalf("exited gpu-1 was not cleaned up: deleted = %v", h.prov.deleted)
	}
	if h.prov.created != 3 {
		t.Fatalf("created = %d, want 3", h.prov.created)
	}
}

func TestBusyRunnerIsReplacedUpToMax(t *testing.T) {
	h := newHarness(t, Config{Size: 2, Max: 3})
	h.settle()
	h.online()
	h.forge.set("gpu-1", forge.StatusBusy)
	h.forge.set("gpu-2", forge.StatusBusy)
	h.settle()
	if got := len(h.prov.running()); got != 3 {
		t.Fatalf("running = %d, want 3 (2 busy + 1 idle, capped by max)", got)
	}
}

func TestBootstrapTimeoutReplacesRunner(t *testing.T) {
	h := newHarness(t, Config{Size: 1, BootstrapTimeout: time.Minute})
	h.settle()
	h.clk.Add(59 * time.Second)
	h.settle()
	if len(h.prov.deleted) != 0 {
		t.Fatalf("removed before the bootstrap timeout")
	}
	h.clk.Add(2 * time.Second)
	h.settle()
	if !slices.Contains(h.prov.deleted, "gpu-1") || !slices.Contains(h.forge.removed, "gpu-1") {
		t.Fatalf("runner that never came online was not removed: deleted %v, deregistered %v", h.prov.deleted, h.forge.removed)
	}
	if len(h.prov.running()) != 1 || h.forge.count() != 1 {
		t.Fatalf("pool not refilled: running %v, registrations %d", h.prov.running(), h.forge.count())
	}
}

func TestMaxLifetimeRecyclesIdleNotBusy(t *testing.T) {
	h := newHarness(t, Config{Size: 2, MaxLifetime: time.Hour})
	h.settle()
	h.online()
	h.forge.set("gpu-2", forge.StatusBusy)
	h.clk.Add(61 * time.Minute)
	h.settle()
	if !slices.Contains(h.prov.deleted, "gpu-1") {
		t.Fatalf("idle runner past max lifetime was not recycled")
	}
	if slices.Contains(h.prov.deleted, "gpu-2") {
		t.Fatalf("busy runner was removed")
	}
}

func TestRemovesOrphanRegistrationKeepsBusyOne(t *testing.T) {
	h := newHarness(t, Config{Size: 0})
	h.forge.Register(context.Background(), forge.RunnerRequest{Name: "gpu-7"})
	h.forge.Register(context.Background(), forge.RunnerRequest{Name: "gpu-8"})
	h.forge.set("gpu-8", forge.StatusBusy)
	h.forge.Register(context.Background(), forge.RunnerRequest{Name: "someone-elses-1"})
	h.settle()
	if h.forge.byName("gpu-7") != nil {
		t.Fatalf("registration without a machine was not removed")
	}
	if h.forge.byName("gpu-8") == nil {
		t.Fatalf("busy registration was removed")
	}
	if h.forge.byName("someone-elses-1") == nil {
		t.Fatalf("a registration of another pool was touched")
	}
}

func TestRemovesMachineWithoutRegistrationAfterGrace(t *testing.T) {
	h := newHarness(t, Config{Size: 0, OrphanGrace: 15 * time.Second})
	h.prov.add(provider.Instance{Name: "gpu-4", Manager: "m1", Pool: "gpu", State: provider.StateRunning, Created: h.clk.Now()})
	h.prov.add(provider.Instance{Name: "gpu-5", Manager: "other", Pool: "gpu", State: provider.StateRunning, Created: h.clk.Now()})
	h.settle()
	if len(h.prov.deleted) != 0 {
		t.Fatalf("removed during the grace period")
	}
	h.clk.Add(16 * time.Second)
	h.settle()
	if !slices.Equal(h.prov.deleted, []string{"gpu-4"}) {
		t.Fatalf("deleted = %v, want only gpu-4 (gpu-5 belongs to another manager)", h.prov.deleted)
	}
}

func TestCreateFailureLeavesNoRegistrationAndBacksOff(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	h.prov.failNext = errors.New("no such binary")
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if h.forge.count() != 0 {
		t.Fatalf("a failed create left %d registrations", h.forge.count())
	}
	// Backoff: an immediate pass creates nothing.
	h.pool.Reconcile(context.Background())
	h.pool.Wait()
	if len(h.prov.running()) != 0 {
		t.Fatalf("created again without backing off")
	}
	h.clk.Add(2 * time.Second)
	h.settle()
	if len(h.prov.running()) != 1 {
		t.Fatalf("not retried after the backoff")
	}
}

func TestDrainRemovesIdleWaitsForBusy(t *testing.T) {
	h := newHarness(t, Config{Size: 3})
	h.settle()
	h.online()
	h.forge.set("gpu-2", forge.StatusBusy)
	go func() {
		time.Sleep(300 * time.Millisecond)
		h.forge.finish("gpu-2", h.prov)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if left := h.pool.Drain(ctx); len(left) != 0 {
		t.Fatalf("drain left %v", left)
	}
	if len(h.prov.running()) != 0 || h.forge.count() != 0 {
		t.Fatalf("after drain: running %v, registrations %d", h.prov.running(), h.forge.count())
	}
	if h.prov.created != 3 {
		t.Fatalf("drain created runners: %d", h.prov.created)
	}
}

func TestDrainTimeoutKeepsBusyRunner(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	h.settle()
	h.online()
	h.forge.set("gpu-1", forge.StatusBusy)
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	left := h.pool.Drain(ctx)
	if len(left) != 1 || left[0].State != StateBusy {
		t.Fatalf("left = %v, want the busy runner", left)
	}
	if len(h.prov.deleted) != 0 {
		t.Fatalf("busy runner was killed")
	}
}

func TestRaceBusyDuringRetireKeepsRunner(t *testing.T) {
	// The forge refuses to remove a runner that took a job between the
	// pass and the removal: the machine must stay.
	h := newHarness(t, Config{Size: 1, MaxLifetime: time.Minute})
	h.settle()
	h.online()
	h.clk.Add(2 * time.Minute)
	h.pool.Reconcile(context.Background())
	h.forge.set("gpu-1", forge.StatusBusy) // takes a job before the retire goroutine runs
	h.pool.Wait()
	h.forge.mu.Lock()
	removed := slices.Clone(h.forge.removed)
	h.forge.mu.Unlock()
	if len(removed) == 0 && slices.Contains(h.prov.deleted, "gpu-1") {
		t.Fatalf("machine deleted although its registration was kept")
	}
}

func TestForgeDownIsAnErrorNotACrash(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	h.forge.failList = errors.New("dial tcp 127.0.0.1:1: connection refused")
	err := h.pool.Reconcile(context.Background())
	if err == nil || h.pool.LastError() == nil {
		t.Fatalf("want an error from a pass against a forge that is down")
	}
	down := h.clk.Now()
	if len(h.prov.running()) != 0 {
		t.Fatalf("created a runner without knowing the forge's state")
	}
	// The outage is dated from its first failed pass, not its last.
	h.clk.Add(time.Minute)
	h.pool.Reconcile(context.Background())
	if got := h.pool.FailingSince(); !got.Equal(down) {
		t.Fatalf("failing since %v, want the first failed pass at %v", got, down)
	}
	h.forge.failList = nil
	h.settle()
	if len(h.prov.running()) != 1 {
		t.Fatalf("did not recover once the forge was back")
	}
	if h.pool.LastError() != nil || !h.pool.FailingSince().IsZero() {
		t.Fatalf("still failing after a pass that worked: %v since %v", h.pool.LastError(), h.pool.FailingSince())
	}
}

func TestObserveChangesNothing(t *testing.T) {
	h := newHarness(t, Config{Size: 2})
	h.forge.Register(context.Background(), forge.RunnerRequest{Name: "gpu-9"})
	rs, err := h.pool.Observe(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if len(rs) != 1 || rs[0].State != StateOrphan {
		t.Fatalf("observe = %+v", rs)
	}
	if h.forge.count() != 1 || h.prov.created != 0 {
		t.Fatalf("observe changed something")
	}
}

func TestRunReactsToExitEvent(t *testing.T) {
	h := newHarness(t, Config{Size: 1, Resync: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go h.pool.Run(ctx)
	waitFor(t, func() bool { return len(h.prov.running()) == 1 })
	h.online()
	h.forge.finish("gpu-1", h.prov)
	// With an hour between resyncs, only the exit event can refill it.
	waitFor(t, func() bool {
		h.prov.mu.Lock()
		defer h.prov.mu.Unlock()
		return h.prov.created == 2
	})
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// createDuringListing makes a create complete while a pass lists: pass 1
// starts creating gpu-1 and its Register blocks; pass 2 lists (nothing
// yet), and before it decides the create completes. Then the pool
// settles.
func createDuringListing(t *testing.T, h *harness) {
	t.Helper()
	release := make(chan struct{})
	h.forge.beforeRegister = func() { <-release }
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.forge.afterRunners = func() {
		h.forge.afterRunners = nil
		close(release)
		h.pool.Wait()
	}
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	h.forge.beforeRegister = nil
	h.settle()
}

// A create that completes while another pass is between listing and
// deciding must not make that pass register the same name again.
func TestStaleSnapshotDoesNotDuplicate(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	createDuringListing(t, h)
	if h.forge.nextID != 1 {
		t.Fatalf("made %d registrations, want 1", h.forge.nextID)
	}
}

// A create that completes while another pass is listing is not taken
// for a runner that ended between passes: the listing predates it. (Seen
// in CI: three runners reported "its machine ended and the forge deleted
// its registration" 2 ms after they started, and ran their jobs on.)
func TestRunnerStartedDuringListingIsNotEnded(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	var log syncBuffer
	h.pool = New(h.pool.cfg, h.forge, h.prov, fakeAgent{}, WithClock(h.clk.Now), WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
	createDuringListing(t, h)
	if strings.Contains(log.String(), "runner removed") {
		t.Errorf("a runner that had just started was reported gone:\n%s", log.String())
	}
	if n := len(h.prov.running()); n != 1 {
		t.Errorf("%d runners running, want 1", n)
	}
}

// syncBuffer is a bytes.Buffer for a logger that passes and creates
// write from their own goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A create cut short because the pool stops (its context cancelled
// mid-call, as at a drain) is no start failure: no backoff is recorded,
// which would be saved and hold the next manager off.
func TestCreateCutShortByStopDoesNotBackOff(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	ctx, cancel := context.WithCancel(context.Background())
	h.forge.beforeRegister = cancel
	h.prov.failNext = context.Canceled // the engine's call, cut short
	if err := h.pool.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if b := h.pool.Backoff(); b.Failures != 0 {
		t.Fatalf("backoff %+v after a create cut short by the stop", b)
	}
}

// TestRefusedRemovalBacksOff: a runner whose machine vanished mid-job and
// which the forge still counts busy is asked for again after a backoff,
// not on every pass, and is removed once the forge lets go of it.
func TestRefusedRemovalBacksOff(t *testing.T) {
	h := newHarness(t, Config{Size: 0, BootstrapTimeout: time.Minute})
	h.forge.Register(context.Background(), forge.RunnerRequest{Name: "gpu-3"})
	h.forge.set("gpu-3", forge.StatusBusy)
	h.settle()
	h.clk.Add(2 * time.Minute) // past the grace for a vanished machine
	h.settle()
	calls := func() int {
		h.forge.mu.Lock()
		defer h.forge.mu.Unlock()
		return h.forge.removals
	}
	first := calls()
	if first == 0 {
		t.Fatalf("the registration was never asked to go")
	}
	for range 20 {
		h.settle()
	}
	if n := calls() - first; n != 0 {
		t.Fatalf("%d more removal calls within the backoff, want 0", n)
	}
	h.clk.Add(6 * time.Second)
	h.settle()
	if n := calls() - first; n != 1 {
		t.Fatalf("%d removal calls after the first backoff, want 1", n)
	}
	h.forge.set("gpu-3", forge.StatusOffline) // the forge gave up on the job
	h.clk.Add(11 * time.Second)
	h.settle()
	if h.forge.byName("gpu-3") != nil {
		t.Fatalf("the registration stayed after the forge let go of it")
	}
}

// startedAnywayProvider reports a failed start for a machine that came up
// all the same and whose runner took a job at once, as a container does
// whose start the engine carried out after its caller gave up.
type startedAnywayProvider struct {
	*fakeProvider
	forge *fakeForge
}

func (p startedAnywayProvider) Create(ctx context.Context, s provider.Spec) (provider.Instance, error) {
	if _, err := p.fakeProvider.Create(ctx, s); err != nil {
		return provider.Instance{}, err
	}
	p.forge.set(s.Name, forge.StatusBusy)
	return provider.Instance{}, errors.New("start container: context canceled")
}

// TestFailedStartThatTookAJobIsKept: a runner whose start was reported
// failed but which took a job keeps its machine, and its job.
func TestFailedStartThatTookAJobIsKept(t *testing.T) {
	h := newHarness(t, Config{Size: 1})
	h.pool = New(h.pool.cfg, h.forge, startedAnywayProvider{h.prov, h.forge}, fakeAgent{}, WithClock(h.clk.Now), WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if len(h.prov.deleted) != 0 || h.forge.byName("gpu-1") == nil {
		t.Fatalf("deleted %v, registration %v: the busy runner was removed", h.prov.deleted, h.forge.byName("gpu-1"))
	}
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if st := h.states(); st[StateBusy] != 1 {
		t.Fatalf("states %v, want gpu-1 busy", st)
	}
}

// A runner whose agent reached the forge and whose machine was gone by the
// next pass (a fast job on a cloud machine that powers itself off) has
// served: the forge lists it online, as GitLab lists a runner contacted
// within the last hours, though the pool never saw it idle or busy with
// its machine. Before it is seen online, nothing has served.
func TestServedBySeenOnlineWithoutMachine(t *testing.T) {
	h := newHarness(t, Config{Size: 1, Max: 1})
	h.settle()
	if h.pool.Served() {
		t.Fatal("served before any agent reached the forge")
	}
	h.prov.mu.Lock()
	for name := range h.prov.insts {
		delete(h.prov.insts, name) // the machine powered itself off
	}
	h.prov.mu.Unlock()
	h.online()
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if !h.pool.Served() {
		t.Error("a runner the forge lists online, its machine gone, has not served")
	}
}

// A runner whose agent connected, ran its job and went offline, and
// whose machine ended, all between two passes (a fast step on a cloud
// machine, a Bitbucket runner, which stays registered, OFFLINE): the
// forge says it connected, so it has served; one that never connected
// (UNREGISTERED) has not.
func TestServedByConnectedOffline(t *testing.T) {
	for _, connected := range []bool{false, true} {
		h := newHarness(t, Config{Size: 1, Max: 1})
		h.settle()
		h.prov.mu.Lock()
		for name := range h.prov.insts {
			delete(h.prov.insts, name)
		}
		h.prov.mu.Unlock()
		h.forge.mu.Lock()
		for _, r := range h.forge.runners {
			r.Connected = connected // still offline
		}
		h.forge.mu.Unlock()
		if err := h.pool.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
		h.pool.Wait()
		if h.pool.Served() != connected {
			t.Errorf("connected %v: served %v", connected, h.pool.Served())
		}
	}
}

// A runner whose agent reached the forge, ran a fast job and ended, its
// machine still listed (an EC2 instance stopping), has served, though the
// driver's kept listing, read before the agent came, says it never
// connected: the pass after a machine ended reads the forge afresh, as
// GitLab then lists the runner online (contacted within the last hours).
func TestServedByExitWithKeptListing(t *testing.T) {
	h := newHarness(t, Config{Size: 1, Max: 1})
	h.forge.keep = true
	h.settle()
	h.online() // at the forge; the kept listing still says offline
	for _, name := range h.prov.running() {
		h.prov.exit(name)
	}
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if !h.pool.Served() {
		t.Error("a runner the forge lists online once read afresh, its machine ended, has not served")
	}
}

// A runner whose machine ended and whose registration the forge deleted,
// both between two passes (a one-second job on a machine that powers
// itself off, an ephemeral runner), has served, and its end is logged;
// the kept listing is read afresh once a machine has ended.
func TestServedByEndBetweenPasses(t *testing.T) {
	h := newHarness(t, Config{Size: 1, Max: 1})
	h.settle()
	h.online()
	h.settle()
	h.pool.mu.Lock()
	h.pool.served = false // as before the agent reached the forge
	h.pool.mu.Unlock()
	h.prov.mu.Lock()
	for name := range h.prov.insts {
		delete(h.prov.insts, name)
	}
	h.prov.mu.Unlock()
	h.forge.mu.Lock()
	for id := range h.forge.runners {
		delete(h.forge.runners, id)
	}
	h.forge.mu.Unlock()
	if err := h.pool.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.pool.Wait()
	if !h.pool.Served() {
		t.Error("a runner that ended between two passes has not served")
	}
	if h.forge.refreshed == 0 {
		t.Error("the forge's kept listing was not read afresh after a machine ended")
	}
}
