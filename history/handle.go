package history

import (
	"sync"

	"github.com/runfleet/runfleet/record"
)

// Handle is a history that may be opened and closed while its writers
// run: a manager writes its history only while it runs its pools (as the
// leader), and a standby writes nothing until it leads. What is told
// while no store is open is dropped: the pools' passes tell it again.
// The zero value holds no store.
type Handle struct {
	mu    sync.Mutex
	store *Store
}

// Store returns the open store; nil when none is.
func (h *Handle) Store() *Store {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.store
}

// Swap puts s in place and returns the store it replaces.
func (h *Handle) Swap(s *Store) *Store {
	h.mu.Lock()
	defer h.mu.Unlock()
	old := h.store
	h.store = s
	return old
}

// Add adds a record to the open store.
func (h *Handle) Add(r record.Record) {
	if s := h.Store(); s != nil {
		s.Add(r)
	}
}

// Update changes a runner's record in the open store.
func (h *Handle) Update(forge string, reg int64, change func(*record.Record) bool) {
	if s := h.Store(); s != nil {
		s.Update(forge, reg, change)
	}
}

// Drop removes a runner's record from the open store.
func (h *Handle) Drop(forge string, reg int64) {
	if s := h.Store(); s != nil {
		s.Drop(forge, reg)
	}
}
