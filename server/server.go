// Package server is runfleet's HTTP side: forge webhooks that report
// queued jobs, Prometheus metrics, a health check and a status page.
package server

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	sdk "code.gitea.io/sdk/gitea"
	gh "github.com/google/go-github/v92/github"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/metrics"
)

// Hook is one forge's webhook settings.
type Hook struct {
	Type   string // github or gitea
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
	Logger  *slog.Logger
}

// maxPayload bounds a webhook body; GitHub's are at most 25 MB.
const maxPayload = 25 << 20

// New returns the server's handler.
func New(cfg Config) http.Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &server{cfg: cfg}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /webhook/{forge}", s.webhook)
	if cfg.Metrics != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(cfg.Metrics.Registry, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("GET /healthz", s.healthz)
	mux.HandleFunc("GET /{$}", s.page)
	return mux
}

type server struct{ cfg Config }

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
	if !ok || len(hook.Secret) == 0 {
		// Unknown names are not counted: the label would be the
		// caller's to choose.
		http.Error(w, "no webhook for this forge", http.StatusNotFound)
		return
	}
	log := s.cfg.Logger.With("forge", name, "remote", r.RemoteAddr)
	var (
		job   *demand.Job
		event string
		err   error
	)
	switch hook.Type {
	case "github":
		job, event, err = githubJob(r, hook.Secret)
	case "gitea":
		job, event, err = giteaJob(r, hook.Secret)
	default:
		http.Error(w, "no webhook for this forge", http.StatusNotFound)
		return
	}
	var bad *badRequest
	switch {
	case errors.Is(err, errSignature):
		s.count(name, "bad_signature")
		log.Warn("webhook refused: bad signature", "err", err)
		http.Error(w, "bad signature", http.StatusUnauthorized)
		return
	case errors.As(err, &bad):
		s.count(name, "bad_request")
		log.Warn("webhook refused: bad payload", "event", event, "err", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	case err != nil:
		s.count(name, "bad_request")
		log.Warn("webhook refused", "err", err)
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	case job == nil:
		s.count(name, "ignored")
		log.Debug("webhook ignored", "event", event)
		w.WriteHeader(http.StatusNoContent)
		return
	}
	job.Forge = name
	if s.cfg.Report != nil && !s.cfg.Report(*job) {
		s.count(name, "duplicate")
		w.WriteHeader(http.StatusOK)
		return
	}
	s.count(name, "accepted")
	log.Debug("webhook", "job", job.ID, "run", job.RunID, "name", job.Name, "status", job.Status, "labels", job.Labels)
	w.WriteHeader(http.StatusAccepted)
}

// Time drops the placeholders forges send for a time that has not come
// (Gitea writes the Unix epoch for a job not yet completed).
func Time(t time.Time) time.Time {
	if t.Year() < 2000 {
		return time.Time{}
	}
	return t
}

var errSignature = errors.New("signature does not match the webhook secret")

type badRequest struct{ msg string }

func (e *badRequest) Error() string { return e.msg }

// githubJob checks a GitHub delivery's X-Hub-Signature-256 and reads its
// workflow_job event; other events give no job.
func githubJob(r *http.Request, secret []byte) (*demand.Job, string, error) {
	r.Body = http.MaxBytesReader(nil, r.Body, maxPayload)
	payload, err := gh.ValidatePayload(r, secret)
	if err != nil {
		return nil, "", fmt.Errorf("%w: %v", errSignature, err)
	}
	event := gh.WebHookType(r)
	if event != "workflow_job" {
		return nil, event, nil
	}
	parsed, err := gh.ParseWebHook(event, payload)
	if err != nil {
		return nil, event, &badRequest{fmt.Sprintf("workflow_job payload: %v", err)}
	}
	e, ok := parsed.(*gh.WorkflowJobEvent)
	if !ok || e.WorkflowJob == nil || e.WorkflowJob.GetID() == 0 {
		return nil, event, &badRequest{"workflow_job payload without a job"}
	}
	wj := e.WorkflowJob
	st, ok := demand.ParseStatus(e.GetAction())
	if !ok {
		if st, ok = demand.ParseStatus(wj.GetStatus()); !ok {
			return nil, event, nil // an action runfleet has no use for
		}
	}
	return &demand.Job{
		ID: wj.GetID(), RunID: wj.GetRunID(), Name: wj.GetName(), Labels: wj.Labels,
		Status: st, Conclusion: wj.GetConclusion(), Runner: wj.GetRunnerName(), RunnerID: wj.GetRunnerID(),
		Queued: Time(wj.GetCreatedAt().Time), Started: Time(wj.GetStartedAt().Time), Completed: Time(wj.GetCompletedAt().Time),
	}, event, nil
}

