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
// Drain (Stop), which cancels it and waits for it to return: a re-run
// that waits on a run is the next manager's to make, which finds the
// lost runner again. The zero value is ready to use.
type Following struct {
	mu      sync.Mutex
	running map[string]context.CancelFunc
	wg      sync.WaitGroup
}

// Go runs follow in the background for r, unless r is followed already.
// A runner is known by its registration id, or by its name without one.
func (f *Following) Go(ctx context.Context, r Runner, follow func(context.Context)) {
	key := fmt.Sprintf("id %d", r.ID)
	if r.ID == 0 {
		key = "name " + r.Name
	}
	f.Start(ctx, key, follow)
}

// Start runs follow in the background under key, unless one runs under
// it already.
func (f *Following) Start(ctx context.Context, key string, follow func(context.Context)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.running[key]; ok {
		return
	}
	if f.running == nil {
		f.running = map[string]context.CancelFunc{}
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
