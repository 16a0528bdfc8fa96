package vm

import (
	"context"
	"sync"
	"time"
)

// Listing is what one listing call returned (a subscription's VMs, a
// project's instances of a manager), shared by the pools that would each
// make the same call: a cloud meters such a listing as a costly read
// (Azure Compute's "High Cost Get VM" policy, Compute Engine's
// heavy-weight reads), so however many pools ask within their poll
// interval, the call is made once, and a pool that asks while it is
// under way waits for it rather than sending its own.
type Listing[T any] struct {
	mu      sync.Mutex
	began   time.Time // when the last listing was asked for
	last    T
	pending chan struct{} // closed when the listing under way ends
}

// Get returns what a listing asked for at most maxAge before now
// returned, through list when there is none, and when that listing was
// asked for. What it returns is shared: it must not be changed.
func (l *Listing[T]) Get(ctx context.Context, maxAge time.Duration, now func() time.Time, list func(context.Context) (T, error)) (T, time.Time, error) {
	asked := now()
	for {
		l.mu.Lock()
		if !l.began.IsZero() && !l.began.Before(asked.Add(-maxAge)) {
			last, began := l.last, l.began
			l.mu.Unlock()
			return last, began, nil
		}
		if ch := l.pending; ch != nil {
			l.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				var zero T
				return zero, time.Time{}, ctx.Err()
			}
		}
		ch := make(chan struct{})
		l.pending = ch
		l.mu.Unlock()
		began := now()
		got, err := list(ctx)
		l.mu.Lock()
		l.pending = nil
		if err == nil {
			l.last, l.began = got, began
		}
		l.mu.Unlock()
		close(ch)
		return got, began, err
	}
}
