package provider

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Pools asking at once share one call; within maxAge they share the last
// one; a pool wanting a fresh listing (maxAge 0) gets one begun after it
// asked; a failed call is no listing to share.
func TestListingShared(t *testing.T) {
	var l Listing[int]
	var calls atomic.Int32
	release := make(chan struct{})
	list := func(context.Context) (int, error) {
		<-release
		return int(calls.Add(1)), nil
	}
	var wg sync.WaitGroup
	got := make([]int, 8)
	for i := range got {
		wg.Go(func() {
			v, _, err := l.Get(context.Background(), time.Minute, time.Now, list)
			if err != nil {
				t.Error(err)
			}
			got[i] = v
		})
	}
	time.Sleep(50 * time.Millisecond)
	close(release)
	wg.Wait()
	if calls.Load() != 1 {
		t.Errorf("%d calls for 8 pools asking at once", calls.Load())
	}
	for i, v := range got {
		if v != 1 {
			t.Errorf("pool %d got listing %d", i, v)
		}
	}
	if v, _, _ := l.Get(context.Background(), time.Minute, time.Now, list); v != 1 || calls.Load() != 1 {
		t.Errorf("within maxAge: listing %d after %d calls", v, calls.Load())
	}
	if v, _, _ := l.Get(context.Background(), 0, time.Now, list); v != 2 {
		t.Errorf("a fresh listing wanted, got %d", v)
	}
	fail := func(context.Context) (int, error) { return 0, errors.New("throttled") }
	if _, _, err := l.Get(context.Background(), 0, time.Now, fail); err == nil {
		t.Error("the failure was not returned")
	}
	if v, _, _ := l.Get(context.Background(), time.Minute, time.Now, list); v != 2 {
		t.Errorf("after a failed call, listing %d, want the last good one", v)
	}
}

// A pool that joins a listing under way whose caller then gives up (a
// poller stopped while a pool's Close waits on the queue) gets a listing
// of its own, not the caller's cancellation; an error of the backend's is
// still shared.
func TestListingJoinerOutlivesItsLeader(t *testing.T) {
	var l Listing[int]
	calls := 0
	started := make(chan struct{})
	list := func(ctx context.Context) (int, error) {
		calls++
		if calls == 1 {
			close(started)
			<-ctx.Done()
			return 0, ctx.Err()
		}
		return 7, nil
	}
	leaderCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, _, err := l.Get(leaderCtx, 0, time.Now, list); done <- err }()
	<-started
	joined := make(chan struct{})
	var got int
	var err error
	go func() { got, _, err = l.Get(context.Background(), 0, time.Now, list); close(joined) }()
	time.Sleep(50 * time.Millisecond) // the second caller joins the first's call
	stop()
	<-joined
	if leaderErr := <-done; leaderErr == nil {
		t.Error("the caller that gave up got no error")
	}
	if err != nil || got != 7 || calls != 2 {
		t.Errorf("the caller still waiting got %d, %v after %d calls; want a listing of its own, 7", got, err, calls)
	}
}
