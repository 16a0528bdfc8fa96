// Package bbsim stands in for Bitbucket Cloud's Pipelines and its runners.
// Neither runs where runfleet is tested, so the bitbucket driver is tested
// against this, and ./runner stands in for Bitbucket's runner.
//
// The manager's side follows two sources. The documented REST API 2.0:
// the workspace and the repository (for their uuids), a repository's
// pipelines (the status filter, sort, pagelen and page, answered with
// Bitbucket's paged shape: values, page, pagelen, size, next), a
// pipeline's steps, and a file at a commit (src); errors have Bitbucket's
// shape ({"type": "error", "error": {"message": ...}}); credentials are an
// access token (bearer) or a user and API token (basic), anything else
// 401; while throttled, calls are answered 429 with no Retry-After, as
// Bitbucket does. And the runner calls of Atlassian's runners-autoscaler,
// which Bitbucket does not document: under /internal, a workspace's or a
// repository's runners (pipelines-config/runners) listed with pagelen and
// next, created with a name and labels (lowercase letters, digits and
// dots, at most ten beside self.hosted and linux, which are added; 400
// otherwise) and answered with the runner's uuid and OAuth client, read,
// deleted, and disabled with PUT .../state {"status": "DISABLED"}; a
// runner's state is UNREGISTERED until it first connects, then ONLINE or
// OFFLINE, or DISABLED; it names the step the runner runs.
//
// Steps are assigned to runners by the server, as Bitbucket does: the
// runner's own log says it is "checking for new steps assigned to the
// runner ... every 30 seconds", and Bitbucket's runner docs describe a
// workspace queue from which each step goes to a compatible runner once
// one is available (support.atlassian.com/bitbucket-cloud/docs/runners).
// The oldest pending step whose runs-on labels a runner has goes to an
// enabled, online runner that holds no step, the moment one is there: when
// the step is queued, when a runner comes online or is enabled, and when
// its step ends, before anyone could disable it. The assignment shows at
// once in the runner's state.step (the autoscaler counts a runner with a
// step busy: runners-autoscaler autoscaler/strategy/pct_runners_idle.py);
// disabling a runner does not take its step back.
//
// The runner's own protocol is not published, and is this package's
// invention (under /runner-api): an OAuth client-credentials grant for the
// runner's client at /oauth/token; a heartbeat (PUT state ONLINE) that
// keeps it online; a request for the step assigned to it; the step's log
// and result. A runner that stops its heartbeat goes OFFLINE, and the step
// assigned to it fails, run or not. A runner deleted with a step loses
// the step.
package bbsim

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/simserve"
)

// Options configures a Server.
type Options struct {
	// Workspace is the workspace's slug ("acme" when empty).
	Workspace string
	// Repos are its repositories' slugs.
	Repos []string
	// Token is the access token the API takes as a bearer token.
	Token string
	// User and Password are taken with basic authentication (an
	// Atlassian account's email and API token); none when User is empty.
	User, Password string
	// RunnerHost is the host runners reach the simulator at
	// (host.docker.internal for containers); the server then listens on
	// every address. 127.0.0.1 when empty.
	RunnerHost string
	// PageLen is the default page length (10, as Bitbucket's).
	PageLen int
	// Heartbeat is how long a runner stays ONLINE without a heartbeat
	// (when 0, three of the runner's checks and at least 30s: 90s by
	// default; Bitbucket does not publish it).
	Heartbeat time.Duration
	// RunnerCheck is how often the stand-in runner checks for the step
	// assigned to it and says it is online: 30s when 0, as Bitbucket's
	// runner logs ("checking for new steps assigned to the runner after
	// 0 seconds and then every 30 seconds"). The simulator hands it to its
	// runner with the runner's access token.
	RunnerCheck time.Duration
	// StepSetup is how long the stand-in runner takes between taking a
	// step and running its script: Bitbucket's runner first starts the
	// step's build container and clones the repository (its log:
	// "Setting up step" ... "Cloning" ... "Executing step"), which takes
	// seconds on any machine; 2s when 0. A test's shorter setup is
	// harsher on the manager, which must disable the runner before the
	// step ends. Handed to the runner with its access token.
	StepSetup time.Duration
	// HourlyLimit, when set, is the access token's limit of calls to
	// /2.0/repositories/* over a rolling hour ("API request limits":
	// 1,000, scaled up to 10,000 for large workspaces). Those calls are
	// answered with Bitbucket's rate-limit headers, as Bitbucket answers
	// access tokens' calls to its scaled endpoints ("Introducing Scaled
	// Rate Limits for Bitbucket Cloud API", bitbucket.org/blog):
	// X-RateLimit-Limit, X-RateLimit-Resource ("api") and
	// X-RateLimit-NearLimit (true once less than 20% is left), and 429
	// past the limit.
	HourlyLimit int
	// Scopes are the manager's credential's scopes, in an API token's
	// words (read:repository:bitbucket, ...), each call checked against
	// them (scope.go); every scope when nil.
	Scopes []string
	// ErrorShape is where the runner limit's 400 puts its words, among
	// the places Bitbucket's standardized error object has for them
	// (developer.atlassian.com/cloud/bitbucket/rest/intro, "Standardized
	// error responses": a short error.message, and error.detail): "" or
	// "message" for the message, "detail" for the detail under a generic
	// message. Bitbucket does not publish which the limit uses.
	ErrorShape string
}

