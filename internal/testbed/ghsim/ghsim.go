// Package ghsim stands in for GitHub, following GitHub's REST API
// reference (self-hosted runners, Actions jobs, App tokens) and, for the
// runner side, the observable behaviour of actions/runner. GitHub cannot
// be reached from where runfleet is tested, so its driver is tested
// against this.
//
// The REST side implements exactly the endpoints the driver calls, under
// /api/v3/ as on GitHub Enterprise Server, with the paths, methods, bodies
// and status codes GitHub documents: 201 with a runner and its
// encoded_jit_config from generate-jitconfig, 409 (or 422, as configured)
// on a duplicate runner name, 404 for what does not exist, 422 when a busy
// runner is deleted, 401 on bad credentials, and 403 with X-RateLimit-*
// headers while the rate limit is exhausted. Every response carries the
// rate-limit headers. GitHub App installation tokens are issued against a
// JWT signed with the App's key.
//
// The runner side stands in for the Actions service, whose protocol is not
// public: a runner holding a JIT config connects, takes one queued job
// whose labels it covers, heartbeats while the job runs, and reports the
// result. A runner that stops heartbeating mid-job fails the job, as GitHub
// does when it loses a runner. The stand-in runner binary is ./runner.
package ghsim

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/golang-jwt/jwt/v4"

	"github.com/runfleet/runfleet/internal/testbed/simserve"
)

// Options configures a Server.
type Options struct {
	// Token is the personal access token the API accepts.
	Token string
	// Repos and Orgs exist; anything else is 404. Repos are "owner/name".
	Repos []string
	Orgs  []string
	// AppID, InstallationID and AppKey enable GitHub App authentication.
	AppID, InstallationID int64
	AppKey                *rsa.PublicKey
	// DuplicateStatus answers generate-jitconfig for a name in use: GitHub
	// documents 409 Conflict; 422 is what some versions answer.
	DuplicateStatus int
	// NoJIT answers 404 for generate-jitconfig, as a GitHub Enterprise
	// Server older than JIT runners does.
	NoJIT bool
	// RunnerHost is the host runners reach the simulator at, written
	// into their JIT config (host.docker.internal for containers); the
	// server then listens on every address. 127.0.0.1 when empty.
	RunnerHost string
	// LostAfter is how long a runner may go without a heartbeat before
	// GitHub gives it up: a job it held fails. Default 3s.
	LostAfter time.Duration
	// WebhookURL receives workflow_job deliveries (queued, in_progress,
	// completed) signed with WebhookSecret in X-Hub-Signature-256, as a
	// repository webhook of GitHub sends them: each from its own
	// goroutine, so in no guaranteed order.
	WebhookURL, WebhookSecret string
	// Redeliver sends every delivery twice, as a redelivery does.
	Redeliver bool
	// DuplicateInErrors answers a JIT request for a name in use with
	// 422 "Validation Failed" and the reason only in errors[], a shape
	// GitHub's description allows.
	DuplicateInErrors bool
	// KeepLostRunners leaves a runner that GitHub gave up on registered
	// and offline, instead of deleting it with its failed job.
	KeepLostRunners bool
	// SessionTimeout is how long a scale set's message session lives
	// without a poll before the service drops it (a manager killed
	// without closing it). Default 10s.
	SessionTimeout time.Duration
	// LongPoll is how long a message poll waits for a message before
	// answering 202. Default 2s (GitHub: about 50s).
	LongPoll time.Duration
	// QueueTokenLifetime is how long a session's message queue token is
	// taken; after it, the queue's calls answer 401 until the session is
	// refreshed (actions/scaleset's session_client.go: a 401 is
	// MessageQueueTokenExpiredError, to be met with RefreshMessageSession).
	// The service does not publish the lifetime. Default 1h.
	QueueTokenLifetime time.Duration
	// AdminTokenLifetime is how long the Actions service's admin token
	// (the JWT POST /actions/runner-registration answers, whose exp the
	// client reads: actions/scaleset client.go,
	// actionsServiceAdminTokenExpiresAt) is taken; after it, the
	// service's calls answer 401. Default 1h.
	AdminTokenLifetime time.Duration
}

// Runner is a runner registration.
type Runner struct {
	ID        int64
	Name      string
	Labels    []string
	Scope     string // "owner/repo" or "org"
	Group     int64
	ScaleSet  int // the scale set it belongs to, 0 for none
	Ephemeral bool
	Online    bool
	JobID     int64 // the job it runs, 0 when idle
	token     string
	lastSeen  time.Time
}

// JobSpec is a job to queue.
type JobSpec struct {
	Name   string
	Labels []string // runs-on
	Script string   // run by the stand-in runner with sh -c
	// Needs names jobs of the same run that must succeed first: until
	// then the job is pending, and it is queued (with its webhook) when
	// they have.
	Needs []string
	// Timeout is the job's timeout-minutes: a job running longer is
	// cancelled and concludes timed_out, its runner told to stop.
	Timeout time.Duration
}

// Job is a workflow job.
type Job struct {
	ID, RunID   int64
	Attempt     int
	Repo        string
	Name        string
	Labels      []string
	Script      string
	Needs       []string
	Timeout     time.Duration
	Status      string // pending (on needs), queued, in_progress, completed
	Conclusion  string // success, failure
	RunnerID    int64
	RunnerName  string
	Output      string
	CreatedAt   time.Time
	StartedAt   time.Time
	CompletedAt time.Time
	queuedAt    time.Time // when its needs released it
	// scaleSet is the scale set that acquired the job (0: none); only
	// its runners may take it.
	scaleSet int
}

