package bootstrap

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

type fakeNotices struct {
	interrupt, rebalance atomic.Bool
}

func (f *fakeNotices) Interruption(context.Context) (time.Time, bool, error) {
	return time.Now().Add(300 * time.Millisecond), f.interrupt.Load(), nil
}

func (f *fakeNotices) Rebalance(context.Context) (bool, error) { return f.rebalance.Load(), nil }

// syncBuffer is the agent's console, read while it is written.
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

// plan runs script as the agent; its power-off writes a file.
func plan(t *testing.T, script string) (Plan, string) {
	t.Helper()
	dir := t.TempDir()
	off := filepath.Join(dir, "powered-off")
	return Plan{
		Assignment: Assignment{
			Runner: "r-1", Command: "/bin/sh", Args: []string{"-c", script},
			Env:        map[string]string{"ONLY": "this"},
			Files:      map[string][]byte{".runner": []byte("single-use"), "sub/cfg.yaml": []byte("x: 1")},
			BusyMarker: "took a job",
		},
		Workdir:     filepath.Join(dir, "work"),
		IdleTimeout: time.Hour, Deadline: time.Now().Add(time.Hour),
		Poweroff: []string{"/bin/sh", "-c", "touch " + off},
	}, off
}

func runPlan(t *testing.T, p Plan, n Notices) (string, string) {
	t.Helper()
	var out syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	why, err := Run(ctx, p, Options{Notices: n, NoticeInterval: 50 * time.Millisecond, Tick: 20 * time.Millisecond, HoldGrace: 200 * time.Millisecond, Output: &out})
	if err != nil {
		t.Fatal(err)
	}
	return why, out.String()
}

func TestAgentEndPowersOff(t *testing.T) {
	p, off := plan(t, `echo "env: $(env | sort | tr '\n' ' ')"; stat -c '%a %n' . .runner sub/cfg.yaml; cat .runner`)
	t.Setenv("MANAGER_SECRET", "must-not-leak")
	why, out := runPlan(t, p, nil)
	if why != EndAgent {
		t.Errorf("why = %q", why)
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}
	for _, want := range []string{"ONLY=this", "PATH=", "700 .", "600 .runner", "600 sub/cfg.yaml", "single-use"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "must-not-leak") {
		t.Error("the agent inherited runfleet's environment")
	}
}

func TestIdleTimeout(t *testing.T) {
	p, off := plan(t, "echo waiting; exec sleep 60")
	p.IdleTimeout = 300 * time.Millisecond
	start := time.Now()
	if why, _ := runPlan(t, p, nil); why != EndIdle {
		t.Errorf("why = %q, want %q", why, EndIdle)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("took %s: the agent was not stopped", took)
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}
}

func TestBusyRunsToDeadline(t *testing.T) {
	p, _ := plan(t, "echo took a job; exec sleep 60")
	p.IdleTimeout = 100 * time.Millisecond
	p.Deadline = time.Now().Add(time.Second)
	n := &fakeNotices{}
	// The recommendation comes once the agent took its job (the agent's
	// line is written out after the watcher marked it busy): a busy
	// machine keeps its job. Set from the start, it could come first on
	// a loaded machine, and rightly end an idle one.
	out := tellOnLine{marker: "took a job", seen: func() { n.rebalance.Store(true) }}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	why, err := Run(ctx, p, Options{Notices: n, NoticeInterval: 50 * time.Millisecond, Tick: 20 * time.Millisecond, Output: &out})
	if err != nil || why != EndDeadline {
		t.Errorf("why = %q (%v), want %q", why, err, EndDeadline)
	}
}

// tellOnLine is an agent's console that calls seen once a write holds
// the marker.
type tellOnLine struct {
	marker string
	once   sync.Once
	seen   func()
}

func (w *tellOnLine) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(w.marker)) {
		w.once.Do(w.seen)
	}
	return len(p), nil
}

func TestInterruptionEndsTheRunner(t *testing.T) {
	for _, busy := range []bool{false, true} {
		script := "echo waiting; exec sleep 60"
		if busy {
			script = "echo took a job; exec sleep 60"
		}
		p, off := plan(t, script)
		n := &fakeNotices{}
		n.interrupt.Store(true)
		start := time.Now()
		if why, _ := runPlan(t, p, n); why != EndInterruption {
			t.Errorf("busy=%v: why = %q, want %q", busy, why, EndInterruption)
		}
		// Up until the notice's time and the grace: the manager reads
		// the notice from the cloud meanwhile.
		if took := time.Since(start); took < 500*time.Millisecond {
			t.Errorf("busy=%v: powered off after %s, before the notice's time and grace", busy, took)
		}
		if _, err := os.Stat(off); err != nil {
			t.Error("not powered off")
		}
	}
}

func TestRebalanceEndsAnIdleRunner(t *testing.T) {
	p, _ := plan(t, "echo waiting; exec sleep 60")
	n := &fakeNotices{}
	n.rebalance.Store(true)
	if why, _ := runPlan(t, p, n); why != EndRebalance {
		t.Errorf("why = %q, want %q", why, EndRebalance)
	}
}

func TestPastDeadlineStartsNothing(t *testing.T) {
	p, off := plan(t, "echo started")
	p.Deadline = time.Now().Add(-time.Second)
	why, out := runPlan(t, p, nil)
	if why != EndDeadline || strings.Contains(out, "started") {
		t.Errorf("why = %q, output %q", why, out)
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}
}

