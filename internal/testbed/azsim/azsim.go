// Package azsim stands in for Azure DevOps Services, following its REST
// API reference for agent pools, agents and job requests, and the Azure
// Pipelines agent's protocol as the agent's source
// (microsoft/azure-pipelines-agent) defines it. Neither Azure DevOps nor its
// .NET agent runs where runfleet is tested, so the azure-pipelines driver
// is tested against this, and ./agent stands in for the agent.
//
// The REST side, for the personal access token (basic auth), serves what
// Microsoft's Go client reads before any call (OPTIONS _apis with the
// resource locations, _apis/ResourceAreas), agent pools by name, agents
// (list with the includeCapabilities, includeAssignedRequest and demands
// filters; add, read, update, delete) and a pool's job requests, paged
// with X-MS-ContinuationToken. Every call needs an api-version the server
// takes (in the query or the Accept header); errors have Azure DevOps'
// shape ({"message": ..., "typeKey": "TaskAgentNotFoundException"}); a
// wrong token is 401. While throttled, calls are answered 429 with
// Retry-After, and every answer carries X-RateLimit-Remaining.
//
// The agent side follows the agent's own calls: the OAuth token request
// at the authorization URL AddAgent answered, authenticated by a JWT
// client assertion signed with the agent's RSA key (RS256; iss and sub the
// client id, aud the authorization URL); then, with the access token, a
// session per agent (one at a time: a second is 409), the long-polled
// message queue, a message's deletion, the job request's lock renewal and
// its completion, and the job's log (the task log API of the plan, with
// the job's own token). A job request goes to an online, enabled agent
// without a job whose capabilities meet its demands; a request whose lock
// is not renewed in time fails, and its agent is free again.
package azsim

import (
	"crypto/rand"
	"crypto/rsa"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/simserve"
)

// Options configures a Server.
type Options struct {
	// Org is the organisation's name: the REST API is at URL/<org>/.
	Org string
	// Token is the personal access token the REST API takes.
	Token string
	// Pools are the agent pools, by name (Default is always there).
	Pools []string
	// RunnerHost is the host agents reach the simulator at
	// (host.docker.internal for containers); the server then listens on
	// every address. 127.0.0.1 when empty.
	RunnerHost string
	// PageSize is how many job requests one answer holds before a
	// continuation token (100 when 0).
	PageSize int
	// LongPoll is how long a message request waits for a message (20s
	// when 0; the service waits 50s).
	LongPoll time.Duration
	// LockTimeout is how long a job request's lock lasts without
	// renewal before the job fails (10m when 0, as the service's).
	LockTimeout time.Duration
	// NoDemandsFilter answers 400 to a listing of agents filtered by
	// demands, as a server that does not take the filter would.
	NoDemandsFilter bool
	// APIVersion is the latest REST API version the server takes: 7.1
	// (Azure DevOps Services, Server 2022) when empty; 6.0 is Azure
	// DevOps Server 2020, 5.0 Server 2019 (learn.microsoft.com/rest/api/
	// azure/devops, "API and TFS version mapping"). Its resource
	// locations say so, and a request for a later version is refused.
	APIVersion string
}

// Agent is an agent in a pool.
type Agent struct {
	ID         int
	PoolID     int
	Name       string
	Version    string
	Enabled    bool
	Online     bool // a session is open
	UserCaps   map[string]string
	SystemCaps map[string]string // what its session reported
	ClientID   string
	PublicKey  *rsa.PublicKey
	Created    time.Time
	Request    int64 // the job request assigned, 0 for none
	// ShuttingDown is set when its last job's completion said the agent
	// stops after it (run --once): it gets no other job.
	ShuttingDown bool
	Deleted      bool
	// DeletedBusy is set when it was deleted with a job assigned: the
	// job was lost.
	DeletedBusy bool
	// Jobs counts the job requests it was given.
	Jobs int
}

// JobSpec is a job of a pipeline run to queue.
type JobSpec struct {
	Name    string
	Demands []string // as a pipeline's demands: "cuda", "gpu -equals a100"
	Script  string   // run by the agent with bash
}

// Request is a job request.
type Request struct {
	ID          int64
	PoolID      int
	BuildID     int
	PlanID      string
	JobID       string
	Name        string
	Demands     []string
	Script      string
	AgentID     int
	AgentName   string
	Queued      time.Time
	Assigned    time.Time
	Received    time.Time
	Finished    time.Time
	LockedUntil time.Time
	Started     bool   // its agent renewed its lock: it runs it
	Result      string // "", succeeded, failed, canceled, abandoned
	Log         []byte
	jobToken    string
}

type session struct {
	id       string
	agentID  int
	poolID   int
	owner    string
	messages []message
	wake     chan struct{}
	polled   time.Time
}

type message struct {
	ID   int64
	Type string
	Body string
}

