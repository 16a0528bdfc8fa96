package daemon

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/record"
)

func runConfig(t *testing.T, dir string, size int) *config.Config {
	t.Helper()
	t.Setenv("T_TOKEN", "x")
	cfg, err := config.Parse([]byte(fmt.Sprintf(`
state_dir: %s
resync: 1s
drain_timeout: 5s
forges:
  - {name: f, type: gitea, url: "http://127.0.0.1:1", token: "${T_TOKEN}", repo: a/b, webhook_secret: 0123456789abcdef, poll_interval: 1s}
pools:
  - name: p
    labels: [gpu]
    size: %d
    max: 4
    agent: {path: /bin/true}
`, dir, size)))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestRunServeAndReloadConcurrently runs the manager against an
// unreachable forge while config reloads, webhook deliveries, status page
// and metrics requests arrive at once: under -race, none of it may race,
// and the manager still stops.
func TestRunServeAndReloadConcurrently(t *testing.T) {
	dir := t.TempDir()
	f, err := New(t.Context(), runConfig(t, dir, 1), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	h := f.Handler()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { f.Run(ctx); close(done) }()

	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range 10 {
			if err := f.Reload(t.Context(), runConfig(t, dir, i%3)); err != nil {
				t.Errorf("reload %d: %v", i, err)
			}
		}
	})
	wg.Go(func() {
		for i := range 50 {
			body := fmt.Sprintf(`{"action":"queued","workflow_job":{"id":%d,"labels":["gpu"]}}`, i+1)
			m := hmac.New(sha256.New, []byte("0123456789abcdef"))
			m.Write([]byte(body))
			r := httptest.NewRequest("POST", "/webhook/f", strings.NewReader(body))
			r.Header.Set("X-Gitea-Event-Type", "workflow_job")
			r.Header.Set("X-Gitea-Signature", hex.EncodeToString(m.Sum(nil)))
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != http.StatusAccepted {
				t.Errorf("webhook %d: %d", i, w.Code)
			}
		}
	})
	wg.Go(func() {
		for range 20 {
			for _, path := range []string{"/", "/metrics", "/healthz"} {
				w := httptest.NewRecorder()
				h.ServeHTTP(w, httptest.NewRequest("GET", path, nil))
			}
		}
	})
	wg.Wait()
	if q := f.Demand.QueuedFor("p"); q != 50 {
		t.Errorf("queued for p: %d, want 50", q)
	}
	// A reload that changes the forge is refused whole.
	bad := runConfig(t, dir, 2)
	bad.Forges[0].PollInterval.Duration = 7 * time.Second
	if err := f.Reload(t.Context(), bad); err == nil || !strings.Contains(err.Error(), "forges") {
		t.Errorf("forge change: %v", err)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/", nil))
	if !strings.Contains(w.Body.String(), "queued jobs 50") {
		t.Errorf("status page lacks the queue:\n%s", w.Body)
	}
	// Which release runs: on the page and in the metrics.
	if !strings.Contains(w.Body.String(), "version "+Version) {
		t.Errorf("status page lacks the version %s", Version)
	}
	w = httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
	if want := `runfleet_build_info{commit=`; !strings.Contains(w.Body.String(), want) || !strings.Contains(w.Body.String(), `version="`+Version+`"} 1`) {
		t.Errorf("metrics lack runfleet_build_info for %s", Version)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
}

// A forge whose queue cannot be polled in its scope (a GitHub
// organisation) is polled once: the poller says why and stops, without
// counting a failed poll or retrying.
func TestPollStopsWhereTheQueueCannotBeListed(t *testing.T) {
	t.Setenv("T_TOKEN", "x")
	cfg, err := config.Parse([]byte(`
state_dir: ` + t.TempDir() + `
forges:
  - {name: org, type: github, url: "https://github.com/acme", token: "${T_TOKEN}", poll_interval: 1s}
pools:
  - {name: p, labels: [gpu], agent: {path: /bin/true}}
`))
	if err != nil {
		t.Fatal(err)
	}
	var buf syncBuffer
	f, err := New(t.Context(), cfg, slog.New(slog.NewTextHandler(&buf, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() { f.poll(ctx, "org", time.Second); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("the poller kept polling a queue that cannot be listed")
	}
	if n := strings.Count(buf.String(), "cannot be polled"); n != 1 {
		t.Errorf("%d warnings, want 1:\n%s", n, buf.String())
	}
	if got := testutil.ToFloat64(f.Metrics.Polls.WithLabelValues("org", "error")); got != 0 {
		t.Errorf("%v failed polls counted", got)
	}
}

// syncBuffer is a log destination safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A runner that ends adds its machine's cost and its GPU time to the
// counters, once; a record loaded ended (from before this manager) adds
// nothing.
func TestEndedRunnersCounted(t *testing.T) {
	t.Setenv("T_TOKEN", "x")
	cfg, err := config.Parse([]byte(`
state_dir: ` + t.TempDir() + `
forges:
  - {name: org, type: github, url: "https://github.com/acme/app", token: "${T_TOKEN}"}
pools:
  - {name: p, labels: [gpu], agent: {path: /bin/true}, price_per_hour: 3}
`))
	if err != nil {
		t.Fatal(err)
	}
	f, err := New(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	t0 := time.Now().Add(-time.Hour)
	price := &record.Price{PerHour: 3, Currency: "USD"}
	gpus := []record.GPU{{ID: "a"}, {ID: "b"}}
	f.window.Load([]record.Record{{ID: "old", Pool: "p", Created: t0, Ended: t0.Add(time.Hour), Price: price, GPUs: gpus}})
	live := record.Record{ID: "r", Pool: "p", Created: t0, Price: price, GPUs: gpus}
	f.window.Observe(live, false)
	live.Ended = t0.Add(20 * time.Minute)
	f.window.Observe(live, false)
	f.window.Observe(live, false) // told again: counted once
	if got := testutil.ToFloat64(f.Metrics.Cost.WithLabelValues("p", "USD")); got < 0.999 || got > 1.001 {
		t.Errorf("cost %v, want 1 (20 minutes at 3 an hour)", got)
	}
	if got := testutil.ToFloat64(f.Metrics.GPUSeconds.WithLabelValues("p")); got != 2400 {
		t.Errorf("GPU seconds %v, want 2400 (2 GPUs for 20 minutes)", got)
	}
}