// Run is a workflow run.
type Run struct {
	ID      int64
	Repo    string
	Attempt int
	Jobs    []int64 // of every attempt
}

// Server is a running simulator.
type Server struct {
	URL       string // base of the web side; the API is at URL/api/v3/
	runnerURL string
	opt       Options
	ts        *httptest.Server

	mu        sync.Mutex
	nextID    int64
	runners   map[int64]*Runner
	jobs      map[int64]*Job
	runs      map[int64]*Run
	appTokens map[string]time.Time
	jit       []string // names given JIT configs, in order
	regTokens int
	calls     map[string]int // "METHOD /path pattern" -> count
	limitTill time.Time      // rate limit exhausted until
	limited   int            // requests answered 403 rate limited
	dups      int            // JIT requests refused for a name in use
	reruns    []int64
	jobReruns []int64
	delivered int // webhook deliveries answered 2xx
	scale     scaleState
	faults    []fault
	failed    int // requests answered by a fault
	stop      chan struct{}
	hooks     sync.WaitGroup
}

// New starts a simulator. Close it when done.
func New(opt Options) *Server {
	if opt.DuplicateStatus == 0 {
		opt.DuplicateStatus = http.StatusConflict
	}
	if opt.LostAfter == 0 {
		opt.LostAfter = 3 * time.Second
	}
	if opt.SessionTimeout == 0 {
		opt.SessionTimeout = 10 * time.Second
	}
	if opt.LongPoll == 0 {
		opt.LongPoll = 2 * time.Second
	}
	if opt.QueueTokenLifetime == 0 {
		opt.QueueTokenLifetime = time.Hour
	}
	if opt.AdminTokenLifetime == 0 {
		opt.AdminTokenLifetime = time.Hour
	}
	s := &Server{
		opt: opt, nextID: 100,
		runners: map[int64]*Runner{}, jobs: map[int64]*Job{}, runs: map[int64]*Run{},
		appTokens: map[string]time.Time{}, calls: map[string]int{}, stop: make(chan struct{}),
	}
	mux := http.NewServeMux()
	api := func(pattern string, h func(w http.ResponseWriter, r *http.Request, scope string)) {
		method, path, _ := strings.Cut(pattern, " ")
		paths := []string{path}
		if strings.Contains(path, "{scope}") {
			paths = []string{strings.Replace(path, "{scope}", "/repos/{owner}/{repo}", 1), strings.Replace(path, "{scope}", "/orgs/{org}", 1)}
		}
		for _, p := range paths {
			full := method + " /api/v3" + p
			mux.HandleFunc(full, s.apiHandler(full, h))
		}
	}
	api("POST {scope}/actions/runners/generate-jitconfig", s.generateJIT)
	api("POST {scope}/actions/runners/registration-token", s.registrationToken)
	api("GET {scope}/actions/runners", s.listRunners)
	api("GET {scope}/actions/runners/{id}", s.getRunner)
	api("DELETE {scope}/actions/runners/{id}", s.deleteRunner)
	api("GET /repos/{owner}/{repo}/actions/runs", s.listRuns)
	api("GET /repos/{owner}/{repo}/actions/runs/{id}", s.getRun)
	api("GET /repos/{owner}/{repo}/actions/runs/{id}/jobs", s.listRunJobs)
	api("GET /repos/{owner}/{repo}/actions/jobs/{id}", s.getJob)
	api("POST /repos/{owner}/{repo}/actions/runs/{id}/rerun-failed-jobs", s.rerunFailed)
	api("POST /repos/{owner}/{repo}/actions/jobs/{id}/rerun", s.rerunJob)
	mux.HandleFunc("POST /api/v3/app/installations/{id}/access_tokens", s.accessToken)
	s.scaleSetRoutes(mux)
	mux.HandleFunc("POST /_runner/connect", s.runnerConnect)
	mux.HandleFunc("POST /_runner/acquire", s.runnerAcquire)
	mux.HandleFunc("POST /_runner/heartbeat", s.runnerHeartbeat)
	mux.HandleFunc("POST /_runner/complete", s.runnerComplete)
	// The addresses are set before the server starts: handlers read them.
	s.ts, s.URL, s.runnerURL = simserve.New(s.faulty(mux), opt.RunnerHost)
	s.ts.Start()
	go s.reap()
	return s
}

// Close stops the server.
func (s *Server) Close() {
	s.hooks.Wait()
	close(s.stop)
	s.ts.CloseClientConnections()
	s.ts.Close()
}

// APIURL is the REST base, as go-github wants it.
func (s *Server) APIURL() string { return s.URL + "/api/v3/" }

func (s *Server) id() int64 { s.nextID++; return s.nextID }

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ---- test controls ----

// ExhaustRateLimit makes every API call until then answer 403 with
// X-RateLimit-Remaining: 0 and X-RateLimit-Reset at that time.
func (s *Server) ExhaustRateLimit(until time.Time) {
	s.mu.Lock()
	s.limitTill = until
	s.mu.Unlock()
}

// Calls returns the number of API calls by endpoint pattern, and in all.
func (s *Server) Calls() (map[string]int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.calls {
		n += c
	}
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out, n
}

