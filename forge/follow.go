package forge

import (
	"context"
	"fmt"
	"sync"
)

// Following runs a connection's background follow-ups: the re-run of a
// lost runner's job, which waits for its run to end, at most one per
// runner at a time (a runner reported lost again while followed is not
// followed twice). A follow-up outlives the pass that started it, with
// its context's values but not its end, and ends at the connection's
// Drain (Stop), which cancels it and waits for it to return. A re-run
// that waits on a run is then the next manager's to make: it finds the
// lost runner again while the forge lists its registration, and where the
// forge has deleted it meanwhile (Gitea deletes an ephemeral runner once
// its task is failed), in the Ledger, which holds each runner's follow-up
// from its start until it returns by itself. The zero value is ready to
// use, without a ledger.
type Following struct {
	// Ledger, where set, keeps the runners whose follow-up (Go) is
	// owed: written before it starts, removed once it returns by itself
	// (done, or nothing to do); one cut short by Stop, or by the
	// manager's end, stays owed for the next manager (Rerunner.Lost
	// again, at its start).
	Ledger Ledger

	mu      sync.Mutex
	running map[string]context.CancelFunc
	wg      sync.WaitGroup
}

// Ledger keeps what a connection owes across managers.
type Ledger interface {
	// Owe notes that the follow-up of runner r, known by key, is owed.
	Owe(key string, r Runner)
	// Paid notes that it is not owed any more.
	Paid(key string)
	// Owed lists the runners whose follow-up is owed.
	Owed() []Runner
}

// Go runs follow in the background for r, unless r is followed already.
// A runner is known by its registration id, or by its name without one.
func (f *Following) Go(ctx context.Context, r Runner, follow func(context.Context)) {
	key := fmt.Sprintf("id %d", r.ID)
	if r.ID == 0 {
		key = "name " + r.Name
	}
	if f.Ledger == nil {
		f.start(ctx, key, nil, follow)
		return
	}
	f.start(ctx, key, func() { f.Ledger.Owe(key, r) }, func(ctx context.Context) {
		follow(ctx)
		if ctx.Err() == nil {
			f.Ledger.Paid(key)
		}
	})
}

// Start runs follow in the background under key, unless one runs under
// it already.
func (f *Following) Start(ctx context.Context, key string, follow func(context.Context)) {
	f.start(ctx, key, nil, follow)
}

// start is Start, calling first, where set, once it is sure to follow.
func (f *Following) start(ctx context.Context, key string, first func(), follow func(context.Context)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.running[key]; ok {
		return
	}
	if f.running == nil {
		f.running = map[string]context.CancelFunc{}
	}
	if first != nil {
		first()
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	f.running[key] = cancel
	f.wg.Go(func() {
		defer func() {
			f.mu.Lock()
			delete(f.running, key)
			f.mu.Unlock()
			cancel()
		}()
		follow(ctx)
	})
}

// Stop cancels the follow-ups under way and waits for them to return, at
// most until ctx ends.
func (f *Following) Stop(ctx context.Context) {
	f.mu.Lock()
	for _, cancel := range f.running {
		cancel()
	}
	f.mu.Unlock()
	done := make(chan struct{})
	go func() {
		f.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// Wait waits for the follow-ups under way until ctx ends, then cancels
// those left and waits for them to return: for work that ends by itself
// soon (one call).
func (f *Following) Wait(ctx context.Context) {
	done := make(chan struct{})
	go func() {
		f.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return
	case <-ctx.Done():
	}
	f.mu.Lock()
	for _, cancel := range f.running {
		cancel()
	}
	f.mu.Unlock()
	<-done
}