func TestReadNamesProblems(t *testing.T) {
	path := filepath.Join(t.TempDir(), "plan.json")
	os.WriteFile(path, []byte(`{"workdir":"rel"}`), 0o600)
	_, err := Read(path)
	for _, want := range []string{"command: is empty", `workdir: "rel"`, "deadline: is not set", "poweroff: is empty"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
}

// A job step in a session of its own (as gitea-runner starts them) is
// stopped with its agent.
func TestStopReachesJobSteps(t *testing.T) {
	p, _ := plan(t, "echo took a job; setsid sleep 60 & echo step=$!; wait")
	p.Deadline = time.Now().Add(time.Second)
	why, out := runPlan(t, p, nil)
	if why != EndDeadline {
		t.Fatalf("why = %q", why)
	}
	i := strings.Index(out, "step=")
	if i < 0 {
		t.Fatalf("output %q", out)
	}
	pid := strings.TrimSpace(strings.SplitN(out[i+5:], "\n", 2)[0])
	if _, err := os.Stat("/proc/" + pid); err == nil {
		if b, _ := os.ReadFile("/proc/" + pid + "/stat"); !strings.Contains(string(b), ") Z") {
			t.Errorf("the job step %s outlived its agent", pid)
		}
	}
}

// watchingNotices holds its watch until told, as Compute Engine's metadata
// server holds a wait_for_change request; its polls say nothing.
type watchingNotices struct {
	fakeNotices
	now chan struct{}
}

func (w *watchingNotices) WatchInterruption(ctx context.Context) (time.Time, error) {
	select {
	case <-w.now:
		return time.Now().Add(300 * time.Millisecond), nil
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	}
}

// A notice the metadata service holds a request for ends the runner as it
// comes, not at the next poll (here an hour away).
func TestWatchedInterruption(t *testing.T) {
	p, _ := plan(t, "echo took a job; exec sleep 60")
	w := &watchingNotices{now: make(chan struct{})}
	time.AfterFunc(200*time.Millisecond, func() { close(w.now) })
	var out syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	why, err := Run(ctx, p, Options{Notices: w, NoticeInterval: time.Hour, Tick: 20 * time.Millisecond, HoldGrace: 100 * time.Millisecond, Output: &out})
	if err != nil || why != EndInterruption {
		t.Fatalf("why = %q, %v; want %q", why, err, EndInterruption)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the watched notice ended the runner after %s", took)
	}
}

// slowNotices answers its first call after first, as Azure's Scheduled
// Events may take up to two minutes to, and every later one after later;
// it notes whether the agent had started (its file exists) by the first
// answer. It says how it wants to be asked.
type slowNotices struct {
	fakeNotices
	first, later, interval time.Duration
	calls                  atomic.Int32
	agentFile              string
	startedEarly           atomic.Bool
}

func (s *slowNotices) Pace() (time.Duration, time.Duration) {
	return s.interval, 2 * max(s.first, s.later)
}

func (s *slowNotices) Interruption(ctx context.Context) (time.Time, bool, error) {
	wait := s.later
	n := s.calls.Add(1)
	if n == 1 {
		wait = s.first
	}
	select {
	case <-time.After(wait):
	case <-ctx.Done():
		return time.Time{}, false, ctx.Err()
	}
	if _, err := os.Stat(s.agentFile); n == 1 && err == nil {
		s.startedEarly.Store(true)
	}
	return s.fakeNotices.Interruption(ctx)
}

// The cloud's pace is kept: the first answer, slower than the default
// interval, is waited for before the agent starts (a notice that came
// meanwhile is not lost with a job), and a slow answer after it holds up
// nothing (the agent's exit ends the runner at once).
func TestPacedNotices(t *testing.T) {
	p, _ := plan(t, "touch started; echo took a job; exec sleep 60")
	s := &slowNotices{first: 500 * time.Millisecond, interval: 20 * time.Millisecond, agentFile: filepath.Join(p.Workdir, "started")}
	s.interrupt.Store(true)
	if why, _ := runPlan(t, p, s); why != EndInterruption {
		t.Errorf("why = %q: the slow first answer was not waited for", why)
	}
	if s.startedEarly.Load() {
		t.Error("the agent started before the metadata service's first answer")
	}
	p, _ = plan(t, "echo took a job; sleep 0.5; exit 0")
	s = &slowNotices{later: 10 * time.Second, interval: 20 * time.Millisecond, agentFile: filepath.Join(p.Workdir, "started")}
	start := time.Now()
	if why, _ := runPlan(t, p, s); why != EndAgent || time.Since(start) > 5*time.Second {
		t.Errorf("why = %q after %s: a slow metadata service held up the agent's end", why, time.Since(start))
	}
}

// A machine being taken back stops its job and agent within the shortest
// notice (30 s, Compute Engine's and Azure's): an agent that ignores
// SIGTERM is killed after the grace.
func TestInterruptionStopsInTime(t *testing.T) {
	if 2*interruptGrace+time.Second > 25*time.Second {
		t.Errorf("stopping after a notice takes up to %s, over 25 s", 2*interruptGrace)
	}
	cmd := exec.Command("/bin/sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	outp, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 6)
	_, _ = outp.Read(buf) // the trap is set
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	start := time.Now()
	stop(cmd.Process.Pid, exited, 200*time.Millisecond)
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("stopped after %s with a grace of 200ms", took)
	}
}