// RateLimited returns how many calls were answered 403 rate limited.
func (s *Server) RateLimited() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limited
}

// Duplicates returns how many JIT requests were refused for a name in use.
func (s *Server) Duplicates() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dups
}

// SetDuplicateStatus changes the answer to a JIT request for a name in use.
func (s *Server) SetDuplicateStatus(code int) {
	s.mu.Lock()
	s.opt.DuplicateStatus = code
	s.mu.Unlock()
}

// JITNames returns the names JIT configs were generated for, in order.
func (s *Server) JITNames() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.jit)
}

// RegistrationTokens returns how many registration tokens were issued.
func (s *Server) RegistrationTokens() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.regTokens
}

// Reruns returns the run IDs whose failed jobs were re-run.
func (s *Server) Reruns() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.reruns)
}

// Runners returns the registrations.
func (s *Server) Runners() []Runner {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Runner, 0, len(s.runners))
	for _, r := range s.runners {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b Runner) int { return int(a.ID - b.ID) })
	return out
}

// AddRunner registers a runner directly, as one left by a crash or by
// another tool would be.
func (s *Server) AddRunner(scope, name string, labels []string, online, busy bool) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := &Runner{ID: s.id(), Name: name, Labels: labels, Scope: scope, Group: 1, Online: online, lastSeen: time.Now().Add(time.Hour), token: randHex(16)}
	if busy {
		r.JobID = -1
	}
	s.runners[r.ID] = r
	return r.ID
}

// Queue adds a workflow run with the given jobs to a repository.
func (s *Server) Queue(repo string, jobs ...JobSpec) *Run {
	s.mu.Lock()
	defer s.mu.Unlock()
	run := &Run{ID: s.id(), Repo: repo, Attempt: 1}
	for _, j := range jobs {
		job := &Job{ID: s.id(), RunID: run.ID, Attempt: 1, Repo: repo, Name: j.Name, Labels: j.Labels, Script: j.Script, Needs: j.Needs, Timeout: j.Timeout, Status: "queued", CreatedAt: time.Now()}
		if len(j.Needs) > 0 {
			job.Status = "pending"
		} else {
			s.queued(job)
		}
		s.jobs[job.ID] = job
		run.Jobs = append(run.Jobs, job.ID)
	}
	s.runs[run.ID] = run
	cp := *run
	return &cp
}

// Jobs returns every job, of every attempt.
func (s *Server) Jobs() []Job {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Job, 0, len(s.jobs))
	for _, j := range s.jobs {
		out = append(out, *j)
	}
	slices.SortFunc(out, func(a, b Job) int { return int(a.ID - b.ID) })
	return out
}

// Assign starts a queued job on a registered runner, as if the runner had
// taken it.
func (s *Server) Assign(jobID, runnerID int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	j, x := s.jobs[jobID], s.runners[runnerID]
	if j == nil || x == nil || j.Status != "queued" {
		panic(fmt.Sprintf("ghsim: cannot assign job %d to runner %d", jobID, runnerID))
	}
	j.Status, j.RunnerID, j.RunnerName, j.StartedAt = "in_progress", x.ID, x.Name, time.Now()
	x.JobID, x.Online, x.lastSeen = j.ID, true, time.Now().Add(time.Hour)
	s.deliver("in_progress", j)
}

// Complete ends a job in progress with the conclusion, as its runner would.
func (s *Server) Complete(jobID int64, conclusion string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	j := s.jobs[jobID]
	x := s.runners[j.RunnerID]
	if x == nil {
		x = &Runner{}
	}
	s.finish(x, j, conclusion)
}

// Lose makes GitHub give up on a runner at once, as when it stops
// heartbeating: its job fails.
func (s *Server) Lose(runnerID int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if x := s.runners[runnerID]; x != nil {
		s.lose(x)
	}
}

// ---- REST ----