// Runner is a registered runner.
type Runner struct {
	UUID      string
	Scope     string // the repository's uuid, or "" for the workspace
	Name      string
	Labels    []string
	Enabled   bool
	Disabled  time.Time // when it was last disabled
	Connected bool      // it has connected once
	Seen      time.Time
	Step      string // the step it runs, "" for none
	ClientID  string
	Secret    string
	Created   time.Time
	Deleted   bool
	// DeletedBusy is set when it was deleted while it ran a step: the
	// step was lost.
	DeletedBusy bool
	// Steps counts the steps assigned to it; Ran those it fetched to
	// run.
	Steps, Ran int
}

// Online reports whether it connected and its heartbeat is current.
func (r *Runner) online(now time.Time, hb time.Duration) bool {
	return r.Connected && now.Sub(r.Seen) <= hb
}

// StepSpec is a step of a pipeline to run.
type StepSpec struct {
	Name   string
	RunsOn []string // labels; empty runs on Bitbucket's own machines
	Script string   // run by the runner with sh
}

// Step is a step of a pipeline.
type Step struct {
	UUID      string
	Pipeline  string
	Repo      string // the repository's slug
	Build     int64
	Commit    string // its pipeline's target: a re-run has the same
	Name      string
	RunsOn    []string
	Script    string
	State     string // PENDING, IN_PROGRESS, COMPLETED
	Result    string // SUCCESSFUL, FAILED, ERROR
	Runner    string // the runner's uuid, once assigned
	Queued    time.Time
	Assigned  time.Time
	Started   time.Time // when its runner fetched it
	Completed time.Time
	Log       []byte
}

type pipeline struct {
	UUID    string
	Repo    string
	Build   int64
	Commit  string
	Created time.Time
	Steps   []*Step
	specs   []StepSpec // to run it again
}

// Call is one request the server answered.
type Call struct {
	Method, Route string // the route's pattern: /2.0/workspaces/{workspace}
	Body          string // the request's body
	Status        int
	Runner        bool // made by a runner
}

// Server is a running simulator.
type Server struct {
	URL       string // the API as the manager reaches it
	runnerURL string
	opt       Options
	ts        *httptest.Server
	wsUUID    string
	repos     map[string]string // slug -> uuid

	mu            sync.Mutex
	runners       map[string]*Runner // by uuid
	pipelines     []*pipeline
	files         map[string]string // commit -> bitbucket-pipelines.yml
	tokens        map[string]string // runner access token -> runner uuid
	calls         []Call
	throttle      int
	limited       int
	hour          []time.Time // the rolling hour's limited calls
	scopeRefusals []string
	down          bool
	build         int64
	stop          chan struct{}
	stopped       sync.WaitGroup
}

// New starts a simulator. Close it when done.
func New(opt Options) *Server {
	if opt.Workspace == "" {
		opt.Workspace = "acme"
	}
	if opt.PageLen <= 0 {
		opt.PageLen = 10
	}
	if opt.StepSetup <= 0 {
		opt.StepSetup = 2 * time.Second
	}
	if opt.RunnerCheck <= 0 {
		opt.RunnerCheck = 30 * time.Second
	}
	if opt.Heartbeat <= 0 {
		opt.Heartbeat = max(3*opt.RunnerCheck, 30*time.Second)
	}
	s := &Server{opt: opt, wsUUID: newUUID(), repos: map[string]string{},
		runners: map[string]*Runner{}, files: map[string]string{}, tokens: map[string]string{}, stop: make(chan struct{})}
	for _, r := range opt.Repos {
		s.repos[r] = newUUID()
	}
	mux := http.NewServeMux()
	s.restRoutes(mux)
	s.runnerRoutes(mux)
	s.ts, s.URL, s.runnerURL = simserve.New(mux, opt.RunnerHost)
	s.ts.Start()
	s.stopped.Go(s.expire)
	return s
}

// Close stops the server.
func (s *Server) Close() {
	close(s.stop)
	s.stopped.Wait()
	s.ts.CloseClientConnections()
	s.ts.Close()
}

