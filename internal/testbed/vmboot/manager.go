package vmboot

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// Manager stands in for the manager's webhook listener where a pool's
// machines claim their assignment (/handoff/<pool>), for a provider's
// tests: its URL is known before the pool is opened with it as
// handoff_url, and the pool's desk is served once Serve is given it.
type Manager struct {
	URL  string
	desk atomic.Pointer[http.Handler]
}

// NewManager serves /handoff/<pool>, 404 until Serve.
func NewManager(t testing.TB, pool string) *Manager {
	t.Helper()
	m := &Manager{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h := m.desk.Load(); h != nil && r.URL.Path == "/handoff/"+pool {
			(*h).ServeHTTP(w, r)
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	m.URL = srv.URL
	return m
}

// Serve serves the pool's desk (its provider's HandoffHandler); a nil
// one fails the test: a pool with handoff_url has a desk.
func (m *Manager) Serve(t testing.TB, h http.Handler) {
	t.Helper()
	if h == nil {
		t.Fatal("a pool with handoff_url has no desk")
	}
	m.desk.Store(&h)
}
