package forge

import (
	"fmt"
	"sync"
)

// Following runs at most one background follow-up per runner at a time:
// the re-run of a lost runner's job, which waits for its run to end. A
// runner reported lost again while followed is not followed twice. The
// zero value is ready to use.
type Following struct {
	mu   sync.Mutex
	keys map[string]bool
}

// Go runs follow in the background for r, unless r is followed already.
// A runner is known by its registration id, or by its name without one.
func (f *Following) Go(r Runner, follow func()) {
	key := fmt.Sprintf("id %d", r.ID)
	if r.ID == 0 {
		key = "name " + r.Name
	}
	f.mu.Lock()
	if f.keys[key] {
		f.mu.Unlock()
		return
	}
	if f.keys == nil {
		f.keys = map[string]bool{}
	}
	f.keys[key] = true
	f.mu.Unlock()
	go func() {
		defer func() {
			f.mu.Lock()
			delete(f.keys, key)
			f.mu.Unlock()
		}()
		follow()
	}()
}
