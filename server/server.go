// Package server is runfleet's HTTP side: forge webhooks that report
// queued jobs, Prometheus metrics, a health check and a status page.
package server

import (
	"bytes"
	"context"
	"crypto/subtle"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/metrics"
	"github.com/runfleet/runfleet/record"
)

// Hook is one forge's webhook settings.
type Hook struct {
	// Parser is the forge's driver, which authenticates and reads its
	// deliveries.
	Parser forge.WebhookParser
	Secret []byte // empty: the forge's webhooks are refused
}

// Config wires the server to the manager.
type Config struct {
	// Hooks are the forges that may deliver webhooks, by config name:
	// /webhook/<name>.
	Hooks map[string]Hook
	// Report records a job a webhook reported, and says whether it was
	// news (a duplicate delivery is not).
	Report  func(demand.Job) bool
	Metrics *metrics.Metrics
	// Page gathers what the status page shows.
	Page func(context.Context) Page
	// Healthy reports whether the manager works; nil is healthy.
	Healthy func() error
	// Ready reports whether the manager acts on what it receives: a
	// standby of a leader election is healthy and not ready, so that a
	// Service sends webhooks only to the leader. nil is ready.
	Ready func() error
	// Token, when set, is the bearer token the status page and /metrics
	// need; /healthz then tells others only healthy or not.
	Token  []byte
	Logger *slog.Logger
	// Jobs is the history of jobs, served at /jobs and /jobs/<id>; nil
	// serves none.
	Jobs Jobs
	// Forward, when set, says whether this manager is a standby that
	// does not act on webhooks, and where the manager that does takes
	// them (the leader's webhook listener, as its Lease advertises it;
	// "" when it says none). A standby checks a delivery's signature,
	// then forwards it there, answering with the leader's answer; with
	// nowhere to forward it, it answers 503, so that the forge shows the
	// delivery failed and it can be redelivered.
	Forward func(ctx context.Context) (leader string, standby bool)
	// Handoff is the pool's desk where its cloud instances claim their
	// runner's assignment (provider.Handoffer), served on the webhook
	// listener at /handoff/<pool>; nil for a pool without one.
	Handoff func(pool string) http.Handler
}

// Jobs is what the status listener reads of the history of jobs.
type Jobs interface {
	Jobs(q history.Query) ([]record.Record, error)
	JobRecord(id string) (record.Record, error)
}

// maxPayload bounds a webhook body; GitHub's are at most 25 MB.
const maxPayload = 25 << 20

// maxDeliveries bounds the deliveries read at once, so that a flood cannot
// hold more than maxDeliveries bodies in memory; others wait, up to
// deliveryWait, then get 503.
const (
	maxDeliveries = 16
	deliveryWait  = 10 * time.Second
)

// Webhooks returns the handler of the webhook listener, which the forges
// reach: /webhook/<forge>, and the pools' /handoff/<pool>, which their
// instances reach.
func Webhooks(cfg Config) http.Handler {
	mux := http.NewServeMux()
	s := newServer(cfg)
	s.routeWebhooks(mux)
	mux.HandleFunc("GET /readyz", s.readyz)
	return mux
}

// Status returns the handler of the status listener: the status page at
// /, /metrics and /healthz. They show repository, job and runner names, so
// the listener is on loopback unless Token guards it.
func Status(cfg Config) http.Handler {
	mux := http.NewServeMux()
	newServer(cfg).routeStatus(mux)
	return mux
}

// New returns both on one handler, for a status listener that is the
// webhook listener (Token then guards the status side).
func New(cfg Config) http.Handler {
	s := newServer(cfg)
	mux := http.NewServeMux()
	s.routeWebhooks(mux)
	s.routeStatus(mux)
	return mux
}

func newServer(cfg Config) *server {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &server{cfg: cfg, slots: make(chan struct{}, maxDeliveries)}
}

func (s *server) routeWebhooks(mux *http.ServeMux) {
	mux.HandleFunc("POST /webhook/{forge}", s.webhook)
	mux.HandleFunc("POST /handoff/{pool}", s.handoff)
}

// handoff hands a claim to its pool's desk, which checks who asks.
func (s *server) handoff(w http.ResponseWriter, r *http.Request) {
	var h http.Handler
	if s.cfg.Handoff != nil {
		h = s.cfg.Handoff(r.PathValue("pool"))
	}
	if h == nil {
		http.NotFound(w, r)
		return
	}
	h.ServeHTTP(w, r)
}