// RunnerURL is the API as runners reach it.
func (s *Server) RunnerURL() string { return s.runnerURL }

// WorkspaceUUID is the workspace's uuid, with its braces.
func (s *Server) WorkspaceUUID() string { return s.wsUUID }

// RepoUUID is a repository's uuid, with its braces.
func (s *Server) RepoUUID(slug string) string { return s.repos[slug] }

func newUUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return "{" + h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:] + "}"
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ---- test controls ----

// RunPipeline starts a pipeline in a repository, as a push does: its
// bitbucket-pipelines.yml at a new commit says each step's runs-on, and
// every step waits at once (a parallel group). It returns the steps'
// uuids.
func (s *Server) RunPipeline(repo string, steps ...StepSpec) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.repos[repo]; !ok {
		return nil, fmt.Errorf("bbsim: no repository %q", repo)
	}
	commit := randHex(20)
	s.files[commit] = pipelinesYML(steps)
	return s.start(repo, commit, steps), nil
}

// start starts a pipeline of steps at a commit. Called with s.mu held.
func (s *Server) start(repo, commit string, steps []StepSpec) []string {
	s.build++
	p := &pipeline{UUID: newUUID(), Repo: repo, Build: s.build, Commit: commit, Created: time.Now().UTC(), specs: slices.Clone(steps)}
	var ids []string
	for _, sp := range steps {
		st := &Step{UUID: newUUID(), Pipeline: p.UUID, Repo: repo, Build: p.Build, Commit: commit, Name: sp.Name,
			RunsOn: slices.Clone(sp.RunsOn), Script: sp.Script, State: "PENDING", Queued: time.Now().UTC()}
		p.Steps = append(p.Steps, st)
		ids = append(ids, st.UUID)
	}
	s.pipelines = append(s.pipelines, p)
	s.assign()
	return ids
}

// pipelinesYML is a bitbucket-pipelines.yml whose default pipeline is
// the steps, in one parallel group.
func pipelinesYML(steps []StepSpec) string {
	var yml strings.Builder
	yml.WriteString("image: atlassian/default-image:4\npipelines:\n  default:\n    - parallel:\n")
	for _, sp := range steps {
		fmt.Fprintf(&yml, "        - step:\n            name: %q\n", sp.Name)
		if len(sp.RunsOn) > 0 {
			yml.WriteString("            runs-on:\n")
			for _, l := range sp.RunsOn {
				fmt.Fprintf(&yml, "              - %s\n", l)
			}
		}
		yml.WriteString("            script:\n              - ./run.sh\n")
	}
	return yml.String()
}

// Steps returns every step, oldest first.
func (s *Server) Steps() []Step {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Step
	for _, p := range s.pipelines {
		for _, st := range p.Steps {
			c := *st
			c.RunsOn, c.Log = slices.Clone(st.RunsOn), slices.Clone(st.Log)
			out = append(out, c)
		}
	}
	return out
}

// Runners returns the runners not deleted, by creation.
func (s *Server) Runners() []Runner {
	return s.runnersWhere(func(r *Runner) bool { return !r.Deleted })
}

// AllRunners returns every runner ever created, deleted ones included.
func (s *Server) AllRunners() []Runner { return s.runnersWhere(func(*Runner) bool { return true }) }

func (s *Server) runnersWhere(keep func(*Runner) bool) []Runner {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Runner
	for _, r := range s.runners {
		if keep(r) {
			c := *r
			c.Labels = slices.Clone(r.Labels)
			out = append(out, c)
		}
	}
	slices.SortFunc(out, func(a, b Runner) int { return a.Created.Compare(b.Created) })
	return out
}

// Status is a runner's state.status as the API shows it.
func (s *Server) Status(r Runner) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status(&r, time.Now())
}

func (s *Server) status(r *Runner, now time.Time) string {
	switch {
	case !r.Enabled:
		return "DISABLED"
	case !r.Connected:
		return "UNREGISTERED"
	case r.online(now, s.opt.Heartbeat):
		return "ONLINE"
	}
	return "OFFLINE"
}

// Calls returns the requests answered, in order.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

// Throttle answers the next n manager calls with 429.
func (s *Server) Throttle(n int) {
	s.mu.Lock()
	s.throttle = n
	s.mu.Unlock()
}

// Limited returns how many calls were answered 429.
func (s *Server) Limited() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limited
}

// SetDown makes every call, the manager's and the runners', answer 503
// while down.
func (s *Server) SetDown(down bool) {
	s.mu.Lock()
	s.down = down
	s.mu.Unlock()
}

