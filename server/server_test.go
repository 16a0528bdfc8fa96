package server

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/gitea"
	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/metrics"
)

const secret = "hook-secret-42"

type nothing struct{}

func (nothing) RunnerCounts() []metrics.RunnerCount    { return nil }
func (nothing) ProviderCalls() []metrics.ProviderCalls { return nil }
func (nothing) ForgeStats() []metrics.ForgeStats       { return nil }
func (nothing) PoolBackoffs() []metrics.PoolBackoff    { return nil }

func sign(body string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(body))
	return hex.EncodeToString(m.Sum(nil))
}

const ghQueued = `{"action":"queued","workflow_job":{"id":101,"run_id":7,"name":"train (1)","status":"queued","labels":["self-hosted","gpu"],"created_at":"2026-11-21T10:00:00Z"},"repository":{"full_name":"acme/models"}}`

const giteaQueued = `{"action":"queued","workflow_job":{"id":5,"run_id":3,"name":"test","status":"queued","labels":["lab"],"created_at":"2026-11-21T10:00:00Z"},"repository":{"full_name":"ml/models"}}`

func ghRequest(body, sig, event string) *http.Request {
	r := httptest.NewRequest("POST", "/webhook/gh", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("X-GitHub-Event", event)
	r.Header.Set("X-GitHub-Delivery", "d-1")
	if sig != "" {
		r.Header.Set("X-Hub-Signature-256", "sha256="+sig)
	}
	return r
}

func giteaRequest(body, sig string) *http.Request {
	r := httptest.NewRequest("POST", "/webhook/lab", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("X-Gitea-Event", "workflow_job")
	r.Header.Set("X-Gitea-Event-Type", "workflow_job")
	r.Header.Set("X-Gitea-Signature", sig)
	return r
}

func newTestServer(t testing.TB) (http.Handler, *demand.Tracker, *metrics.Metrics) {
	tr := demand.New([]demand.Pool{
		{Name: "gpu", Forge: "gh", Labels: []string{"self-hosted", "gpu"}},
		{Name: "lab", Forge: "lab", Labels: []string{"lab"}},
	}, nil)
	m := metrics.New(nothing{})
	gh, err := github.New(github.Config{URL: "https://github.com/acme/models", Token: "t"})
	if err != nil {
		t.Fatal(err)
	}
	lab := gitea.New(gitea.Config{URL: "http://gitea.lab", Token: "t"})
	h := New(Config{
		Hooks:   map[string]Hook{"gh": {Parser: gh, Secret: []byte(secret)}, "lab": {Parser: lab, Secret: []byte(secret)}, "off": {Parser: lab}},
		Report:  tr.Observe,
		Metrics: m,
	})
	return h, tr, m
}

func do(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func TestWebhooks(t *testing.T) {
	h, tr, m := newTestServer(t)
	for _, tt := range []struct {
		name   string
		req    *http.Request
		code   int
		queued map[string]int
	}{
		{"github queued", ghRequest(ghQueued, sign(ghQueued), "workflow_job"), 202, map[string]int{"gpu": 1}},
		{"github duplicate delivery", ghRequest(ghQueued, sign(ghQueued), "workflow_job"), 200, map[string]int{"gpu": 1}},
		{"github bad signature", ghRequest(strings.Replace(ghQueued, "101", "102", 1), sign(ghQueued), "workflow_job"), 401, map[string]int{"gpu": 1}},
		{"github unsigned", ghRequest(strings.Replace(ghQueued, "101", "103", 1), "", "workflow_job"), 401, map[string]int{"gpu": 1}},
		{"github ping", ghRequest(`{"zen":"hi"}`, sign(`{"zen":"hi"}`), "ping"), 204, map[string]int{"gpu": 1}},
		{"github job without id", ghRequest(`{"action":"queued","workflow_job":{}}`, sign(`{"action":"queued","workflow_job":{}}`), "workflow_job"), 400, map[string]int{"gpu": 1}},
		{"github started", ghRequest(strings.Replace(ghQueued, `"action":"queued"`, `"action":"in_progress"`, 1), sign(strings.Replace(ghQueued, `"action":"queued"`, `"action":"in_progress"`, 1)), "workflow_job"), 202, map[string]int{}},
		{"gitea queued", giteaRequest(giteaQueued, sign(giteaQueued)), 202, map[string]int{"lab": 1}},
		{"gitea bad signature", giteaRequest(strings.Replace(giteaQueued, `"id":5`, `"id":6`, 1), sign(giteaQueued)), 401, map[string]int{"lab": 1}},
		{"gitea not hex", giteaRequest(giteaQueued, "zz"), 401, map[string]int{"lab": 1}},
		{"gitea bad json", giteaRequest(`{"action":`, sign(`{"action":`)), 400, map[string]int{"lab": 1}},
		{"webhooks off for a forge", giteaRequest(giteaQueued, sign(giteaQueued)), 404, map[string]int{"lab": 1}},
	} {
		if tt.name == "webhooks off for a forge" {
			tt.req.URL.Path = "/webhook/off"
		}
		w := do(h, tt.req)
		if w.Code != tt.code {
			t.Errorf("%s: %d %s, want %d", tt.name, w.Code, w.Body, tt.code)
		}
		got := tr.Queued()
		for k, v := range tt.queued {
			if got[k] != v {
				t.Errorf("%s: queued %v, want %v", tt.name, got, tt.queued)
			}
		}
		if len(tt.queued) == 0 && got["gpu"] != 0 {
			t.Errorf("%s: queued %v", tt.name, got)
		}
	}
	for forge, want := range map[string]float64{"gh": 2, "lab": 2} {
		if got := testutil.ToFloat64(m.Webhooks.WithLabelValues(forge, "bad_signature")); got != want {
			t.Errorf("bad signatures counted for %s: %v, want %v", forge, got, want)
		}
	}
	if got := testutil.ToFloat64(m.Webhooks.WithLabelValues("gh", "accepted")); got != 2 {
		t.Errorf("accepted: %v", got)
	}
}

func TestMetricsAndHealth(t *testing.T) {
	h, _, m := newTestServer(t)
	m.JobsStarted.WithLabelValues("gpu").Inc()
	w := do(h, httptest.NewRequest("GET", "/metrics", nil))
	if w.Code != 200 || !strings.Contains(w.Body.String(), `runfleet_jobs_started_total{pool="gpu"} 1`) {
		t.Errorf("metrics: %d\n%s", w.Code, w.Body)
	}
	if w := do(h, httptest.NewRequest("GET", "/healthz", nil)); w.Code != 200 {
		t.Errorf("healthz: %d", w.Code)
	}
}

// FuzzWebhook throws arbitrary bodies, signatures and events at both
// forges' webhook: nothing may panic, an unsigned or wrongly signed
// delivery never reaches the tracker, and every answer is one of the
// documented codes. `go test` runs the seed corpus.
func FuzzWebhook(f *testing.F) {
	f.Add(ghQueued, true, "workflow_job", true)
	f.Add(ghQueued, false, "workflow_job", true)
	f.Add(giteaQueued, true, "workflow_job", false)
	f.Add(`{"action":"completed","workflow_job":{"id":1,"labels":null}}`, true, "workflow_job", false)
	f.Add(`{"action":"in_progress","workflow_job":{"id":-4,"run_id":"x"}}`, true, "workflow_job", true)
	f.Add(`not json`, true, "workflow_job", true)
	f.Add(``, true, "ping", true)
	f.Add(`{"workflow_job":{"id":9,"status":"queued","labels":["`+strings.Repeat("a", 300)+`"]}}`, true, "workflow_job", false)
	f.Fuzz(func(t *testing.T, body string, signed bool, event string, github bool) {
		h, tr, _ := newTestServer(t)
		sig := sign(body)
		if !signed {
			sig = sign(body + "x")
		}
		var r *http.Request
		if github {
			r = ghRequest(body, sig, event)
		} else {
			r = giteaRequest(body, sig)
			r.Header.Set("X-Gitea-Event-Type", event)
		}
		w := do(h, r)
		switch w.Code {
		case 200, 202, 204, 400, 401:
		default:
			t.Fatalf("answered %d", w.Code)
		}
		if !signed && (w.Code != 401 || len(tr.Recent(10)) != 0) {
			t.Fatalf("a wrongly signed delivery was answered %d and recorded %v", w.Code, tr.Recent(10))
		}
	})
}

// The webhook listener serves /webhook/<forge> and nothing else; the
// status listener's page and /metrics need the token when there is one,
// and /healthz tells others only whether it is healthy.
func TestListenersKeepTheStatusPrivate(t *testing.T) {
	m := metrics.New(nothing{})
	cfg := Config{
		Metrics: m,
		Page:    func(context.Context) Page { return Page{Manager: "m"} },
		Healthy: func() error { return errors.New("pool acme-models: forge unreachable") },
		Token:   []byte("status-token-0123456789"),
	}
	hooks := Webhooks(cfg)
	for _, path := range []string{"/", "/metrics", "/healthz", "/jobs", "/status.json"} {
		if w := do(hooks, httptest.NewRequest("GET", path, nil)); w.Code != http.StatusNotFound && w.Code != http.StatusMethodNotAllowed {
			t.Errorf("webhook listener answers GET %s with %d", path, w.Code)
		}
	}
	status := Status(cfg)
	for _, path := range []string{"/", "/metrics", "/status.json"} {
		if w := do(status, httptest.NewRequest("GET", path, nil)); w.Code != http.StatusUnauthorized {
			t.Errorf("GET %s without the token: %d, want 401", path, w.Code)
		}
		r := httptest.NewRequest("GET", path, nil)
		r.Header.Set("Authorization", "Bearer wrong-token-0123456789")
		if w := do(status, r); w.Code != http.StatusUnauthorized {
			t.Errorf("GET %s with a wrong token: %d, want 401", path, w.Code)
		}
		r = httptest.NewRequest("GET", path, nil)
		r.Header.Set("Authorization", "Bearer status-token-0123456789")
		if w := do(status, r); w.Code != http.StatusOK {
			t.Errorf("GET %s with the token: %d", path, w.Code)
		}
	}
	w := do(status, httptest.NewRequest("GET", "/healthz", nil))
	if w.Code != http.StatusServiceUnavailable || strings.Contains(w.Body.String(), "acme-models") {
		t.Errorf("healthz without the token: %d %q; want 503 without the reason", w.Code, w.Body)
	}
}

// /status.json is the page's content without its pictures.
func TestStatusJSON(t *testing.T) {
	h := Status(Config{Page: func(context.Context) Page {
		return Page{Manager: "m", Pools: []PoolView{{Name: "gpu", Words: []string{"4 jobs queued"}, Hour: "<svg>"}}, Timeline: "<svg>"}
	}})
	w := do(h, httptest.NewRequest("GET", "/status.json", nil))
	var p Page
	if err := json.Unmarshal(w.Body.Bytes(), &p); w.Code != http.StatusOK || err != nil {
		t.Fatalf("GET /status.json: %d %v", w.Code, err)
	}
	if p.Manager != "m" || len(p.Pools) != 1 || p.Pools[0].Words[0] != "4 jobs queued" || strings.Contains(w.Body.String(), "svg") {
		t.Errorf("GET /status.json: %s", w.Body)
	}
}

// /readyz is 503 on a manager that does not act (a standby of a leader
// election), on both listeners, so that a readiness probe keeps a
// Service's webhooks for the leader; 200 once it acts.
func TestReadyzOnlyOnTheLeader(t *testing.T) {
	var leading atomic.Bool
	cfg := Config{Ready: func() error {
		if !leading.Load() {
			return errors.New("not acting: a standby")
		}
		return nil
	}, Token: []byte("status-token-0123456789")}
	for name, h := range map[string]http.Handler{"webhook": Webhooks(cfg), "status": Status(cfg), "both": New(cfg)} {
		leading.Store(false)
		if w := do(h, httptest.NewRequest("GET", "/readyz", nil)); w.Code != http.StatusServiceUnavailable {
			t.Errorf("%s listener: a standby's /readyz is %d, want 503", name, w.Code)
		}
		leading.Store(true)
		if w := do(h, httptest.NewRequest("GET", "/readyz", nil)); w.Code != http.StatusOK {
			t.Errorf("%s listener: the leader's /readyz is %d", name, w.Code)
		}
	}
}

// A flood of deliveries is read a few at a time: the others wait, so the
// bodies held at once are bounded.
func TestDeliveriesReadAFewAtATime(t *testing.T) {
	var now, most atomic.Int64
	release := make(chan struct{})
	p := parserFunc(func(r *http.Request, _ []byte) (forge.Delivery, error) {
		n := now.Add(1)
		defer now.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		<-release
		return forge.Delivery{Event: "ping"}, nil
	})
	h := Webhooks(Config{Hooks: map[string]Hook{"f": {Parser: p, Secret: []byte("s")}}})
	var wg sync.WaitGroup
	for range 3 * maxDeliveries {
		wg.Go(func() { do(h, httptest.NewRequest("POST", "/webhook/f", strings.NewReader("{}"))) })
	}
	time.Sleep(200 * time.Millisecond)
	close(release)
	wg.Wait()
	if most.Load() > maxDeliveries {
		t.Fatalf("%d deliveries read at once, want at most %d", most.Load(), maxDeliveries)
	}
}

type parserFunc func(*http.Request, []byte) (forge.Delivery, error)

func (f parserFunc) ParseWebhook(r *http.Request, s []byte) (forge.Delivery, error) { return f(r, s) }

// A pool's instances reach its desk on the webhook listener, and only a
// pool with one answers there.
func TestHandoffOnTheWebhookListener(t *testing.T) {
	desk := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) })
	h := Webhooks(Config{Handoff: func(pool string) http.Handler {
		if pool == "gpu" {
			return desk
		}
		return nil
	}})
	for path, want := range map[string]int{"/handoff/gpu": http.StatusTeapot, "/handoff/cpu": http.StatusNotFound} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, path, strings.NewReader("{}")))
		if w.Code != want {
			t.Errorf("POST %s: %d, want %d", path, w.Code, want)
		}
	}
	w := httptest.NewRecorder()
	Status(Config{Handoff: func(string) http.Handler { return desk }}).ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/handoff/gpu", nil))
	if w.Code == http.StatusTeapot {
		t.Error("the status listener serves a desk")
	}
}

