package slurm

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// What `sacct -X -n -P -o JobID,State` prints: a job cancelled by a user
// is "CANCELLED by <uid>" (sacct(1), JOB STATE CODES); a job still running
// is no ended one.
func TestParseSacct(t *testing.T) {
	got := parseSacct([]byte("41|PREEMPTED\n42|CANCELLED by 0\n43|COMPLETED\n44|RUNNING\n45|NODE_FAIL\n\n"))
	want := map[string]string{"41": "PREEMPTED", "42": "CANCELLED", "43": "COMPLETED", "45": "NODE_FAIL"}
	if len(got) != len(want) {
		t.Errorf("read %v, want %v", got, want)
	}
	for id, s := range want {
		if got[id] != s {
			t.Errorf("job %s: %q, want %q", id, got[id], s)
		}
	}
}

// accounts is a fakeCluster with accounting: the states sacct tells of
// jobs the queue no longer lists, and the jobs asked about.
type accounts struct {
	*fakeCluster
	mu     sync.Mutex
	states map[string]string
	asked  [][]string
	err    error
	slow   time.Duration // how long sacct takes to answer
}

func (a *accounts) Ended(_ context.Context, ids []string) (map[string]string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.asked = append(a.asked, ids)
	time.Sleep(a.slow)
	if a.err != nil {
		return nil, a.err
	}
	out := map[string]string{}
	for _, id := range ids {
		if s, ok := a.states[id]; ok {
			out[id] = s
		}
	}
	return out, nil
}

// A runner's job that left the queue while the manager was away (its
// record older than any read's lag, no notice file) is asked of
// accounting once: one lost with its node is a notice, one that completed
// is not, and neither is asked about again.
func TestAccountingTellsJobsThatLeftTheQueue(t *testing.T) {
	ac := &accounts{fakeCluster: &fakeCluster{}, states: map[string]string{"7": "NODE_FAIL", "8": "COMPLETED"}}
	s, err := DecodeSection([]byte(`{}`), 1)
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{Manager: "m", Pool: "p", Section: s, Spool: t.TempDir(), Workdir: "/w", Cluster: ac})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var mu sync.Mutex
	var notices []provider.Notice
	p.poller.WatchPreemption(t.Context(), func(n provider.Notice) { mu.Lock(); notices = append(notices, n); mu.Unlock() })
	old := time.Now().Add(-time.Hour)
	for _, r := range []record{{Name: "p-1", JobID: "7"}, {Name: "p-2", JobID: "8"}} {
		r.Manager, r.Pool, r.Created = "m", "p", old
		if err := p.writeRecord(r); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		list, err := p.List(context.Background(), "m")
		if err != nil || len(list) != 2 || list[0].State != provider.StateExited || list[1].State != provider.StateExited {
			t.Fatalf("listed %+v %v", list, err)
		}
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		n := len(notices)
		mu.Unlock()
		if n > 0 {
			break
		}
	}
	time.Sleep(50 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(notices) != 1 || notices[0].Name != "p-1" || !strings.Contains(notices[0].Reason, "NODE_FAIL") {
		t.Errorf("notices %+v, want one for p-1's NODE_FAIL", notices)
	}
	// The poller reads beside the Lists, and may have read the spool
	// while the records were written: each job asked once, in one ask or
	// two.
	ac.mu.Lock()
	defer ac.mu.Unlock()
	if asked := slices.Sorted(slices.Values(slices.Concat(ac.asked...))); !slices.Equal(asked, []string{"7", "8"}) {
		t.Errorf("accounting asked %v, want once about each job", ac.asked)
	}
}

// Without accounting (sacct: "Slurm accounting storage is disabled"), it
// is asked once, and then no more.
func TestNoAccountingAsksOnce(t *testing.T) {
	ac := &accounts{fakeCluster: &fakeCluster{}, err: ErrNoAccounting}
	s, _ := DecodeSection([]byte(`{}`), 1)
	p, err := New(Options{Manager: "m", Pool: "p", Section: s, Spool: t.TempDir(), Workdir: "/w", Cluster: ac})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for i, id := range []string{"7", "8"} {
		if err := p.writeRecord(record{Name: "p-" + id, Manager: "m", Pool: "p", JobID: id, Created: time.Now().Add(-time.Hour)}); err != nil {
			t.Fatal(err)
		}
		if _, err := p.List(context.Background(), "m"); err != nil {
			t.Fatal(i, err)
		}
	}
	if len(ac.asked) != 1 || !errors.Is(ac.err, ErrNoAccounting) {
		t.Errorf("asked %v: want once", ac.asked)
	}
}

// Two reads at once (a pass's List and the poller's) ask accounting once
// about a job: one answer, so one notice of its loss.
func TestAccountingAskedOnceByReadsAtOnce(t *testing.T) {
	ac := &accounts{fakeCluster: &fakeCluster{}, states: map[string]string{"7": "NODE_FAIL"}, slow: 200 * time.Millisecond}
	s, _ := DecodeSection([]byte(`{}`), 1)
	p, err := New(Options{Manager: "m", Pool: "p", Section: s, Spool: t.TempDir(), Workdir: "/w", Cluster: ac})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.writeRecord(record{Name: "p-1", Manager: "m", Pool: "p", JobID: "7", Created: time.Now().Add(-time.Hour)}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			if _, err := p.List(context.Background(), "m"); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	ac.mu.Lock()
	defer ac.mu.Unlock()
	if len(ac.asked) != 1 {
		t.Errorf("accounting asked %v, want once", ac.asked)
	}
}