// Connect marks a runner connected and online, as its heartbeat would, for
// tests that drive the API without a runner program.
func (s *Server) Connect(uuid string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.runners[uuid]
	if !ok || r.Deleted {
		return fmt.Errorf("bbsim: no runner %s", uuid)
	}
	r.Connected, r.Seen = true, time.Now().Add(time.Hour)
	return nil
}

// Take fetches the step assigned to a runner, as its request would, and
// returns the step's uuid ("" for none).
func (s *Server) Take(uuid string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.assign()
	if st := s.fetch(s.runners[uuid]); st != nil {
		return st.UUID
	}
	return ""
}

// Offline marks a runner offline, as a runner that stops says: the step
// assigned to it fails.
func (s *Server) Offline(uuid string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.runners[uuid]
	if !ok || r.Deleted {
		return fmt.Errorf("bbsim: no runner %s", uuid)
	}
	r.Seen = time.Time{}
	s.lapse(time.Now())
	return nil
}

// Finish ends a step with a result, as its runner would.
func (s *Server) Finish(step, result string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.step(step)
	if st == nil || st.State != "IN_PROGRESS" {
		return fmt.Errorf("bbsim: no step %s in progress", step)
	}
	s.finish(st, result)
	return nil
}

// ---- shared ----

func (s *Server) step(uuid string) *Step {
	for _, p := range s.pipelines {
		for _, st := range p.Steps {
			if st.UUID == uuid {
				return st
			}
		}
	}
	return nil
}

// assign gives each pending step, oldest first, to an enabled, online
// runner of its scope that holds no step and has its runs-on labels, the
// oldest such runner first. Called with s.mu held.
func (s *Server) assign() {
	now := time.Now()
	var free []*Runner
	for _, r := range s.runners {
		if !r.Deleted && r.Enabled && r.Step == "" && r.online(now, s.opt.Heartbeat) {
			free = append(free, r)
		}
	}
	if len(free) == 0 {
		return
	}
	slices.SortFunc(free, func(a, b *Runner) int { return a.Created.Compare(b.Created) })
	for _, p := range s.pipelines {
		for _, st := range p.Steps {
			if st.State != "PENDING" || len(st.RunsOn) == 0 {
				continue
			}
			i := slices.IndexFunc(free, func(r *Runner) bool {
				return (r.Scope == "" || s.repos[st.Repo] == r.Scope) && hasAll(r.Labels, st.RunsOn)
			})
			if i < 0 {
				continue
			}
			r := free[i]
			free = slices.Delete(free, i, i+1)
			st.State, st.Runner, st.Assigned = "IN_PROGRESS", r.UUID, now.UTC()
			r.Step = st.UUID
			r.Steps++
			if len(free) == 0 {
				return
			}
		}
	}
}

// fetch hands a runner the step assigned to it, noting when it first did.
// Called with s.mu held.
func (s *Server) fetch(r *Runner) *Step {
	if r == nil || r.Deleted || r.Step == "" {
		return nil
	}
	st := s.step(r.Step)
	if st != nil && st.Started.IsZero() {
		st.Started = time.Now().UTC()
		r.Ran++
	}
	return st
}

func hasAll(have, want []string) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

// finish completes a step and frees its runner, which may be given the
// next step at once. Called with s.mu held.
func (s *Server) finish(st *Step, result string) {
	st.State, st.Result, st.Completed = "COMPLETED", result, time.Now().UTC()
	if r, ok := s.runners[st.Runner]; ok && r.Step == st.UUID {
		r.Step = ""
	}
	s.assign()
}

// lapse fails the steps of runners whose heartbeat stopped. Called with
// s.mu held.
func (s *Server) lapse(now time.Time) {
	for _, r := range s.runners {
		if r.Step != "" && !r.online(now, s.opt.Heartbeat) {
			if st := s.step(r.Step); st != nil {
				st.Log = append(st.Log, "The runner went offline with the step assigned to it.\n"...)
				s.finish(st, "ERROR")
			}
		}
	}
}

// expire fails the steps of runners whose heartbeat stopped, and assigns
// the steps that wait to runners that came free.
func (s *Server) expire() {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.mu.Lock()
		s.lapse(time.Now())
		s.assign()
		s.mu.Unlock()
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	if v != nil {
		_ = json.NewEncoder(w).Encode(v)
	}
}

// fail answers Bitbucket's error shape.
func fail(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]any{"type": "error", "error": map[string]any{"message": msg}})
}

func timeJSON(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UTC().Format("2006-01-02T15:04:05.000000Z")
}

// sortedRunners returns the runners of a scope, oldest first. Called with
// s.mu held.
func (s *Server) sortedRunners(scope string) []*Runner {
	var out []*Runner
	for _, r := range s.runners {
		if !r.Deleted && r.Scope == scope {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b *Runner) int { return a.Created.Compare(b.Created) })
	return out
}
