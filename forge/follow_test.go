package forge

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// A follow-up outlives the pass that started it, runs once per runner at
// a time, is waited for at Wait, and is cancelled when Wait's context
// ends first.
func TestFollowingOutlivesItsPassAndIsDrained(t *testing.T) {
	var f Following
	pass, endPass := context.WithCancel(context.Background())
	release := make(chan struct{})
	var runs, finished atomic.Int32
	follow := func(ctx context.Context) {
		runs.Add(1)
		select {
		case <-release:
			finished.Add(1)
		case <-ctx.Done():
		}
	}
	f.Go(pass, Runner{ID: 7}, follow)
	f.Go(pass, Runner{ID: 7}, follow) // followed already
	endPass()
	time.Sleep(10 * time.Millisecond)
	close(release)
	f.Wait(context.Background())
	if runs.Load() != 1 || finished.Load() != 1 {
		t.Fatalf("%d runs, %d finished; want 1 run that finished after its pass ended", runs.Load(), finished.Load())
	}

	// Drained with no time left: cancelled, and returned before Wait does.
	var cancelled atomic.Bool
	f.Go(context.Background(), Runner{Name: "r-1"}, func(ctx context.Context) {
		<-ctx.Done()
		cancelled.Store(true)
	})
	over, cancel := context.WithCancel(context.Background())
	cancel()
	f.Wait(over)
	if !cancelled.Load() {
		t.Fatal("Wait returned before the cancelled follow-up did")
	}
}

// A connection's Drain stops its follow-ups at once, however long they
// would wait (a re-run waiting for its run to end), and returns once they
// did: a drain is not held for its timeout by work the next manager takes
// up.
func TestFollowingStopsAtDrain(t *testing.T) {
	var f Following
	var returned atomic.Bool
	f.Go(context.Background(), Runner{ID: 9}, func(ctx context.Context) {
		select {
		case <-ctx.Done():
		case <-time.After(time.Hour): // the run never ends here
		}
		returned.Store(true)
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	f.Stop(ctx)
	if !returned.Load() || ctx.Err() != nil {
		t.Fatalf("Stop returned after %v, the follow-up returned: %v", time.Since(start), returned.Load())
	}
}

// With a ledger, a follow-up is owed from its start until it returns by
// itself; one ended by Stop (a drain) stays owed, for the next manager
// on the same state, which reads it back from the directory.
func TestFollowingLedger(t *testing.T) {
	dir := t.TempDir()
	f := Following{Ledger: LedgerDir{Dir: dir}}
	release := make(chan struct{})
	f.Go(context.Background(), Runner{ID: 6, Name: "pool-2"}, func(ctx context.Context) {
		select {
		case <-release:
		case <-ctx.Done():
		}
	})
	f.Go(context.Background(), Runner{Name: "pool-5"}, func(ctx context.Context) { <-ctx.Done() })
	if got := (LedgerDir{Dir: dir}).Owed(); len(got) != 2 {
		t.Fatalf("owed while they run: %+v, want both runners", got)
	}
	close(release)
	eventuallyOwed(t, dir, []Runner{{Name: "pool-5"}})
	f.Stop(context.Background())
	// A successor reads what is owed: the runner whose run it waited on.
	if got := (LedgerDir{Dir: dir}).Owed(); len(got) != 1 || got[0].Name != "pool-5" || got[0].ID != 0 {
		t.Fatalf("owed after the drain: %+v, want pool-5's follow-up", got)
	}
	next := Following{Ledger: LedgerDir{Dir: dir}}
	next.Go(context.Background(), Runner{Name: "pool-5"}, func(context.Context) {})
	eventuallyOwed(t, dir, nil)
}

func eventuallyOwed(t *testing.T, dir string, want []Runner) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := (LedgerDir{Dir: dir}).Owed()
		if len(got) == len(want) && (len(want) == 0 || got[0].Name == want[0].Name && got[0].ID == want[0].ID) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("owed %+v, want %+v", got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
