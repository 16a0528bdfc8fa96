package bootstrap

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// store is a Source that gives each assignment once, after it was put.
type store struct {
	mu    sync.Mutex
	a     *Assignment
	asked int
	fail  error
}

func (s *store) Take(_ context.Context, h Handoff) (Assignment, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked++
	if s.fail != nil {
		return Assignment{}, s.fail
	}
	if s.a == nil || h.Params["name"] != "i-1" {
		return Assignment{}, ErrNotYet
	}
	a := *s.a
	s.a = nil
	return a, nil
}

func (s *store) put(a Assignment) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.a = &a
}

func handoffPlan(t *testing.T, name string, st *store) (Plan, string) {
	t.Helper()
	RegisterSource(name, func() Source { return st })
	p, off := plan(t, "echo ran $ONLY; cat .runner")
	a := p.Assignment
	p.Assignment = Assignment{}
	p.Handoff = &Handoff{Source: name, Params: map[string]string{"name": "i-1"}, Wait: 5 * time.Second}
	go func() { time.Sleep(100 * time.Millisecond); st.put(a) }()
	return p, off
}

// A plan with a handoff runs the runner it is handed, once the source
// has it; the source is not asked again.
func TestHandoffRunsWhatItIsHanded(t *testing.T) {
	st := &store{}
	p, off := handoffPlan(t, "test-later", st)
	why, out := runPlan(t, p, nil)
	if why != EndAgent || !strings.Contains(out, "ran this") || !strings.Contains(out, "single-use") {
		t.Fatalf("why %q, output %q: the handed assignment did not run", why, out)
	}
	if _, err := os.Stat(off); err != nil {
		t.Fatal("not powered off")
	}
	if _, err := st.Take(context.Background(), *p.Handoff); !errors.Is(err, ErrNotYet) {
		t.Fatalf("a second take: %v, want nothing", err)
	}
}

// A source that refuses for good, or never has the assignment, powers
// the machine off saying why.
func TestHandoffFailurePowersOff(t *testing.T) {
	for _, c := range []struct {
		name string
		st   *store
		want string
	}{
		{"test-refused", &store{fail: errors.New("AccessDeniedException: no policy allows ssm:GetParameter")}, "AccessDeniedException"},
		{"test-never", &store{}, "no assignment within"},
	} {
		t.Run(c.name, func(t *testing.T) {
			RegisterSource(c.name, func() Source { return c.st })
			p, off := plan(t, "echo ran")
			p.Assignment = Assignment{}
			p.Handoff = &Handoff{Source: c.name, Wait: 300 * time.Millisecond}
			why, out := runPlan(t, p, nil)
			if !strings.Contains(why, c.want) || strings.Contains(out, "ran") {
				t.Fatalf("why %q, output %q: want a failure naming %q and no agent", why, out, c.want)
			}
			if _, err := os.Stat(off); err != nil {
				t.Fatal("not powered off")
			}
			if _, err := os.Stat(filepath.Join(p.Workdir, ".runner")); err == nil {
				t.Fatal("files written without an assignment")
			}
		})
	}
}

// Read takes a plan with a handoff and no assignment, and refuses one
// with both.
func TestReadHandoffPlan(t *testing.T) {
	dir := t.TempDir()
	write := func(s string) string {
		f := filepath.Join(dir, "plan.json")
		if err := os.WriteFile(f, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return f
	}
	if _, err := Read(write(`{"handoff":{"source":"aws-ssm"},"workdir":"/w","deadline":"2030-01-01T00:00:00Z","poweroff":["poweroff"]}`)); err != nil {
		t.Fatalf("a handoff plan: %v", err)
	}
	_, err := Read(write(`{"handoff":{"source":"aws-ssm"},"command":"x","workdir":"/w","deadline":"2030-01-01T00:00:00Z","poweroff":["poweroff"]}`))
	if err == nil || !strings.Contains(err.Error(), "holds no assignment") {
		t.Fatalf("a handoff plan with a command: %v", err)
	}
}
