package gpu

import (
	"fmt"
	"slices"
	"sync"
)

// Allocator hands out a host's units so that no unit is held by two live
// runners. Pools on one host share one allocator. It holds no state that
// outlives the manager: after a restart, Hold rebuilds it from the
// runners found running.
type Allocator struct {
	mu    sync.Mutex
	units []Unit
	owner map[string]string // unit id -> runner
}

// NewAllocator returns an allocator over units, handed out in their order.
func NewAllocator(units []Unit) *Allocator {
	return &Allocator{units: slices.Clone(units), owner: map[string]string{}}
}

// Units returns every unit.
func (a *Allocator) Units() []Unit { return slices.Clone(a.units) }

// Len is the number of units.
func (a *Allocator) Len() int { return len(a.units) }

// Take gives runner n free units, or all units when n < 0. A runner that
// already holds units gets those back. Nothing is taken when not enough
// are free.
func (a *Allocator) Take(runner string, n int) ([]Unit, error) {
	return a.TakeModel(runner, n, "")
}

// TakeModel is Take of units of one model only (Model's name: h100), or
// of any when model is "".
func (a *Allocator) TakeModel(runner string, n int, model string) ([]Unit, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if held := a.heldBy(runner); len(held) > 0 {
		return held, nil
	}
	if n < 0 {
		n = len(a.units)
	}
	var got []Unit
	for _, u := range a.units {
		if len(got) == n {
			break
		}
		if _, used := a.owner[u.ID]; !used && (model == "" || Model(u.Device.Name) == model) {
			got = append(got, u)
		}
	}
	if len(got) < n || n == 0 {
		what := "GPUs"
		if model != "" {
			what = model + " GPUs"
		}
		return nil, fmt.Errorf("runner %s needs %d %s, %d of %d are free", runner, n, what, len(got), len(a.units))
	}
	for _, u := range got {
		a.owner[u.ID] = runner
	}
	return got, nil
}

// Free is the number of units no runner holds.
func (a *Allocator) Free() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.units) - len(a.owner)
}

// Hold records that a runner found running holds the given units (from
// its container's labels or process record). It returns the ids that
// another runner holds, or that this host does not have; those are not
// recorded.
func (a *Allocator) Hold(runner string, ids []string) (conflicts []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, id := range ids {
		if !slices.ContainsFunc(a.units, func(u Unit) bool { return u.ID == id }) {
			conflicts = append(conflicts, id)
			continue
		}
		if o, used := a.owner[id]; used && o != runner {
			conflicts = append(conflicts, id)
			continue
		}
		a.owner[id] = runner
	}
	return conflicts
}

// Release frees what a runner holds.
func (a *Allocator) Release(runner string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, o := range a.owner {
		if o == runner {
			delete(a.owner, id)
		}
	}
}

// Holders maps each runner to the unit ids it holds.
func (a *Allocator) Holders() map[string][]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[string][]string{}
	for _, u := range a.units {
		if o, ok := a.owner[u.ID]; ok {
			out[o] = append(out[o], u.ID)
		}
	}
	return out
}

func (a *Allocator) heldBy(runner string) []Unit {
	var out []Unit
	for _, u := range a.units {
		if a.owner[u.ID] == runner {
			out = append(out, u)
		}
	}
	return out
}

// IDs returns the units' ids.
func IDs(units []Unit) []string {
	out := make([]string, len(units))
	for i, u := range units {
		out[i] = u.ID
	}
	return out
}