type apiError struct {
	Message string `json:"message"`
	DocURL  string `json:"documentation_url"`
	Status  string `json:"status"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	if v != nil {
		_ = json.NewEncoder(w).Encode(v)
	}
}

func fail(w http.ResponseWriter, code int, msg, doc string) {
	writeJSON(w, code, apiError{Message: msg, DocURL: "https://docs.github.com/rest" + doc, Status: strconv.Itoa(code)})
}

const rateLimit = 5000

// apiHandler counts the call, sets the rate-limit headers, answers 403
// while the limit is exhausted, checks credentials and the scope.
func (s *Server) apiHandler(pattern string, h func(http.ResponseWriter, *http.Request, string)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.calls[pattern]++
		used := 0
		for _, c := range s.calls {
			used += c
		}
		till := s.limitTill
		limited := time.Now().Before(till)
		if limited {
			s.limited++
		}
		s.mu.Unlock()
		reset := time.Now().Add(time.Hour)
		remaining := max(rateLimit-used, 1)
		if limited {
			reset, remaining = till, 0
		}
		h0 := w.Header()
		h0.Set("X-RateLimit-Limit", strconv.Itoa(rateLimit))
		h0.Set("X-RateLimit-Remaining", strconv.Itoa(remaining))
		h0.Set("X-RateLimit-Used", strconv.Itoa(rateLimit-remaining))
		// Seconds since the epoch, rounded up so the reset is never early.
		h0.Set("X-RateLimit-Reset", strconv.FormatInt((reset.UnixNano()+int64(time.Second)-1)/int64(time.Second), 10))
		h0.Set("X-RateLimit-Resource", "core")
		if limited {
			fail(w, http.StatusForbidden, "API rate limit exceeded for user ID 1.", "/overview/rate-limits-for-the-rest-api#about-primary-rate-limits")
			return
		}
		if !s.authorized(r) {
			fail(w, http.StatusUnauthorized, "Bad credentials", "")
			return
		}
		scope := ""
		if o := r.PathValue("owner"); o != "" {
			scope = o + "/" + r.PathValue("repo")
			if !slices.Contains(s.opt.Repos, scope) {
				fail(w, http.StatusNotFound, "Not Found", "")
				return
			}
		} else if o := r.PathValue("org"); o != "" {
			scope = o
			if !slices.Contains(s.opt.Orgs, scope) {
				fail(w, http.StatusNotFound, "Not Found", "")
				return
			}
		}
		h(w, r, scope)
	}
}

func (s *Server) authorized(r *http.Request) bool {
	a := r.Header.Get("Authorization")
	tok, ok := strings.CutPrefix(a, "Bearer ")
	if !ok {
		tok, ok = strings.CutPrefix(a, "token ")
	}
	if !ok || tok == "" {
		return false
	}
	if s.opt.Token != "" && tok == s.opt.Token {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	exp, ok := s.appTokens[tok]
	return ok && time.Now().Before(exp)
}

type runnerLabel struct {
	ID   int64  `json:"id"`
	Name string `json:"name"`
	Type string `json:"type"`
}

type runnerJSON struct {
	ID            int64         `json:"id"`
	Name          string        `json:"name"`
	OS            string        `json:"os"`
	Status        string        `json:"status"`
	Busy          bool          `json:"busy"`
	Ephemeral     bool          `json:"ephemeral"`
	RunnerGroupID int64         `json:"runner_group_id"`
	Labels        []runnerLabel `json:"labels"`
}

func (r *Runner) json() runnerJSON {
	st := "offline"
	if r.Online {
		st = "online"
	}
	out := runnerJSON{ID: r.ID, Name: r.Name, OS: "Linux", Status: st, Busy: r.JobID != 0, Ephemeral: r.Ephemeral, RunnerGroupID: r.Group, Labels: []runnerLabel{}}
	for i, l := range r.Labels {
		out.Labels = append(out.Labels, runnerLabel{ID: int64(i + 1), Name: l, Type: "custom"})
	}
	return out
}

func (s *Server) generateJIT(w http.ResponseWriter, r *http.Request, scope string) {
	if s.opt.NoJIT {
		fail(w, http.StatusNotFound, "Not Found", "")
		return
	}
	var body struct {
		Name          string   `json:"name"`
		RunnerGroupID *int64   `json:"runner_group_id"`
		Labels        []string `json:"labels"`
		WorkFolder    string   `json:"work_folder"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		fail(w, http.StatusUnprocessableEntity, "Invalid request.\n\nProblems parsing JSON", "/actions/self-hosted-runners#create-configuration-for-a-just-in-time-runner-for-a-repository")
		return
	}
	switch {
	case body.Name == "":
		fail(w, http.StatusUnprocessableEntity, "Invalid request.\n\n\"name\" wasn't supplied.", "/actions/self-hosted-runners")
		return
	case body.RunnerGroupID == nil:
		fail(w, http.StatusUnprocessableEntity, "Invalid input: object is missing required key: runner_group_id.", "/actions/self-hosted-runners")
		return
	case *body.RunnerGroupID < 1:
		writeJSON(w, http.StatusUnprocessableEntity, map[string]any{
			"message": "Validation Failed", "status": "422",
			"errors":            []map[string]string{{"resource": "Runner", "field": "runner_group_id", "code": "invalid"}},
			"documentation_url": "https://docs.github.com/rest/actions/self-hosted-runners",
		})
		return
	case len(body.Labels) == 0 || len(body.Labels) > 100:
		fail(w, http.StatusUnprocessableEntity, "Invalid request.\n\nlabels must have between 1 and 100 items.", "/actions/self-hosted-runners")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, x := range s.runners {
		if x.Scope == scope && x.Name == body.Name {
			s.dups++
			if s.opt.DuplicateInErrors {
				writeJSON(w, http.StatusUnprocessableEntity, map[string]any{
					"message":           "Validation Failed",
					"errors":            []map[string]string{{"resource": "Runner", "field": "name", "code": "already_exists", "message": "A runner with the name " + body.Name + " already exists."}},
					"documentation_url": "https://docs.github.com/rest/actions/self-hosted-runners",
					"status":            "422",
				})
				return
			}
			fail(w, s.opt.DuplicateStatus, "Already exists - A runner with the name "+body.Name+" already exists.", "/actions/self-hosted-runners")
			return
		}
	}
	run := &Runner{ID: s.id(), Name: body.Name, Labels: body.Labels, Scope: scope, Group: *body.RunnerGroupID, Ephemeral: true, token: randHex(20)}
	s.runners[run.ID] = run
	s.jit = append(s.jit, body.Name)
	writeJSON(w, http.StatusCreated, map[string]any{"runner": run.json(), "encoded_jit_config": s.encodeJIT(run)})
}

