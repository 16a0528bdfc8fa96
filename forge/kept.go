package forge

import (
	"slices"
	"sync"
	"time"
)

// Kept is a driver's kept listing of its runners, reused for a while
// instead of asking the forge on every pass, and kept current from what
// the driver itself does (a runner made, removed, seen busy). A change
// whose outcome is unknown (a call sent but unanswered) drops it. A
// listing read while the driver changed something may lack that change:
// it is returned to its caller but not kept, so that it cannot hide the
// change for a whole time to live. The zero value keeps nothing yet.
type Kept struct {
	// Now is the clock (time.Now if nil), for tests that compress time.
	Now func() time.Time

	mu      sync.Mutex
	list    []Runner
	at      time.Time // when the kept listing was read; zero: none kept
	changes int64     // changes made by the driver, counted
}

// Get returns the kept listing while it is younger than ttl. Otherwise ok
// is false, and stamp is what Keep needs of a listing read from now.
func (k *Kept) Get(ttl time.Duration) (list []Runner, ok bool, stamp int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	now := time.Now
	if k.Now != nil {
		now = k.Now
	}
	if !k.at.IsZero() && now().Sub(k.at) < ttl {
		return slices.Clone(k.list), true, k.changes
	}
	return nil, false, k.changes
}

// Keep keeps a listing read since Get gave stamp, as of at, unless the
// driver changed something meanwhile or keep is false; then nothing is
// kept and the next Get reads again. It reports whether it kept it.
func (k *Kept) Keep(list []Runner, stamp int64, at time.Time, keep bool) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.changes != stamp || !keep {
		k.at = time.Time{}
		return false
	}
	k.list, k.at = slices.Clone(list), at
	return true
}

// Change counts a change the driver made and applies f to the kept
// listing, if there is one, with the index of runner id in it (-1 when
// absent). It returns the count of changes, this one included.
func (k *Kept) Change(id int64, f func(list []Runner, i int) []Runner) int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.changes++
	if !k.at.IsZero() && f != nil {
		k.list = f(k.list, slices.IndexFunc(k.list, func(r Runner) bool { return r.ID == id }))
	}
	return k.changes
}

// Changes returns the count of changes the driver made so far: a read
// begun after a change has a count at least the one Change returned.
func (k *Kept) Changes() int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.changes
}

// Drop counts a change whose outcome is unknown and stops reuse of the
// kept listing, and of any listing under way.
func (k *Kept) Drop() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.changes++
	k.at = time.Time{}
}

// Forget drops a runner that is gone from the kept listing.
func (k *Kept) Forget(id int64) {
	k.Change(id, func(list []Runner, i int) []Runner {
		if i < 0 {
			return list
		}
		return slices.Delete(list, i, i+1)
	})
}

// Set changes a kept runner's status, without counting a change: what a
// listing or poll read, not what the driver did.
func (k *Kept) Set(id int64, st Status) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if i := slices.IndexFunc(k.list, func(r Runner) bool { return r.ID == id }); i >= 0 {
		k.list[i].Status = st
	}
}