type pool struct {
	ID   int
	Name string
}

// Call is one request the server answered.
type Call struct {
	Method, Route string // the route's template: /_apis/distributedtask/pools/{poolId}/agents
	APIVersion    string
	Status        int
	Agent         bool // made with an agent's access token (or a job's)
}

// Server is a running simulator.
type Server struct {
	URL       string // the organisation's URL as the manager uses it
	runnerURL string // the same as agents reach it
	opt       Options
	ts        *httptest.Server

	mu        sync.Mutex
	nextID    int
	nextReq   int64
	nextMsg   int64
	pools     map[int]*pool
	agents    map[int]*Agent
	requests  map[int64]*Request
	sessions  map[string]*session
	tokens    map[string]int // access token -> agent id
	calls     []Call
	throttle  int           // REST calls still to answer 429
	retry     time.Duration // their Retry-After
	delayed   int           // REST calls still to delay
	delay     time.Duration // by how long each
	limited   int
	down      bool
	stop      chan struct{}
	stopped   sync.WaitGroup
	lastBuild int
}

// New starts a simulator. Close it when done.
func New(opt Options) *Server {
	if opt.Org == "" {
		opt.Org = "acme"
	}
	if opt.PageSize <= 0 {
		opt.PageSize = 100
	}
	if opt.LongPoll <= 0 {
		opt.LongPoll = 20 * time.Second
	}
	if opt.APIVersion == "" {
		opt.APIVersion = "7.1"
	}
	if opt.LockTimeout <= 0 {
		// A job request's lockedUntil is ten minutes after it was
		// given or renewed, as in a response the service sent
		// (kedacore/keda, pkg/scalers/azure_pipelines_scaler_test.go).
		opt.LockTimeout = 10 * time.Minute
	}
	s := &Server{
		opt: opt, nextID: 0, nextReq: 100, lastBuild: 500,
		pools: map[int]*pool{}, agents: map[int]*Agent{}, requests: map[int64]*Request{},
		sessions: map[string]*session{}, tokens: map[string]int{}, stop: make(chan struct{}),
	}
	for _, name := range append([]string{"Default"}, opt.Pools...) {
		if s.poolByName(name) == nil {
			s.nextID++
			s.pools[s.nextID] = &pool{ID: s.nextID, Name: name}
		}
	}
	s.nextID = 10
	mux := http.NewServeMux()
	s.restRoutes(mux)
	s.agentRoutes(mux)
	s.ts, s.URL, s.runnerURL = simserve.New(mux, opt.RunnerHost)
	s.URL += "/" + opt.Org
	s.runnerURL += "/" + opt.Org
	s.ts.Start()
	s.stopped.Go(s.expireLocks)
	return s
}

// Close stops the server.
func (s *Server) Close() {
	close(s.stop)
	s.stopped.Wait()
	s.ts.CloseClientConnections()
	s.ts.Close()
}

// RunnerURL is the organisation's URL as agents reach it.
func (s *Server) RunnerURL() string { return s.runnerURL }

func (s *Server) poolByName(name string) *pool {
	for _, p := range s.pools {
		if strings.EqualFold(p.Name, name) {
			return p
		}
	}
	return nil
}

// PoolID returns a pool's id by its name, 0 when there is none.
func (s *Server) PoolID(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.poolByName(name); p != nil {
		return p.ID
	}
	return 0
}

func newGUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ---- test controls ----

// QueueRun queues a pipeline run's jobs in a pool, as a push does; each
// also demands an agent version, as the service adds to every job. It
// returns the requests' ids.
func (s *Server) QueueRun(poolName string, jobs ...JobSpec) ([]int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.poolByName(poolName)
	if p == nil {
		return nil, fmt.Errorf("azsim: no pool %q", poolName)
	}
	s.lastBuild++
	plan := newGUID()
	var ids []int64
	for _, j := range jobs {
		s.nextReq++
		r := &Request{
			ID: s.nextReq, PoolID: p.ID, BuildID: s.lastBuild, PlanID: plan, JobID: newGUID(),
			Name: j.Name, Script: j.Script, Queued: time.Now().UTC(),
			Demands: append(slices.Clone(j.Demands), "Agent.Version -gtVersion 2.163.1"),
		}
		s.requests[r.ID] = r
		ids = append(ids, r.ID)
		s.failUnmeetable(r)
	}
	s.assign()
	return ids, nil
}

// Requests returns every job request, by id.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Request
	for _, id := range slices.Sorted(maps.Keys(s.requests)) {
		r := *s.requests[id]
		r.Demands, r.Log = slices.Clone(r.Demands), slices.Clone(r.Log)
		out = append(out, r)
	}
	return out
}

// Agents returns the agents not deleted, by id.
func (s *Server) Agents() []Agent { return s.agentsWhere(func(a *Agent) bool { return !a.Deleted }) }