// encodeJIT builds a config shaped like GitHub's: base64 of a JSON map of
// the runner's settings files, each base64 encoded.
func (s *Server) encodeJIT(r *Runner) string {
	url := s.runnerURL
	b64 := func(v any) string {
		b, _ := json.Marshal(v)
		return base64.StdEncoding.EncodeToString(b)
	}
	files := map[string]string{
		".runner": b64(map[string]any{
			"agentId": r.ID, "agentName": r.Name, "poolId": r.Group, "serverUrl": url,
			"gitHubUrl": url + "/" + r.Scope, "workFolder": "_work", "ephemeral": true,
		}),
		".credentials": b64(map[string]any{
			"scheme": "OAuth",
			"data":   map[string]string{"clientId": randHex(8), "authorizationUrl": url + "/_runner/token", "token": r.token},
		}),
		".credentials_rsaparams": b64(map[string]string{"d": randHex(8)}),
	}
	return b64(files)
}

func (s *Server) registrationToken(w http.ResponseWriter, r *http.Request, scope string) {
	tok := "AABF" + randHex(14)
	s.mu.Lock()
	s.regTokens++
	s.scale.remember(tok, scope)
	s.mu.Unlock()
	writeJSON(w, http.StatusCreated, map[string]any{"token": tok, "expires_at": time.Now().Add(time.Hour).UTC().Format(time.RFC3339)})
}

func (s *Server) listRunners(w http.ResponseWriter, r *http.Request, scope string) {
	perPage, page := paging(r)
	name := r.URL.Query().Get("name")
	s.mu.Lock()
	var all []runnerJSON
	for _, x := range s.runners {
		if x.Scope == scope && (name == "" || x.Name == name) {
			all = append(all, x.json())
		}
	}
	s.mu.Unlock()
	slices.SortFunc(all, func(a, b runnerJSON) int { return int(a.ID - b.ID) })
	items := pageOf(w, r, all, perPage, page)
	writeJSON(w, http.StatusOK, map[string]any{"total_count": len(all), "runners": items})
}

func paging(r *http.Request) (perPage, page int) {
	perPage, page = 30, 1
	if v, err := strconv.Atoi(r.URL.Query().Get("per_page")); err == nil && v > 0 {
		perPage = min(v, 100)
	}
	if v, err := strconv.Atoi(r.URL.Query().Get("page")); err == nil && v > 0 {
		page = v
	}
	return perPage, page
}

// pageOf cuts one page and sets the Link header GitHub sends.
func pageOf[T any](w http.ResponseWriter, r *http.Request, all []T, perPage, page int) []T {
	from := min((page-1)*perPage, len(all))
	to := min(from+perPage, len(all))
	if to < len(all) {
		u := *r.URL
		q := u.Query()
		q.Set("page", strconv.Itoa(page+1))
		q.Set("per_page", strconv.Itoa(perPage))
		u.RawQuery = q.Encode()
		next := (&url.URL{Scheme: "http", Host: r.Host, Path: u.Path, RawQuery: u.RawQuery}).String()
		w.Header().Set("Link", fmt.Sprintf(`<%s>; rel="next"`, next))
	}
	out := all[from:to]
	if out == nil {
		out = []T{}
	}
	return out
}

func (s *Server) runnerIn(w http.ResponseWriter, r *http.Request, scope string) *Runner {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err == nil {
		if x, ok := s.runners[id]; ok && x.Scope == scope {
			return x
		}
	}
	fail(w, http.StatusNotFound, "Not Found", "/actions/self-hosted-runners")
	return nil
}

func (s *Server) getRunner(w http.ResponseWriter, r *http.Request, scope string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if x := s.runnerIn(w, r, scope); x != nil {
		writeJSON(w, http.StatusOK, x.json())
	}
}

func (s *Server) deleteRunner(w http.ResponseWriter, r *http.Request, scope string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	x := s.runnerIn(w, r, scope)
	if x == nil {
		return
	}
	if x.JobID != 0 {
		fail(w, http.StatusUnprocessableEntity, "Bad request - Runner \""+x.Name+"\" is still running a job\"", "/actions/self-hosted-runners#delete-a-self-hosted-runner-from-a-repository")
		return
	}
	delete(s.runners, x.ID)
	w.WriteHeader(http.StatusNoContent)
}

type runJSON struct {
	ID         int64   `json:"id"`
	RunAttempt int     `json:"run_attempt"`
	Status     string  `json:"status"`
	Conclusion *string `json:"conclusion"`
	UpdatedAt  string  `json:"updated_at"`
}

// runState derives a run's status from its latest attempt's jobs.
func (s *Server) runState(run *Run) runJSON {
	// A run is queued until one of its jobs starts, then in progress
	// until all have ended: a job queued behind needs: is inside a run
	// in progress.
	out := runJSON{ID: run.ID, RunAttempt: run.Attempt, Status: "completed"}
	concl := "success"
	open, started := false, false
	var updated time.Time
	for _, j := range s.latest(run) {
		for _, t := range []time.Time{j.CreatedAt, j.StartedAt, j.CompletedAt, j.queuedAt} {
			if t.After(updated) {
				updated = t
			}
		}
		switch j.Status {
		case "queued", "pending":
			open = true
		case "in_progress":
			open, started = true, true
		case "completed":
			started = started || j.Attempt == run.Attempt
			if j.Conclusion != "success" && j.Conclusion != "skipped" {
				concl = "failure"
			}
		}
	}
	out.UpdatedAt = updated.UTC().Format(time.RFC3339Nano)
	switch {
	case open && started:
		out.Status = "in_progress"
	case open:
		out.Status = "queued"
	default:
		out.Conclusion = &concl
	}
	return out
}

