package provider

import (
	"context"
	"sync"
	"time"
)

// Listing is what one listing call returned (a subscription's VMs, a
// project's instances of a manager, a Slurm cluster's queue), shared by
// the pools that would each make the same call: a backend meters such a
// listing as a costly read (Azure Compute's "High Cost Get VM" policy,
// Compute Engine's heavy-weight reads, slurmctld's job table), so however
// many pools ask within their poll interval, the call is made once, and a
// pool that asks while it is under way joins it rather than sending its
// own.
type Listing[T any] struct {
	mu      sync.Mutex
	began   time.Time // when the last good listing was asked for
	last    T
	err     error         // the last listing's error
	gaveUp  bool          // err came of its caller's context, not the backend
	pending chan struct{} // closed when the listing under way ends
}

// Get returns what a listing asked for at most maxAge before now
// returned, through list when there is none, and when that listing was
// asked for; a listing under way is joined, its error too, as it is as
// new as any this call would make, unless its caller gave up on it. What it returns is shared: it must not
// be changed.
func (l *Listing[T]) Get(ctx context.Context, maxAge time.Duration, now func() time.Time, list func(context.Context) (T, error)) (T, time.Time, error) {
	l.mu.Lock()
	for {
		if !l.began.IsZero() && !l.began.Before(now().Add(-maxAge)) {
			last, began := l.last, l.began
			l.mu.Unlock()
			return last, began, nil
		}
		ch := l.pending
		if ch == nil {
			break
		}
		l.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			var zero T
			return zero, time.Time{}, ctx.Err()
		}
		l.mu.Lock()
		if l.err == nil || !l.gaveUp {
			defer l.mu.Unlock()
			return l.last, l.began, l.err
		}
		// The call joined ended because its caller gave up (a poller
		// stopped), which says nothing of the backend: this caller,
		// still waiting, lists for itself.
	}
	ch := make(chan struct{})
	l.pending = ch
	l.mu.Unlock()
	began := now()
	got, err := list(ctx)
	l.mu.Lock()
	l.pending, l.err, l.gaveUp = nil, err, err != nil && ctx.Err() != nil
	if err == nil {
		l.last, l.began = got, began
	}
	l.mu.Unlock()
	close(ch)
	return got, began, err
}