// giteaPayload is Gitea's workflow_job delivery (api.WorkflowJobPayload);
// the job itself is the SDK's type.
type giteaPayload struct {
	Action      string                 `json:"action"`
	WorkflowJob *sdk.ActionWorkflowJob `json:"workflow_job"`
}

// giteaJob checks a Gitea delivery's X-Gitea-Signature (the hex HMAC-SHA256
// of the body) and reads its workflow_job event.
func giteaJob(r *http.Request, secret []byte) (*demand.Job, string, error) {
	body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxPayload))
	if err != nil {
		return nil, "", &badRequest{fmt.Sprintf("read body: %v", err)}
	}
	sig, err := hex.DecodeString(r.Header.Get("X-Gitea-Signature"))
	if err != nil || len(sig) == 0 {
		return nil, "", fmt.Errorf("%w: X-Gitea-Signature is missing or not hex", errSignature)
	}
	mac := hmac.New(sha256.New, secret)
	mac.Write(body)
	if !hmac.Equal(sig, mac.Sum(nil)) {
		return nil, "", errSignature
	}
	event := r.Header.Get("X-Gitea-Event-Type")
	if event == "" {
		event = r.Header.Get("X-Gitea-Event")
	}
	if event != "workflow_job" {
		return nil, event, nil
	}
	var p giteaPayload
	if err := json.Unmarshal(body, &p); err != nil {
		return nil, event, &badRequest{fmt.Sprintf("workflow_job payload: %v", err)}
	}
	wj := p.WorkflowJob
	if wj == nil || wj.ID == 0 {
		return nil, event, &badRequest{"workflow_job payload without a job"}
	}
	st, ok := demand.ParseStatus(p.Action)
	if !ok {
		if st, ok = demand.ParseStatus(wj.Status); !ok {
			return nil, event, nil
		}
	}
	return &demand.Job{
		ID: wj.ID, RunID: wj.RunID, Name: wj.Name, Labels: wj.Labels,
		Status: st, Conclusion: wj.Conclusion, Runner: wj.RunnerName, RunnerID: wj.RunnerID,
		Queued: Time(wj.CreatedAt), Started: Time(wj.StartedAt), Completed: Time(wj.CompletedAt),
	}, event, nil
}

func (s *server) healthz(w http.ResponseWriter, _ *http.Request) {
	if s.cfg.Healthy != nil {
		if err := s.cfg.Healthy(); err != nil {
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
	Pools   []PoolView
	GPUs    *GPUView
	Jobs    []JobRow
}

// PoolView is one pool on the status page.
type PoolView struct {
	Name, Forge, Provider string
	Size, Max, Queued     int
	Error                 string
	Runners               []RunnerRow
	GPUs                  bool // a runner has GPUs of its own
}

// RunnerRow is one runner.
type RunnerRow struct {
	Name, State, Age, GPUs, Job string
}

// GPUView is the host's GPUs.
type GPUView struct {
	Summary string // driver, CUDA, or why none
	Units   []GPURow
}

// GPURow is one GPU or MIG device.
type GPURow struct {
	Index, ID, Name, Memory, Runner string
}

// JobRow is one recent job.
type JobRow struct {
	Name, Pool, Status, Conclusion, Runner, Wait, Duration string
}

//go:embed page.html
var pageFS embed.FS

var pageTmpl = template.Must(template.New("page.html").Funcs(template.FuncMap{
	"lower": strings.ToLower,
}).ParseFS(pageFS, "page.html"))

func (s *server) page(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Page == nil {
		http.NotFound(w, r)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	p := s.cfg.Page(ctx)
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := pageTmpl.Execute(w, p); err != nil {
		s.cfg.Logger.Warn("status page", "err", err)
	}
}
