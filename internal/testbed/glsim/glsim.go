// Package glsim stands in for GitLab, following GitLab's REST API
// documentation (runners, jobs, Job Hooks) and gitlab-runner's protocol.
// GitLab cannot run where runfleet is tested, so its driver is tested
// against this.
//
// The REST side (under /api/v4/) implements the endpoints the driver
// calls as GitLab documents them: POST /user/runners answering 201 with
// the runner's id and glrt- token, or 400 with GitLab's validation
// messages; runner lists per project, group and instance with GitLab's
// pagination headers (20 a page unless per_page says, 100 at most);
// runner details, pause and deletion; a runner's jobs; a project's jobs
// by scope, each with its ref; a project's protected branches; job cancel
// and retry. A runner's access_level decides, as GitLab's, whether it may
// take jobs of unprotected refs. Errors have GitLab's shapes: {"message":
// "404 Project Not Found"}, {"error": "runner_type is missing"}, and 401
// without a valid PRIVATE-TOKEN or bearer token. While the rate limit is
// exhausted every call is answered 429 with RateLimit-* and Retry-After.
//
// The runner side follows gitlab-runner's protocol (common/network.go and
// network/gitlab.go in its source): POST /jobs/request with the runner's
// token answers 201 with a job or 204; PUT /jobs/:id takes the state and
// exit code (200; 202 while the trace is short of what the runner says it
// sent; 403 with Job-Status once the job is no longer running); PATCH
// /jobs/:id/trace takes Content-Range and answers 202 with Range, or 416
// with the range it has. The stand-in runner binary is ./runner.
//
// Job Hook deliveries go to Options.HookURL with X-Gitlab-Token, each
// from its own goroutine, so in no guaranteed order.
package glsim

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/simserve"
)

// Options configures a Server.
type Options struct {
	// Token is the access token the REST API accepts (PRIVATE-TOKEN or
	// Authorization: Bearer).
	Token string
	// Scopes are Token's scopes (api, read_api, create_runner,
	// manage_runner), each call checked against them as GitLab checks
	// them (scope.go); ["api"] when nil.
	Scopes []string
	// Admin lets the token list and manage instance runners.
	Admin bool
	// Projects exist, by full path ("acme/models"); their namespaces
	// exist as groups. Anything else is 404.
	Projects []string
	// RunnerHost is the host runners reach the simulator at
	// (host.docker.internal for containers); the server then listens on
	// every address. 127.0.0.1 when empty.
	RunnerHost string
	// HookURL receives Job Hook deliveries with HookSecret in
	// X-Gitlab-Token.
	HookURL, HookSecret string
	// AcceptFinalLater answers a job's first final update 202 (accepted,
	// not yet completed), as GitLab does while it archives the trace:
	// the runner must send it again.
	AcceptFinalLater bool
	// ProtectedBranches are the projects' protected branches, by name or
	// wildcard (release/*); ["main"] when nil, as GitLab protects a new
	// project's default branch
	// (docs.gitlab.com/user/project/repository/branches/protected).
	ProtectedBranches []string
}

// Runner is a runner at GitLab.
type Runner struct {
	ID          int64
	Description string
	Type        string // instance_type, group_type, project_type
	ProjectID   int64
	GroupID     int64
	Tags        []string
	RunUntagged bool
	// AccessLevel is not_protected (GitLab's default) or ref_protected:
	// a ref_protected runner takes only jobs of protected refs
	// (app/models/ci/runner.rb, can_pick?: "return false if
	// self.ref_protected? && !build.protected?").
	AccessLevel    string
	Locked         bool
	Paused         bool
	MaximumTimeout int64
	Token          string
	// Tokens are every token the runner has held, the first its
	// creation's, the last its current one (reset_authentication_token).
	Tokens      []string
	ContactedAt time.Time
	// Deleted is set once the runner was deleted; it is kept for the
	// test to read.
	Deleted bool
}

// JobSpec is a job of a pipeline to create.
type JobSpec struct {
	Name   string
	Stage  string   // "test" when empty
	Tags   []string // the job's tags
	Script string   // run by the stand-in runner with sh -c
	// Ref is the branch the pipeline runs for ("main" when empty).
	Ref string
	// Timeout is the job's timeout (1h when zero), given to the runner.
	Timeout time.Duration
}

// Job is a CI job.
type Job struct {
	ID, PipelineID, ProjectID int64
	Name, Stage               string
	Tags                      []string
	Script                    string
	Timeout                   time.Duration
	// Ref is its pipeline's branch; Protected is set when the branch is
	// protected, as GitLab marks a build of a protected ref.
	Ref       string
	Protected bool
	// Status is created, pending, running, success, failed or canceled.
	Status        string
	FailureReason string
	ExitCode      int
	RunnerID      int64
	// RunnerDescription is the description of the runner that took it,
	// kept after the runner is deleted.
	RunnerDescription string
	Token             string // the job token, while it runs
	Trace             []byte
	RetryOf           int64 // the job this one retries
	CreatedAt         time.Time
	StartedAt         time.Time
	FinishedAt        time.Time
	finalAccepted     bool
}

