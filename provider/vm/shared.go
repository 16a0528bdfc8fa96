package vm

import "sync"

// Shared holds one value per key, made by New on first use: the request
// limits that the pools of one project, subscription or region share.
type Shared[T any] struct {
	New func() T

	mu sync.Mutex
	m  map[string]T
}

// Get returns the key's value, making it with New the first time.
func (s *Shared[T]) Get(key string) T { return s.Make(key, s.New) }

// Make returns the key's value, making it with make the first time: a
// value built from the pool's config (which is part of the key).
func (s *Shared[T]) Make(key string, make func() T) T {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v, ok := s.m[key]; ok {
		return v
	}
	if s.m == nil {
		s.m = map[string]T{}
	}
	v := make()
	s.m[key] = v
	return v
}