// A standby checks a delivery's signature, then forwards it as it came to
// the leader and answers with the leader's answer; a forged one is
// refused at the standby; with no leader to forward to, or a delivery
// forwarded already, it answers 503 and acts on nothing.
func TestStandbyForwardsToTheLeader(t *testing.T) {
	var got atomic.Value
	leader := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.Store(r.URL.Path + " " + r.Header.Get("X-Sig") + " " + string(b))
		w.WriteHeader(http.StatusAccepted)
	}))
	defer leader.Close()
	p := parserFunc(func(r *http.Request, secret []byte) (forge.Delivery, error) {
		if r.Header.Get("X-Sig") != "good" {
			return forge.Delivery{}, forge.ErrBadSignature
		}
		io.ReadAll(r.Body)
		return forge.Delivery{Event: "workflow_job", Job: &forge.Job{ID: 7}}, nil
	})
	var reported atomic.Int64
	target := leader.URL
	h := Webhooks(Config{
		Hooks:   map[string]Hook{"f": {Parser: p, Secret: []byte("s")}},
		Report:  func(demand.Job) bool { reported.Add(1); return true },
		Forward: func(context.Context) (string, bool) { return target, true },
	})
	post := func(sig string, forwarded bool) *httptest.ResponseRecorder {
		r := httptest.NewRequest("POST", "/webhook/f", strings.NewReader(`{"job":7}`))
		r.Header.Set("X-Sig", sig)
		if forwarded {
			r.Header.Set(forwardedHeader, "1")
		}
		return do(h, r)
	}
	if w := post("good", false); w.Code != http.StatusAccepted || got.Load() != `/webhook/f good {"job":7}` {
		t.Errorf("forwarded: %d, the leader got %v", w.Code, got.Load())
	}
	got.Store("")
	if w := post("forged", false); w.Code != http.StatusUnauthorized || got.Load() != "" {
		t.Errorf("forged: %d, the leader got %q", w.Code, got.Load())
	}
	if w := post("good", true); w.Code != http.StatusServiceUnavailable || got.Load() != "" {
		t.Errorf("forwarded twice: %d, the leader got %q", w.Code, got.Load())
	}
	target = ""
	if w := post("good", false); w.Code != http.StatusServiceUnavailable {
		t.Errorf("no leader known: %d, want 503", w.Code)
	}
	if n := reported.Load(); n != 0 {
		t.Errorf("the standby acted on %d deliveries", n)
	}
}