// Finished reports whether the job has ended.
func (j Job) Finished() bool {
	switch j.Status {
	case "success", "failed", "canceled", "skipped":
		return true
	}
	return false
}

type project struct {
	ID      int64
	Path    string // full path
	GroupID int64
}

type group struct {
	ID   int64
	Path string
}

// Server is a running simulator.
type Server struct {
	URL       string // base; the API is at URL/api/v4/
	runnerURL string
	opt       Options
	ts        *httptest.Server

	mu            sync.Mutex
	nextID        int64
	projects      map[int64]*project
	groups        map[int64]*group
	runners       map[int64]*Runner
	jobs          map[int64]*Job
	calls         map[string]int // "METHOD pattern" -> count
	limitTill     time.Time
	limited       int
	scopeRefusals []string // calls refused for a scope the token lacks
	down          bool
	deliveries    map[int]int // hook answers by status code
	hooks         sync.WaitGroup
}

// New starts a simulator. Close it when done.
func New(opt Options) *Server {
	s := &Server{
		opt: opt, nextID: 1000,
		projects: map[int64]*project{}, groups: map[int64]*group{},
		runners: map[int64]*Runner{}, jobs: map[int64]*Job{},
		calls: map[string]int{}, deliveries: map[int]int{},
	}
	for _, p := range opt.Projects {
		ns, _, _ := strings.Cut(p, "/")
		var g *group
		for _, have := range s.groups {
			if have.Path == ns {
				g = have
			}
		}
		if g == nil {
			g = &group{ID: s.id(), Path: ns}
			s.groups[g.ID] = g
		}
		pr := &project{ID: s.id(), Path: p, GroupID: g.ID}
		s.projects[pr.ID] = pr
	}
	mux := http.NewServeMux()
	s.restRoutes(mux)
	s.runnerRoutes(mux)
	s.ts, s.URL, s.runnerURL = simserve.New(mux, opt.RunnerHost)
	s.ts.Start()
	return s
}

// Close stops the server once every hook delivery has been answered.
func (s *Server) Close() {
	s.hooks.Wait()
	s.ts.CloseClientConnections()
	s.ts.Close()
}

// RunnerURL is the address runners are given to reach the simulator.
func (s *Server) RunnerURL() string { return s.runnerURL }

func (s *Server) id() int64 { s.nextID++; return s.nextID }

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ---- test controls ----

// ProjectID returns a project's id by its path, 0 when there is none.
func (s *Server) ProjectID(path string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.projects {
		if p.Path == path {
			return p.ID
		}
	}
	return 0
}

// CreatePipeline creates a pipeline of pending jobs in a project and
// returns its id.
func (s *Server) CreatePipeline(projectPath string, jobs ...JobSpec) (int64, error) {
	s.mu.Lock()
	var pr *project
	for _, p := range s.projects {
		if p.Path == projectPath {
			pr = p
		}
	}
	if pr == nil {
		s.mu.Unlock()
		return 0, fmt.Errorf("glsim: no project %q", projectPath)
	}
	pipeline := s.id()
	var made []Job
	for _, spec := range jobs {
		j := &Job{
			ID: s.id(), PipelineID: pipeline, ProjectID: pr.ID, Name: spec.Name, Stage: spec.Stage,
			Tags: slices.Clone(spec.Tags), Script: spec.Script, Timeout: spec.Timeout,
			Status: "pending", CreatedAt: time.Now().UTC(), Ref: cmp.Or(spec.Ref, "main"),
		}
		j.Protected = s.protected(j.Ref)
		if j.Stage == "" {
			j.Stage = "test"
		}
		if j.Timeout <= 0 {
			j.Timeout = time.Hour
		}
		s.jobs[j.ID] = j
		made = append(made, *j)
	}
	s.mu.Unlock()
	for _, j := range made {
		j.Status = "created"
		s.deliver(j, pr.Path)
		j.Status = "pending"
		s.deliver(j, pr.Path)
	}
	return pipeline, nil
}

// protectedBranches are the projects' protected branches.
func (s *Server) protectedBranches() []string {
	if s.opt.ProtectedBranches == nil {
		return []string{"main"}
	}
	return s.opt.ProtectedBranches
}

// protected reports whether a branch is protected: named, or matched by a
// wildcard, where * matches any characters, slashes included.
func (s *Server) protected(ref string) bool {
	for _, p := range s.protectedBranches() {
		re := "^" + strings.ReplaceAll(regexp.QuoteMeta(p), `\*`, ".*") + "$"
		if ok, _ := regexp.MatchString(re, ref); ok {
			return true
		}
	}
	return false
}