// latest returns a run's jobs of its latest attempt: re-run jobs replace
// the failed ones, passed jobs carry over.
func (s *Server) latest(run *Run) []*Job {
	byName := map[string]*Job{}
	var order []string
	for _, id := range run.Jobs {
		j := s.jobs[id]
		if _, ok := byName[j.Name]; !ok {
			order = append(order, j.Name)
		}
		byName[j.Name] = j
	}
	out := make([]*Job, 0, len(order))
	for _, n := range order {
		out = append(out, byName[n])
	}
	return out
}

func (s *Server) listRuns(w http.ResponseWriter, r *http.Request, scope string) {
	perPage, page := paging(r)
	status := r.URL.Query().Get("status")
	s.mu.Lock()
	var all []runJSON
	for _, run := range s.runs {
		st := s.runState(run)
		if run.Repo == scope && (status == "" || st.Status == status || (st.Conclusion != nil && *st.Conclusion == status)) {
			all = append(all, st)
		}
	}
	s.mu.Unlock()
	slices.SortFunc(all, func(a, b runJSON) int { return int(b.ID - a.ID) })
	items := pageOf(w, r, all, perPage, page)
	writeJSON(w, http.StatusOK, map[string]any{"total_count": len(all), "workflow_runs": items})
}

func (s *Server) runIn(w http.ResponseWriter, r *http.Request, scope string) *Run {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err == nil {
		if run, ok := s.runs[id]; ok && run.Repo == scope {
			return run
		}
	}
	fail(w, http.StatusNotFound, "Not Found", "/actions/workflow-runs")
	return nil
}

func (s *Server) getRun(w http.ResponseWriter, r *http.Request, scope string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if run := s.runIn(w, r, scope); run != nil {
		writeJSON(w, http.StatusOK, s.runState(run))
	}
}

type jobJSON struct {
	ID          int64    `json:"id"`
	RunID       int64    `json:"run_id"`
	RunAttempt  int      `json:"run_attempt"`
	Name        string   `json:"name"`
	Status      string   `json:"status"`
	Conclusion  *string  `json:"conclusion"`
	Labels      []string `json:"labels"`
	RunnerID    *int64   `json:"runner_id"`
	RunnerName  *string  `json:"runner_name"`
	CreatedAt   string   `json:"created_at"`
	StartedAt   *string  `json:"started_at"`
	CompletedAt *string  `json:"completed_at"`
}

func (j *Job) json() jobJSON {
	out := jobJSON{ID: j.ID, RunID: j.RunID, RunAttempt: j.Attempt, Name: j.Name, Status: j.Status, Labels: j.Labels, CreatedAt: j.CreatedAt.UTC().Format(time.RFC3339)}
	if j.Conclusion != "" {
		c := j.Conclusion
		out.Conclusion = &c
	}
	if j.RunnerID != 0 {
		id, n := j.RunnerID, j.RunnerName
		out.RunnerID, out.RunnerName = &id, &n
	}
	if !j.StartedAt.IsZero() {
		t := j.StartedAt.UTC().Format(time.RFC3339)
		out.StartedAt = &t
	}
	if !j.CompletedAt.IsZero() {
		t := j.CompletedAt.UTC().Format(time.RFC3339)
		out.CompletedAt = &t
	}
	return out
}

func (s *Server) listRunJobs(w http.ResponseWriter, r *http.Request, scope string) {
	perPage, page := paging(r)
	s.mu.Lock()
	run := s.runIn(w, r, scope)
	if run == nil {
		s.mu.Unlock()
		return
	}
	var all []jobJSON
	src := s.latest(run)
	if r.URL.Query().Get("filter") == "all" {
		src = nil
		for _, id := range run.Jobs {
			src = append(src, s.jobs[id])
		}
	}
	for _, j := range src {
		all = append(all, j.json())
	}
	s.mu.Unlock()
	items := pageOf(w, r, all, perPage, page)
	writeJSON(w, http.StatusOK, map[string]any{"total_count": len(all), "jobs": items})
}

func (s *Server) getJob(w http.ResponseWriter, r *http.Request, scope string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id, _ := strconv.ParseInt(r.PathValue("id"), 10, 64)
	j, ok := s.jobs[id]
	if !ok || j.Repo != scope {
		fail(w, http.StatusNotFound, "Not Found", "/actions/workflow-jobs")
		return
	}
	writeJSON(w, http.StatusOK, j.json())
}

func (s *Server) rerunFailed(w http.ResponseWriter, r *http.Request, scope string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	run := s.runIn(w, r, scope)
	if run == nil {
		return
	}
	st := s.runState(run)
	if st.Status != "completed" {
		fail(w, http.StatusForbidden, "This workflow is already running", "/actions/workflow-runs#re-run-failed-jobs-from-a-workflow-run")
		return
	}
	run.Attempt++
	for _, j := range s.latest(run) {
		if j.Conclusion == "success" {
			continue
		}
		nj := &Job{ID: s.id(), RunID: run.ID, Attempt: run.Attempt, Repo: run.Repo, Name: j.Name, Labels: j.Labels, Script: j.Script, Needs: j.Needs, Timeout: j.Timeout, Status: "pending", CreatedAt: time.Now()}
		s.jobs[nj.ID] = nj
		run.Jobs = append(run.Jobs, nj.ID)
	}
	s.release(run)
	s.reruns = append(s.reruns, run.ID)
	writeJSON(w, http.StatusCreated, map[string]any{})
}

