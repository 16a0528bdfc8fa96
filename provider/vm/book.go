package vm

import (
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// LaunchGrace is how long a machine asked for counts as coming up while
// listings do not show it yet, and a deleted one stays hidden.
const LaunchGrace = 2 * time.Minute

// Entry is a machine as a cloud provider keeps it: the instance, and
// what the cloud needs to act on it (its zone or resource group, whether
// it is Spot).
type Entry[T any] struct {
	Inst provider.Instance
	Data T
}

// Book is what a cloud provider knows of its pool's machines between
// listings: the last listing, the machines asked for since (coming up
// until listed, or for LaunchGrace), less the ones deleted here (hidden
// until gone from the listings, or for LaunchGrace). Its methods are safe
// for concurrent use.
type Book[T any] struct {
	mu       sync.Mutex
	seen     map[string]Entry[T] // by machine ID, from the last listing
	seenAt   time.Time
	launched map[string]Entry[T]  // asked for, not yet listed
	gone     map[string]time.Time // deleted here
}

func (b *Book[T]) init() {
	if b.seen == nil {
		b.seen, b.launched, b.gone = map[string]Entry[T]{}, map[string]Entry[T]{}, map[string]time.Time{}
	}
}

// Launched records a machine asked for, listed as coming up from now on.
func (b *Book[T]) Launched(e Entry[T]) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.init()
	b.launched[e.Inst.ID] = e
}

// Failed forgets a machine asked for that the cloud refused.
func (b *Book[T]) Failed(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.init()
	delete(b.launched, id)
}

// Deleted hides a machine whose deletion was asked for.
func (b *Book[T]) Deleted(id string, at time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.init()
	b.gone[id] = at
	delete(b.launched, id)
}

// Stale says whether the last listing is older than interval.
func (b *Book[T]) Stale(now time.Time, interval time.Duration) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return now.Sub(b.seenAt) >= interval
}

// View is what was listed and asked for since, less what was deleted,
// by machine ID.
func (b *Book[T]) View() []Entry[T] {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]Entry[T], 0, len(b.seen)+len(b.launched))
	for id, e := range b.seen {
		if _, hidden := b.gone[id]; !hidden {
			out = append(out, e)
		}
	}
	for id, e := range b.launched {
		if _, listed := b.seen[id]; !listed {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b Entry[T]) int { return strings.Compare(a.Inst.ID, b.Inst.ID) })
	return out
}

// Instances is View's instances.
func (b *Book[T]) Instances() []provider.Instance {
	view := b.View()
	out := make([]provider.Instance, 0, len(view))
	for _, e := range view {
		out = append(out, e.Inst)
	}
	return out
}

// Of is the view's machines of a runner.
func (b *Book[T]) Of(runner string) []Entry[T] {
	return slices.DeleteFunc(b.View(), func(e Entry[T]) bool { return e.Inst.Name != runner })
}

// Live returns the runner's machine when one is coming up or running.
func (b *Book[T]) Live(runner string) (provider.Instance, bool) {
	for _, e := range b.Of(runner) {
		if e.Inst.State != provider.StateExited {
			return e.Inst, true
		}
	}
	return provider.Instance{}, false
}

// Update replaces the listing with found, listed at at. note is called,
// with the book locked, for each machine listed (now set) and each gone
// from the listing (now nil), with what was known of it before (old,
// the zero Entry if nothing) and whether its deletion was asked for
// here. Update returns the runners whose machines
// changed, and whether a machine ID was in this listing or the last.
func (b *Book[T]) Update(found []Entry[T], at time.Time, note func(id string, old Entry[T], now *Entry[T], deleted bool)) (changed []string, known func(id string) bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.init()
	seen := make(map[string]Entry[T], len(found))
	for _, e := range found {
		seen[e.Inst.ID] = e
	}
	for id, e := range seen {
		old, ok := b.seen[id]
		if !ok {
			old = b.launched[id]
		}
		if old.Inst.State != e.Inst.State || old.Inst.Reason != e.Inst.Reason {
			changed = append(changed, e.Inst.Name)
		}
		if note != nil {
			_, deleted := b.gone[id]
			note(id, old, &e, deleted)
		}
		delete(b.launched, id)
	}
	for id, e := range b.seen {
		if _, ok := seen[id]; !ok {
			changed = append(changed, e.Inst.Name)
			if note != nil {
				_, deleted := b.gone[id]
				note(id, e, nil, deleted)
			}
		}
	}
	for id, e := range b.launched {
		if at.Sub(e.Inst.Created) > LaunchGrace {
			delete(b.launched, id)
			changed = append(changed, e.Inst.Name)
		}
	}
	for id, t := range b.gone {
		if _, listed := seen[id]; !listed && at.Sub(t) > LaunchGrace {
			delete(b.gone, id)
		}
	}
	before := b.seen
	b.seen, b.seenAt = seen, at
	return changed, func(id string) bool { _, now := seen[id]; _, then := before[id]; return now || then }
}