// CancelJob cancels a job, as a user pressing Cancel does: a running
// job's runner learns it from Job-Status on its next trace or update.
func (s *Server) CancelJob(id int64) error {
	s.mu.Lock()
	j, ok := s.jobs[id]
	if !ok || j.Finished() {
		s.mu.Unlock()
		return fmt.Errorf("glsim: job %d is not pending or running", id)
	}
	s.finish(j, "canceled", "")
	snap, path := *j, s.projects[j.ProjectID].Path
	s.mu.Unlock()
	s.deliver(snap, path)
	return nil
}

// Jobs returns every job, by id.
func (s *Server) Jobs() []Job {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Job
	for _, id := range slices.Sorted(maps.Keys(s.jobs)) {
		j := *s.jobs[id]
		j.Tags, j.Trace = slices.Clone(j.Tags), slices.Clone(j.Trace)
		out = append(out, j)
	}
	return out
}

// Runners returns the runners not deleted, by id.
func (s *Server) Runners() []Runner {
	return s.runnersWhere(func(r *Runner) bool { return !r.Deleted })
}

// AllRunners returns every runner ever created, deleted ones included.
func (s *Server) AllRunners() []Runner {
	return s.runnersWhere(func(*Runner) bool { return true })
}

func (s *Server) runnersWhere(keep func(*Runner) bool) []Runner {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Runner
	for _, id := range slices.Sorted(maps.Keys(s.runners)) {
		if r := s.runners[id]; keep(r) {
			c := *r
			c.Tags = slices.Clone(r.Tags)
			out = append(out, c)
		}
	}
	return out
}

// Calls returns the REST and runner calls by "METHOD pattern", and in
// all.
func (s *Server) Calls() (map[string]int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.calls {
		n += c
	}
	return maps.Clone(s.calls), n
}

// ManagerCalls counts the REST calls (those the manager makes), leaving
// out the runners' own job requests, updates and traces.
func (s *Server) ManagerCalls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, c := range s.calls {
		if !strings.Contains(k, " /api/v4/jobs/") {
			n += c
		}
	}
	return n
}

// ExhaustRateLimit answers every REST call until then with 429.
func (s *Server) ExhaustRateLimit(until time.Time) {
	s.mu.Lock()
	s.limitTill = until
	s.mu.Unlock()
}

// RateLimited returns how many calls were answered 429.
func (s *Server) RateLimited() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limited
}

// SetDown makes every call, REST and runner, answer 503 while down.
func (s *Server) SetDown(down bool) {
	s.mu.Lock()
	s.down = down
	s.mu.Unlock()
}

// Deliveries returns the hook deliveries by the status code they were
// answered with (0: no answer).
func (s *Server) Deliveries() map[int]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.deliveries)
}

// ---- shared helpers ----

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	if v != nil {
		_ = json.NewEncoder(w).Encode(v)
	}
}

// fail answers GitLab's error shape, {"message": "404 Runner Not Found"}.
func fail(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]any{"message": fmt.Sprintf("%d %s", code, msg)})
}

// invalid answers a parameter error as Grape does: {"error": "..."}.
func invalid(w http.ResponseWriter, msg string) {
	writeJSON(w, http.StatusBadRequest, map[string]any{"error": msg})
}

// finish ends a job. Called with s.mu held.
func (s *Server) finish(j *Job, status, reason string) {
	j.Status, j.FailureReason = status, reason
	j.FinishedAt = time.Now().UTC()
	if j.StartedAt.IsZero() && status != "canceled" {
		j.StartedAt = j.FinishedAt
	}
}

// page slices a list by the page and per_page parameters and sets
// GitLab's pagination headers.
func page[T any](w http.ResponseWriter, r *http.Request, all []T) []T {
	per, _ := strconv.Atoi(r.URL.Query().Get("per_page"))
	if per <= 0 {
		per = 20
	}
	per = min(per, 100)
	n, _ := strconv.Atoi(r.URL.Query().Get("page"))
	n = max(n, 1)
	pages := max((len(all)+per-1)/per, 1)
	h := w.Header()
	h.Set("X-Page", strconv.Itoa(n))
	h.Set("X-Per-Page", strconv.Itoa(per))
	h.Set("X-Total", strconv.Itoa(len(all)))
	h.Set("X-Total-Pages", strconv.Itoa(pages))
	h.Set("X-Next-Page", "")
	if n < pages {
		h.Set("X-Next-Page", strconv.Itoa(n+1))
	}
	h.Set("X-Prev-Page", "")
	if n > 1 {
		h.Set("X-Prev-Page", strconv.Itoa(n-1))
	}
	lo := min((n-1)*per, len(all))
	return all[lo:min(lo+per, len(all))]
}