func (s *server) routeStatus(mux *http.ServeMux) {
	if s.cfg.Metrics != nil {
		mux.Handle("GET /metrics", s.guard(promhttp.HandlerFor(s.cfg.Metrics.Registry, promhttp.HandlerOpts{})))
	}
	mux.HandleFunc("GET /healthz", s.healthz)
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.Handle("GET /{$}", s.guard(http.HandlerFunc(s.page)))
	mux.Handle("GET /status.json", s.guard(http.HandlerFunc(s.pageJSON)))
	mux.Handle("GET /jobs", s.guard(http.HandlerFunc(s.jobs)))
	mux.Handle("GET /jobs/{id}", s.guard(http.HandlerFunc(s.jobRecord)))
}

type server struct {
	cfg   Config
	slots chan struct{} // deliveries being read
}

// authorized reports whether the request carries the status token, or
// none is needed.
func (s *server) authorized(r *http.Request) bool {
	if len(s.cfg.Token) == 0 {
		return true
	}
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(tok), s.cfg.Token) == 1
}

// guard refuses a request without the status token.
func (s *server) guard(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="runfleet"`)
			http.Error(w, "a bearer token is required", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func (s *server) count(forge, result string) {
	if s.cfg.Metrics != nil {
		s.cfg.Metrics.Webhooks.WithLabelValues(forge, result).Inc()
	}
}

// webhook takes a workflow_job delivery. A delivery whose signature does
// not check out is refused with 401, counted and logged, and changes
// nothing.
func (s *server) webhook(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("forge")
	hook, ok := s.cfg.Hooks[name]
	if !ok || len(hook.Secret) == 0 || hook.Parser == nil {
		// Unknown names are not counted: the label would be the
		// caller's to choose.
		http.Error(w, "no webhook for this forge", http.StatusNotFound)
		return
	}
	log := s.cfg.Logger.With("forge", name, "remote", r.RemoteAddr)
	t := time.NewTimer(deliveryWait)
	select {
	case s.slots <- struct{}{}:
		t.Stop()
		defer func() { <-s.slots }()
	case <-t.C:
		s.count(name, "busy")
		log.Warn("webhook refused: too many deliveries at once")
		http.Error(w, "too many deliveries at once", http.StatusServiceUnavailable)
		return
	case <-r.Context().Done():
		t.Stop()
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxPayload))
	if err != nil {
		s.count(name, "bad_request")
		log.Warn("webhook refused: body not read", "err", err)
		http.Error(w, "body not read", http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	dl, err := hook.Parser.ParseWebhook(r, hook.Secret)
	if err == nil && s.cfg.Forward != nil {
		if leader, standby := s.cfg.Forward(r.Context()); standby {
			s.forward(w, r, leader, body, log)
			return
		}
	}
	switch {
	case errors.Is(err, forge.ErrBadSignature):
		s.count(name, "bad_signature")
		log.Warn("webhook refused: bad signature", "err", err)
		http.Error(w, "bad signature", http.StatusUnauthorized)
		return
	case errors.Is(err, forge.ErrBadPayload):
		s.count(name, "bad_request")
		log.Warn("webhook refused: bad payload", "event", dl.Event, "err", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	case err != nil:
		s.count(name, "bad_request")
		log.Warn("webhook refused", "err", err)
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	case dl.Job == nil:
		s.count(name, "ignored")
		log.Debug("webhook ignored", "event", dl.Event)
		w.WriteHeader(http.StatusNoContent)
		return
	}
	job := demand.JobOf(name, *dl.Job)
	if s.cfg.Report != nil && !s.cfg.Report(job) {
		s.count(name, "duplicate")
		w.WriteHeader(http.StatusOK)
		return
	}
	s.count(name, "accepted")
	log.Debug("webhook", "job", job.ID, "run", job.RunID, "name", job.Name, "status", job.Status, "labels", job.Labels, "runner", job.RunnerID)
	w.WriteHeader(http.StatusAccepted)
}

// forwardedHeader marks a delivery a standby forwarded: a manager that
// receives one and does not act either does not forward it again.
const forwardedHeader = "X-Runfleet-Forwarded"

// forwardTimeout bounds a forwarded delivery: the forges wait 10 s
// (GitHub) to 30 s for an answer.
const forwardTimeout = 8 * time.Second

// forward hands a checked delivery, as it came, to the leader at base,
// and its answer back to the forge.
func (s *server) forward(w http.ResponseWriter, r *http.Request, base string, body []byte, log *slog.Logger) {
	if base == "" || r.Header.Get(forwardedHeader) != "" {
		s.count(r.PathValue("forge"), "standby")
		log.Warn("webhook refused: this manager is a standby, and the leader takes no webhooks it knows of")
		http.Error(w, "a standby: the leader takes webhooks", http.StatusServiceUnavailable)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), forwardTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+r.URL.Path, bytes.NewReader(body))
	if err == nil {
		req.Header = r.Header.Clone()
		req.Header.Set(forwardedHeader, "1")
		var resp *http.Response
		if resp, err = forwardClient.Do(req); err == nil {
			defer resp.Body.Close()
			s.count(r.PathValue("forge"), "forwarded")
			log.Debug("webhook forwarded to the leader", "leader", base, "status", resp.StatusCode)
			w.WriteHeader(resp.StatusCode)
			_, _ = io.Copy(w, io.LimitReader(resp.Body, 4096))
			return
		}
	}
	s.count(r.PathValue("forge"), "standby")
	log.Warn("webhook refused: this manager is a standby, and the leader could not be reached", "leader", base, "err", err)
	http.Error(w, "a standby: the leader could not be reached", http.StatusBadGateway)
}

// forwardClient follows no redirect: a leader answers, or not.
var forwardClient = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

func (s *server) healthz(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Healthy != nil {
		if err := s.cfg.Healthy(); err != nil {
			msg := err.Error()
			if !s.authorized(r) {
				msg = "unhealthy" // the reason names forges and pools
			}
			http.Error(w, msg, http.StatusServiceUnavailable)
			return
		}
	}
	fmt.Fprintln(w, "ok")
}

// readyz is 503 while the manager does not act (a standby, a drain), for
// a readiness probe: it says why, which names no forge or pool.
func (s *server) readyz(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Ready != nil {
		if err := s.cfg.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
	}
	fmt.Fprintln(w, "ok")
}

// Page is what the status page shows.
type Page struct {
	Manager string
	Version string
	Now     time.Time
	// Forges says, for each forge whose polls fail, what is wrong and
	// what runfleet does next.
	Forges []ForgeView
	Pools  []PoolView
	GPUs   *GPUView
	// Timeline draws the last hour's jobs (chart.Timeline), each linked
	// to its record.
	Timeline template.HTML `json:"-"`
	Jobs     []JobRow
}

// ForgeView is one forge's state in words.
type ForgeView struct {
	Name, Type string
	Words      []string // empty: nothing is wrong
}

// PoolView is one pool on the status page.
type PoolView struct {
	Name, Forge, Provider string
	Size, Max, Queued     int
	// Words say what is wrong with the pool and what runfleet does next:
	// its passes failing, its backoff, jobs it refuses, its runners'
	// machines not running and why.
	Words []string
	// Hour and Day draw its runners by state; Waited and Ran its jobs'
	// waits and durations over the day (chart).
	Hour, Day, Waited, Ran template.HTML `json:"-"`
	// Cost is what its runners cost today and this week, and the GPU
	// time they held; "" when it has no price.
	CostDay, CostWeek string
	GPUHours          string
	Runners           []RunnerRow
	GPUs              bool // a runner has GPUs of its own
}

// RunnerRow is one runner.
type RunnerRow struct {
	Name, State, Age, GPUs, Job string
	Reason                      string // why its machine is not running
}

// GPUView is the GPUs the manager knows: this host's, and those its
// runners hold on other machines.
type GPUView struct {
	Summary string // this host's driver, CUDA, or why none
	Units   []GPURow
	// Elsewhere are the GPUs runners hold on other machines (nodes,
	// instances), from their records.
	Elsewhere []GPURow
}

// GPURow is one GPU or MIG device.
type GPURow struct {
	Host, Index, ID, Name, Memory string
	// Runner and Job hold it; "" when it is idle.
	Runner, Job string
	// Use is its utilisation and memory in use where the driver tells
	// ("73% · 41.2 of 80 GiB"); Busy is the utilisation for the bar,
	// -1 unknown.
	Use  string
	Busy int
}

// JobRow is one recent job.
type JobRow struct {
	Name, Pool, Status, Conclusion, Runner, Wait, Duration string
	// Record is the ID of the job's runner's record in the history,
	// linked as /jobs/<id>; "" when there is none.
	Record string
}

//go:embed page.html
var pageFS embed.FS

// pageTmpl is parsed when the page is first asked for, not at every
// start (a server's tests parse it).
var pageTmpl = sync.OnceValue(func() *template.Template {
	return template.Must(template.New("page.html").Funcs(template.FuncMap{
		"lower": strings.ToLower,
	}).ParseFS(pageFS, "page.html"))
})

// pageJSON is what the page shows, without its pictures: for `runfleet
// status --watch`.
func (s *server) pageJSON(w http.ResponseWriter, r *http.Request) {
	if p, ok := s.gather(w, r); ok {
		writeJSON(w, p)
	}
}

func (s *server) page(w http.ResponseWriter, r *http.Request) {
	p, ok := s.gather(w, r)
	if !ok {
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := pageTmpl().Execute(w, p); err != nil {
		s.cfg.Logger.Warn("status page", "err", err)
	}
}

// gather asks the manager for the page, within 10 s; false (answered 404)
// where it serves none.
func (s *server) gather(w http.ResponseWriter, r *http.Request) (Page, bool) {
	if s.cfg.Page == nil {
		http.NotFound(w, r)
		return Page{}, false
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	return s.cfg.Page(ctx), true
}