// rerunJob re-runs one job of an ended run, as a new attempt of the run
// ("Re-run a job from a workflow run"; its dependants are not re-run
// here).
func (s *Server) rerunJob(w http.ResponseWriter, r *http.Request, scope string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id, _ := strconv.ParseInt(r.PathValue("id"), 10, 64)
	j, ok := s.jobs[id]
	if !ok || j.Repo != scope {
		fail(w, http.StatusNotFound, "Not Found", "/actions/workflow-runs#re-run-a-job-from-a-workflow-run")
		return
	}
	run := s.runs[j.RunID]
	if st := s.runState(run); st.Status != "completed" {
		fail(w, http.StatusForbidden, "This workflow is already running", "/actions/workflow-runs#re-run-a-job-from-a-workflow-run")
		return
	}
	run.Attempt++
	nj := &Job{ID: s.id(), RunID: run.ID, Attempt: run.Attempt, Repo: run.Repo, Name: j.Name, Labels: j.Labels, Script: j.Script, Timeout: j.Timeout, Status: "pending", CreatedAt: time.Now()}
	s.jobs[nj.ID] = nj
	run.Jobs = append(run.Jobs, nj.ID)
	s.release(run)
	s.jobReruns = append(s.jobReruns, j.ID)
	writeJSON(w, http.StatusCreated, map[string]any{})
}

// JobReruns returns the jobs re-run one by one, in order.
func (s *Server) JobReruns() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.jobReruns)
}

// accessToken issues an installation token for a JWT signed with the
// App's private key, as POST /app/installations/{id}/access_tokens does.
func (s *Server) accessToken(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.calls["POST /api/v3/app/installations/{id}/access_tokens"]++
	s.mu.Unlock()
	raw, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || s.opt.AppKey == nil {
		fail(w, http.StatusUnauthorized, "A JSON web token could not be decoded", "")
		return
	}
	var claims jwt.RegisteredClaims
	_, err := jwt.ParseWithClaims(raw, &claims, func(t *jwt.Token) (any, error) {
		if _, ok := t.Method.(*jwt.SigningMethodRSA); !ok {
			return nil, fmt.Errorf("unexpected signing method %v", t.Header["alg"])
		}
		return s.opt.AppKey, nil
	})
	if err != nil || claims.Issuer != strconv.FormatInt(s.opt.AppID, 10) {
		fail(w, http.StatusUnauthorized, "A JSON web token could not be decoded", "")
		return
	}
	if r.PathValue("id") != strconv.FormatInt(s.opt.InstallationID, 10) {
		fail(w, http.StatusNotFound, "Not Found", "/apps/apps#create-an-installation-access-token-for-an-app")
		return
	}
	tok := "ghs_" + randHex(18)
	exp := time.Now().Add(time.Hour)
	s.mu.Lock()
	s.appTokens[tok] = exp
	s.mu.Unlock()
	writeJSON(w, http.StatusCreated, map[string]any{"token": tok, "expires_at": exp.UTC().Format(time.RFC3339)})
}

// ---- runner side ----

func (s *Server) runnerFor(w http.ResponseWriter, r *http.Request) *Runner {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	for _, x := range s.runners {
		if tok != "" && x.token == tok {
			return x
		}
	}
	http.Error(w, "runner not registered", http.StatusUnauthorized)
	return nil
}

func (s *Server) runnerConnect(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if x := s.runnerFor(w, r); x != nil {
		x.Online, x.lastSeen = true, time.Now()
		writeJSON(w, http.StatusOK, map[string]any{"id": x.ID, "name": x.Name})
	}
}

// covers reports whether a runner's labels cover a job's runs-on labels.
// Every self-hosted runner also answers to "self-hosted".
func covers(runner, job []string) bool {
	for _, l := range job {
		if !strings.EqualFold(l, "self-hosted") && !slices.ContainsFunc(runner, func(x string) bool { return strings.EqualFold(x, l) }) {
			return false
		}
	}
	return true
}

