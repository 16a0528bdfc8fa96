package gitea

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// Every request names runfleet and its release: the SDK's (registration
// token, runner listing) and the runner service's (registration), which
// would otherwise say "go-http-client" and "connect-go".
func TestRequestsCarryTheUserAgent(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.URL.Path] = r.UserAgent()
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"token":"reg","runners":[],"total_count":0}`))
	}))
	defer srv.Close()
	d := New(Config{URL: srv.URL, Token: "t", Scope: Scope{Kind: "repo", Owner: "a", Repo: "b"}, UserAgent: "runfleet/v9.8.7",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := d.Runners(ctx); err != nil {
		t.Fatal(err)
	}
	_, _ = d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"gpu"}}) // the answer is not the runner service's: only the request matters
	mu.Lock()
	defer mu.Unlock()
	if len(seen) < 3 {
		t.Errorf("requests seen: %v", seen)
	}
	for path, ua := range seen {
		if ua != "runfleet/v9.8.7" {
			t.Errorf("%s: User-Agent %q", path, ua)
		}
	}
}