// AllAgents returns every agent ever added, deleted ones included.
func (s *Server) AllAgents() []Agent { return s.agentsWhere(func(*Agent) bool { return true }) }

func (s *Server) agentsWhere(keep func(*Agent) bool) []Agent {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Agent
	for _, id := range slices.Sorted(maps.Keys(s.agents)) {
		if a := s.agents[id]; keep(a) {
			c := *a
			c.UserCaps, c.SystemCaps = maps.Clone(a.UserCaps), maps.Clone(a.SystemCaps)
			out = append(out, c)
		}
	}
	return out
}

// Calls returns the requests answered, in order.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

// Throttle answers the next n REST calls with 429 and Retry-After.
func (s *Server) Throttle(n int, retryAfter time.Duration) {
	s.mu.Lock()
	s.throttle, s.retry = n, retryAfter
	s.mu.Unlock()
}

// Delay delays the next n REST calls by d each and answers them as the
// service answers a request it delayed for the global consumption limit:
// carried out, with X-RateLimit-Remaining 0 ("if requests are already
// being delayed or blocked, it's 0"), X-RateLimit-Delay (how long it was
// delayed, seconds with three decimals), X-RateLimit-Reset (when usage
// would be back to 0 if all of it stopped: minutes away) and no
// Retry-After, which the service sends only when the client must wait
// (learn.microsoft.com/azure/devops/integrate/concepts/rate-limits).
func (s *Server) Delay(n int, d time.Duration) {
	s.mu.Lock()
	s.delayed, s.delay = n, d
	s.mu.Unlock()
}

// Limited returns how many calls were answered 429.
func (s *Server) Limited() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limited
}

// SetDown makes every call, REST and agent, answer 503 while down.
func (s *Server) SetDown(down bool) {
	s.mu.Lock()
	s.down = down
	s.mu.Unlock()
}

// ---- shared helpers ----

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8; api-version=7.1")
	w.WriteHeader(code)
	if v != nil {
		_ = json.NewEncoder(w).Encode(v)
	}
}

// fail answers Azure DevOps' error shape: the message and the .NET
// exception's type key.
func fail(w http.ResponseWriter, code int, typeKey, msg string) {
	writeJSON(w, code, map[string]any{
		"$id": "1", "innerException": nil, "message": msg,
		"typeName": "Microsoft.TeamFoundation.DistributedTask.WebApi." + typeKey + ", Microsoft.TeamFoundation.DistributedTask.WebApi",
		"typeKey":  typeKey, "errorCode": 0, "eventId": 3000,
	})
}

// list answers a collection as the REST API does.
func list[T any](w http.ResponseWriter, items []T) {
	if items == nil {
		items = []T{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(items), "value": items})
}

func timeJSON(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z")
}

// RunScript is the stand-in's run.sh, as the agent's: it refuses root
// unless AGENT_ALLOW_RUNASROOT is set, finds its own directory through
// symbolic links, and runs bin/Agent.Listener there.
const RunScript = `#!/bin/sh
if [ "$(id -u)" = 0 ] && [ -z "$AGENT_ALLOW_RUNASROOT" ]; then
  echo "Must not run interactively with sudo"
  exit 1
fi
src=$0
while [ -h "$src" ]; do
  dir=$(cd -P "$(dirname "$src")" && pwd)
  src=$(readlink "$src")
  case $src in /*) ;; *) src=$dir/$src ;; esac
done
dir=$(cd -P "$(dirname "$src")" && pwd)
exec "$dir"/bin/Agent.Listener run "$@"
`

// Install lays out an agent installation in dir, unconfigured: run.sh and
// bin/Agent.Listener (the stand-in, copied from listener).
func Install(dir, listener string) error {
	b, err := os.ReadFile(listener)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "Agent.Listener"), b, 0o755); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "externals"), 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "run.sh"), []byte(RunScript), 0o755)
}

// Connect opens a session for an agent as its listener would, for tests
// that drive the REST side without an agent program.
func (s *Server) Connect(agentID int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agents[agentID]
	if !ok || a.Deleted {
		return fmt.Errorf("azsim: no agent %d", agentID)
	}
	if s.sessionOfAgent(a.ID) == nil {
		sess := &session{id: newGUID(), agentID: a.ID, poolID: a.PoolID, wake: make(chan struct{}), polled: time.Now().Add(time.Hour)}
		s.sessions[sess.id] = sess
	}
	a.Online = true
	s.assign()
	return nil
}

// Complete finishes a job request with a result, as its agent would.
func (s *Server) Complete(id int64, result string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	req, ok := s.requests[id]
	if !ok || req.Result != "" {
		return fmt.Errorf("azsim: no running request %d", id)
	}
	s.finishRequest(req, result, false)
	return nil
}