// runnerAcquire long-polls for up to 2s for a job the runner can take.
func (s *Server) runnerAcquire(w http.ResponseWriter, r *http.Request) {
	deadline := time.Now().Add(2 * time.Second)
	for {
		s.mu.Lock()
		x := s.runnerFor(w, r)
		if x == nil {
			s.mu.Unlock()
			return
		}
		x.Online, x.lastSeen = true, time.Now()
		var pick *Job
		for _, j := range s.jobs {
			owner, _, _ := strings.Cut(j.Repo, "/")
			// A scale set's runner takes only jobs its scale set
			// acquired; other runners never take those.
			mine := j.scaleSet == x.ScaleSet && (x.ScaleSet != 0 || covers(x.Labels, j.Labels))
			if j.Status == "queued" && (x.Scope == j.Repo || x.Scope == owner) && mine && (pick == nil || j.ID < pick.ID) {
				pick = j
			}
		}
		if pick != nil && x.JobID == 0 {
			pick.Status, pick.RunnerID, pick.RunnerName, pick.StartedAt = "in_progress", x.ID, x.Name, time.Now()
			x.JobID = pick.ID
			s.deliver("in_progress", pick)
			s.scaleEvent(pick, "JobStarted")
			out := map[string]any{"id": pick.ID, "name": pick.Name, "script": pick.Script, "run_id": pick.RunID, "repository": pick.Repo}
			s.mu.Unlock()
			writeJSON(w, http.StatusOK, out)
			return
		}
		s.mu.Unlock()
		if time.Now().After(deadline) {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (s *Server) runnerHeartbeat(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	x := s.runnerFor(w, r)
	if x == nil {
		return
	}
	x.lastSeen = time.Now()
	// A job past its timeout-minutes is cancelled: it concludes
	// timed_out, and its runner is told to stop it.
	if j, ok := s.jobs[x.JobID]; ok && j.Timeout > 0 && time.Since(j.StartedAt) > j.Timeout {
		j.Output = "The job running on runner " + x.Name + " has exceeded the maximum execution time"
		s.finish(x, j, "timed_out")
		http.Error(w, "job cancelled: timed out", http.StatusConflict)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) runnerComplete(w http.ResponseWriter, r *http.Request) {
	var body struct {
		ID         int64  `json:"id"`
		Conclusion string `json:"conclusion"`
		Output     string `json:"output"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	x := s.runnerFor(w, r)
	if x == nil {
		return
	}
	j, ok := s.jobs[body.ID]
	if !ok || x.JobID != j.ID {
		http.Error(w, "not this runner's job", http.StatusConflict)
		return
	}
	j.Output = body.Output
	s.finish(x, j, body.Conclusion)
	w.WriteHeader(http.StatusNoContent)
}

// finish completes a job; an ephemeral runner is deleted with it, as
// GitHub deletes a JIT runner once its job is done. Called with s.mu held.
func (s *Server) finish(x *Runner, j *Job, conclusion string) {
	j.Status, j.Conclusion, j.CompletedAt = "completed", conclusion, time.Now()
	x.JobID = 0
	s.deliver("completed", j)
	s.scaleEvent(j, "JobCompleted")
	if x.Ephemeral {
		delete(s.runners, x.ID)
	}
	s.release(s.runs[j.RunID])
}

// release queues a run's pending jobs whose needs have all succeeded, and
// skips those whose needs did not. Called with s.mu held.
func (s *Server) release(run *Run) {
	if run == nil {
		return
	}
	latest := s.latest(run)
	byName := map[string]*Job{}
	for _, j := range latest {
		byName[j.Name] = j
	}
	for _, j := range latest {
		if j.Status != "pending" {
			continue
		}
		ready, failed := true, false
		for _, n := range j.Needs {
			switch d := byName[n]; {
			case d == nil || d.Status != "completed":
				ready = false
			case d.Conclusion != "success":
				failed = true
			}
		}
		switch {
		case failed && ready:
			j.Status, j.Conclusion, j.CompletedAt = "completed", "skipped", time.Now()
			s.deliver("completed", j)
			s.release(run)
			return
		case ready:
			j.Status, j.queuedAt = "queued", time.Now()
			s.queued(j)
		}
	}
}

// reap gives up runners that stopped heartbeating: a job they held fails,
// and they go offline.
func (s *Server) reap() {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.mu.Lock()
		for _, x := range s.runners {
			if !x.Online || time.Since(x.lastSeen) < s.opt.LostAfter {
				continue
			}
			s.lose(x)
		}
		s.mu.Unlock()
	}
}

// lose gives up a runner: it goes offline and a job it held fails. It
// stays registered, offline, when KeepLostRunners says so. Called with
// s.mu held.
func (s *Server) lose(x *Runner) {
	x.Online = false
	j, ok := s.jobs[x.JobID]
	if !ok || j.Status != "in_progress" {
		return
	}
	j.Output += "\nThe runner has received a shutdown signal or lost communication with the server."
	eph := x.Ephemeral
	if s.opt.KeepLostRunners {
		x.Ephemeral = false
	}
	s.finish(x, j, "failure")
	x.Ephemeral = eph
}

// deliver sends a workflow_job webhook for a job's new state, in the
// background. Called with s.mu held.
func (s *Server) deliver(action string, j *Job) {
	if s.opt.WebhookURL == "" {
		return
	}
	body, _ := json.Marshal(map[string]any{
		"action":       action,
		"workflow_job": j.json(),
		"repository":   map[string]any{"full_name": j.Repo},
	})
	mac := hmac.New(sha256.New, []byte(s.opt.WebhookSecret))
	mac.Write(body)
	sig := "sha256=" + hex.EncodeToString(mac.Sum(nil))
	n := 1
	if s.opt.Redeliver {
		n = 2
	}
	delivery := randHex(16)
	for range n {
		s.hooks.Go(func() {
			req, err := http.NewRequest("POST", s.opt.WebhookURL, bytes.NewReader(body))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("User-Agent", "GitHub-Hookshot/ghsim")
			req.Header.Set("X-GitHub-Event", "workflow_job")
			req.Header.Set("X-GitHub-Delivery", delivery)
			req.Header.Set("X-Hub-Signature-256", sig)
			c := &http.Client{Timeout: 10 * time.Second}
			res, err := c.Do(req)
			if err != nil {
				return
			}
			res.Body.Close()
			if res.StatusCode/100 == 2 {
				s.mu.Lock()
				s.delivered++
				s.mu.Unlock()
			}
		})
	}
}

// Delivered returns the webhook deliveries answered with a 2xx.
func (s *Server) Delivered() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.delivered
}
