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
