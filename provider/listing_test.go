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
