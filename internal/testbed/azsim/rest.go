package azsim

import (
	"crypto/rsa"
	"crypto/subtle"
	"encoding/base64"
	"fmt"
	"maps"
	"math/big"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Resource locations, as the service lists them at OPTIONS _apis; the
// ids are those of Microsoft's clients (the Go client's taskagent and
// location packages, the agent's TaskAgentHttpClient).
var locations = []map[string]any{
	location("e81700f7-3be2-46de-8624-2eb35882fcaa", "Location", "ResourceAreas", "_apis/{resource}/{areaId}", "0.0"),
	location("a8c47e17-4d56-4a56-92bb-de7ea7dc65be", "distributedtask", "pools", "_apis/{area}/{resource}/{poolId}", "7.1"),
	location("e298ef32-5878-4cab-993c-043836571f42", "distributedtask", "agents", "_apis/{area}/pools/{poolId}/{resource}/{agentId}", "7.1"),
	location("fc825784-c92a-4299-9221-998a02d1b54f", "distributedtask", "jobrequests", "_apis/{area}/pools/{poolId}/{resource}/{requestId}", "0.0"),
	location("c3a054f6-7a8a-49c0-944e-3a8e5d7adfd7", "distributedtask", "messages", "_apis/{area}/pools/{poolId}/{resource}/{messageId}", "0.0"),
	location("134e239e-2df3-4794-a6f6-24f1f19ec8dc", "distributedtask", "sessions", "_apis/{area}/pools/{poolId}/{resource}/{sessionId}", "0.0"),
}

func location(id, area, resource, route, released string) map[string]any {
	return map[string]any{
		"id": id, "area": area, "resourceName": resource, "routeTemplate": route,
		"resourceVersion": 1, "minVersion": "3.0", "maxVersion": "7.1", "releasedVersion": released,
	}
}

// locationsUpTo are the resource locations of a server whose REST API goes
// up to version max: no resource's versions go beyond it.
func locationsUpTo(max string) []map[string]any {
	out := make([]map[string]any, len(locations))
	for i, l := range locations {
		c := maps.Clone(l)
		if versionLess(max, c["maxVersion"].(string)) {
			c["maxVersion"] = max
		}
		if versionLess(max, c["releasedVersion"].(string)) {
			c["releasedVersion"] = max
		}
		out[i] = c
	}
	return out
}

// taskAgentArea is the resource area of pools, agents and job requests.
const taskAgentArea = "a85b8835-c1a1-4aac-ae97-1c3d0ba72dbd"

func (s *Server) restRoutes(mux *http.ServeMux) {
	o := "/" + s.opt.Org
	rest, unversioned := route{pat: true, versioned: true}, route{pat: true}
	s.handle(mux, "OPTIONS "+o+"/_apis", unversioned, s.options)
	s.handle(mux, "GET "+o+"/_apis/ResourceAreas", rest, s.resourceAreas)
	s.handle(mux, "GET "+o+"/_apis/distributedtask/pools", rest, s.listPools)
	s.handle(mux, "GET "+o+"/_apis/distributedtask/pools/{poolId}/agents", rest, s.listAgents)
	s.handle(mux, "POST "+o+"/_apis/distributedtask/pools/{poolId}/agents", rest, s.addAgent)
	s.handle(mux, "GET "+o+"/_apis/distributedtask/pools/{poolId}/agents/{agentId}", rest, s.getAgent)
	s.handle(mux, "PATCH "+o+"/_apis/distributedtask/pools/{poolId}/agents/{agentId}", rest, s.updateAgent)
	s.handle(mux, "DELETE "+o+"/_apis/distributedtask/pools/{poolId}/agents/{agentId}", rest, s.deleteAgent)
	s.handle(mux, "GET "+o+"/_apis/distributedtask/pools/{poolId}/jobrequests", rest, s.listRequests)
}

// route is how a route is served: REST calls take the PAT and count
// against the throttle; the agents' calls authenticate in their handlers.
type route struct {
	pat       bool // the REST API, for the personal access token
	versioned bool // an api-version is required
}

// handle wraps a handler: the call log, an outage, the PAT and the
// throttle of REST calls, the api-version.
func (s *Server) handle(mux *http.ServeMux, pattern string, rt route, h http.HandlerFunc) {
	method, path, _ := strings.Cut(pattern, " ")
	path = strings.TrimPrefix(path, "/"+s.opt.Org)
	mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w, code: http.StatusOK}
		call := Call{Method: method, Route: path, Agent: !rt.pat}
		defer func() {
			call.Status = rec.code
			s.mu.Lock()
			s.calls = append(s.calls, call)
			s.mu.Unlock()
		}()
		s.mu.Lock()
		down, throttled := s.down, rt.pat && s.throttle > 0
		if throttled {
			s.throttle--
			s.limited++
		}
		delayed := rt.pat && !throttled && s.delayed > 0
		if delayed {
			s.delayed--
		}
		retry, delay := s.retry, s.delay
		s.mu.Unlock()
		switch {
		case down:
			http.Error(rec, "Service Unavailable", http.StatusServiceUnavailable)
			return
		case rt.pat && !s.patOK(r):
			// The service answers a missing or wrong PAT with 401 and
			// a sign-in challenge.
			rec.Header().Set("WWW-Authenticate", `Basic realm="https://dev.azure.com/"`)
			http.Error(rec, "Unauthorized", http.StatusUnauthorized)
			return
		case throttled:
			rec.Header().Set("Retry-After", strconv.Itoa(int(max(retry.Seconds(), 1))))
			rec.Header().Set("X-RateLimit-Resource", "ATCPU")
			rec.Header().Set("X-RateLimit-Remaining", "0")
			rec.Header().Set("X-RateLimit-Reset", strconv.FormatInt(time.Now().Add(retry).Unix(), 10))
			fail(rec, http.StatusTooManyRequests, "VssRequestThrottledException", "TF400733: The request has been blocked due to exceeding usage of resource 'ATCPU'.")
			return
		case delayed:
			time.Sleep(delay)
			rec.Header().Set("X-RateLimit-Resource", "ATCPU")
			rec.Header().Set("X-RateLimit-Limit", "200")
			rec.Header().Set("X-RateLimit-Remaining", "0")
			rec.Header().Set("X-RateLimit-Delay", strconv.FormatFloat(delay.Seconds(), 'f', 3, 64))
			rec.Header().Set("X-RateLimit-Reset", strconv.FormatInt(time.Now().Add(5*time.Minute).Unix(), 10))
		case rt.pat:
			rec.Header().Set("X-RateLimit-Remaining", "190")
		}
		if rt.versioned {
			v, ok := s.checkVersion(rec, r)
			if !ok {
				return
			}
			call.APIVersion = v
		}
		h(rec, r)
	})
}

type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.code = code
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// patOK checks basic auth with the PAT as the password (any user name),
// as the service takes a personal access token.
func (s *Server) patOK(r *http.Request) bool {
	_, pass, ok := r.BasicAuth()
	return ok && subtle.ConstantTimeCompare([]byte(pass), []byte(s.opt.Token)) == 1
}

var versionRE = regexp.MustCompile(`^(\d+)\.(\d+)(-preview(\.(\d+))?)?$`)

// checkVersion reads the api-version from the query or the Accept header
// and answers 400 as the service does when it is missing or out of range.
func (s *Server) checkVersion(w http.ResponseWriter, r *http.Request) (string, bool) {
	v := r.URL.Query().Get("api-version")
	if v == "" {
		for part := range strings.SplitSeq(r.Header.Get("Accept"), ";") {
			if k, val, ok := strings.Cut(strings.TrimSpace(part), "="); ok && strings.EqualFold(k, "api-version") {
				v = val
			}
		}
	}
	if v == "" {
		fail(w, http.StatusBadRequest, "VssVersionNotSpecifiedException",
			fmt.Sprintf(`No api-version was supplied for the "%s" request. The version must be supplied either as part of the Accept header (e.g. "application/json; api-version=1.0") or as a query parameter (e.g. '?api-version=1.0').`, r.Method))
		return "", false
	}
	m := versionRE.FindStringSubmatch(v)
	if m == nil {
		fail(w, http.StatusBadRequest, "VssInvalidApiVersionException", fmt.Sprintf("The api-version '%s' is not a valid version.", v))
		return "", false
	}
	major, _ := strconv.Atoi(m[1])
	if versionLess(s.opt.APIVersion, m[1]+"."+m[2]) || major < 1 {
		fail(w, http.StatusBadRequest, "VssVersionOutOfRangeException",
			fmt.Sprintf("The requested REST API version of %s is out of range for this server. The latest REST API version for this server is %s.", v, s.opt.APIVersion))
		return "", false
	}
	return v, true
}

func (s *Server) options(w http.ResponseWriter, r *http.Request) {
	list(w, locationsUpTo(s.opt.APIVersion))
}

func (s *Server) resourceAreas(w http.ResponseWriter, r *http.Request) {
	list(w, []map[string]any{{"id": taskAgentArea, "name": "distributedtask", "locationUrl": s.URL + "/"}})
}

func (s *Server) listPools(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("poolName")
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, id := range slices.Sorted(maps.Keys(s.pools)) {
		p := s.pools[id]
		if name == "" || strings.EqualFold(p.Name, name) {
			out = append(out, map[string]any{"id": p.ID, "name": p.Name, "isHosted": false, "poolType": "automation", "size": s.poolSize(p.ID)})
		}
	}
	list(w, out)
}

func (s *Server) poolSize(id int) int {
	n := 0
	for _, a := range s.agents {
		if a.PoolID == id && !a.Deleted {
			n++
		}
	}
	return n
}

// poolOf reads the {poolId} of a route; it answers 404 itself.
func (s *Server) poolOf(w http.ResponseWriter, r *http.Request) (int, bool) {
	id, err := strconv.Atoi(r.PathValue("poolId"))
	if err == nil {
		if _, ok := s.pools[id]; ok {
			return id, true
		}
	}
	fail(w, http.StatusNotFound, "TaskAgentPoolNotFoundException", fmt.Sprintf("Agent pool %s could not be found.", r.PathValue("poolId")))
	return 0, false
}

// agentOf reads the {agentId} of a route in its pool; it answers 404
// itself.
func (s *Server) agentOf(w http.ResponseWriter, r *http.Request) (*Agent, bool) {
	pid, ok := s.poolOf(w, r)
	if !ok {
		return nil, false
	}
	id, err := strconv.Atoi(r.PathValue("agentId"))
	if a, ok := s.agents[id]; err == nil && ok && !a.Deleted && a.PoolID == pid {
		return a, true
	}
	fail(w, http.StatusNotFound, "TaskAgentNotFoundException", fmt.Sprintf("No agent found in pool %d having ID %s.", pid, r.PathValue("agentId")))
	return nil, false
}

func boolParam(r *http.Request, name string) bool {
	b, _ := strconv.ParseBool(r.URL.Query().Get(name))
	return b
}

func (s *Server) listAgents(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pid, ok := s.poolOf(w, r)
	if !ok {
		return
	}
	var demands []string
	if d := r.URL.Query().Get("demands"); d != "" {
		if s.opt.NoDemandsFilter {
			fail(w, http.StatusBadRequest, "ArgumentException", "The parameter demands is not supported.")
			return
		}
		demands = strings.Split(d, ",")
	}
	name := r.URL.Query().Get("agentName")
	var out []map[string]any
	for _, id := range slices.Sorted(maps.Keys(s.agents)) {
		a := s.agents[id]
		if a.Deleted || a.PoolID != pid || name != "" && !strings.EqualFold(a.Name, name) {
			continue
		}
		if !meets(a.capabilities(), demands) {
			continue
		}
		out = append(out, s.agentJSON(a, boolParam(r, "includeCapabilities"), boolParam(r, "includeAssignedRequest")))
	}
	list(w, out)
}

// capabilities are an agent's system and user capabilities together.
func (a *Agent) capabilities() map[string]string {
	caps := map[string]string{"Agent.Name": a.Name, "Agent.Version": a.Version}
	for k, v := range a.SystemCaps {
		caps[k] = v
	}
	for k, v := range a.UserCaps {
		caps[k] = v
	}
	return caps
}

// agentJSON is an agent as the REST API answers it. Called with s.mu held.
func (s *Server) agentJSON(a *Agent, caps, assigned bool) map[string]any {
	status := "offline"
	if a.Online {
		status = "online"
	}
	out := map[string]any{
		"id": a.ID, "name": a.Name, "version": a.Version, "enabled": a.Enabled, "status": status,
		"provisioningState": "Provisioned", "maxParallelism": 1, "createdOn": timeJSON(a.Created),
		"accessPoint": "CodexAccessMapping", "osDescription": a.SystemCaps["Agent.OSDescription"],
		"authorization": map[string]any{"clientId": a.ClientID, "publicKey": publicKeyJSON(a.PublicKey)},
		"_links":        map[string]any{"self": map[string]any{"href": fmt.Sprintf("%s/_apis/distributedtask/pools/%d/agents/%d", s.URL, a.PoolID, a.ID)}},
	}
	if caps {
		out["userCapabilities"] = a.UserCaps
		out["systemCapabilities"] = a.SystemCaps
	}
	if assigned && a.Request != 0 {
		if req, ok := s.requests[a.Request]; ok {
			out["assignedRequest"] = s.requestJSON(req)
		}
	}
	return out
}

func publicKeyJSON(k *rsa.PublicKey) any {
	if k == nil {
		return nil
	}
	return map[string]any{"exponent": big.NewInt(int64(k.E)).Bytes(), "modulus": k.N.Bytes()}
}

// agentBody is what AddAgent and UpdateAgent take.
type agentBody struct {
	ID                *int              `json:"id"`
	Name              string            `json:"name"`
	Version           string            `json:"version"`
	Enabled           *bool             `json:"enabled"`
	MaxParallelism    *int              `json:"maxParallelism"`
	ProvisioningState string            `json:"provisioningState"`
	UserCapabilities  map[string]string `json:"userCapabilities"`
	// SystemCapabilities are what the agent's configuration scanned
	// (AgentCapabilitiesProvider, NixCapabilitiesProvider): its session
	// reports them again at each start.
	SystemCapabilities map[string]string `json:"systemCapabilities"`
	Authorization      *struct {
		PublicKey *struct {
			Exponent []byte `json:"exponent"`
			Modulus  []byte `json:"modulus"`
		} `json:"publicKey"`
	} `json:"authorization"`
}

func (s *Server) addAgent(w http.ResponseWriter, r *http.Request) {
	var b agentBody
	if !decode(w, r, "TaskAgent", &b) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	pid, ok := s.poolOf(w, r)
	if !ok {
		return
	}
	if strings.TrimSpace(b.Name) == "" {
		fail(w, http.StatusBadRequest, "ArgumentNullException", "Value cannot be null.\r\nParameter name: agent.Name")
		return
	}
	for _, a := range s.agents {
		if !a.Deleted && a.PoolID == pid && strings.EqualFold(a.Name, b.Name) {
			fail(w, http.StatusConflict, "TaskAgentExistsException", fmt.Sprintf("An agent named %s already exists in the pool %s.", b.Name, s.pools[pid].Name))
			return
		}
	}
	if b.MaxParallelism != nil && *b.MaxParallelism != 1 {
		fail(w, http.StatusBadRequest, "ArgumentException", "maxParallelism: agents run one job at a time")
		return
	}
	for k, v := range b.UserCapabilities {
		if strings.TrimSpace(k) == "" || strings.ContainsAny(k, " ,") || v == "" {
			fail(w, http.StatusBadRequest, "ArgumentException", fmt.Sprintf("The capability %q=%q is not valid: a name without spaces or commas, and a value.", k, v))
			return
		}
	}
	s.nextID++
	a := &Agent{ID: s.nextID, PoolID: pid, Name: b.Name, Version: b.Version, Enabled: b.Enabled == nil || *b.Enabled,
		UserCaps: b.UserCapabilities, SystemCaps: maps.Clone(b.SystemCapabilities), Created: time.Now().UTC()}
	if a.SystemCaps == nil {
		a.SystemCaps = map[string]string{}
	}
	if a.UserCaps == nil {
		a.UserCaps = map[string]string{}
	}
	out := s.agentJSON(a, true, false)
	if b.Authorization != nil && b.Authorization.PublicKey != nil && len(b.Authorization.PublicKey.Modulus) > 0 {
		a.PublicKey = &rsa.PublicKey{N: new(big.Int).SetBytes(b.Authorization.PublicKey.Modulus), E: int(new(big.Int).SetBytes(b.Authorization.PublicKey.Exponent).Int64())}
		a.ClientID = newGUID()
		out = s.agentJSON(a, true, false)
		out["authorization"] = map[string]any{
			"clientId": a.ClientID, "authorizationUrl": s.URL + "/_apis/oauth2/token",
			"publicKey": publicKeyJSON(a.PublicKey),
		}
	} else {
		delete(out, "authorization") // an agent that authenticates with a PAT, as servers before TFS 2017 had
	}
	out["properties"] = map[string]any{"ServerUrl": map[string]any{"$type": "System.String", "$value": s.URL + "/"}}
	s.agents[a.ID] = a
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) getAgent(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOf(w, r)
	if !ok {
		return
	}
	writeJSON(w, http.StatusOK, s.agentJSON(a, boolParam(r, "includeCapabilities"), boolParam(r, "includeAssignedRequest")))
}

// updateAgent changes what the body sets: enabled, user capabilities.
func (s *Server) updateAgent(w http.ResponseWriter, r *http.Request) {
	var b agentBody
	if !decode(w, r, "TaskAgent", &b) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOf(w, r)
	if !ok {
		return
	}
	if b.ID != nil && *b.ID != a.ID {
		fail(w, http.StatusBadRequest, "ArgumentException", fmt.Sprintf("The agent id %d in the body does not match %d.", *b.ID, a.ID))
		return
	}
	if b.Enabled != nil {
		a.Enabled = *b.Enabled
	}
	if b.UserCapabilities != nil {
		a.UserCaps = b.UserCapabilities
		s.failUnmeetableAll()
	}
	if a.Enabled {
		s.assign()
	}
	writeJSON(w, http.StatusOK, s.agentJSON(a, true, false))
}

// deleteAgent removes an agent. One with a job loses it: the job is
// abandoned, as when an agent is deleted from the pool's page.
func (s *Server) deleteAgent(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOf(w, r)
	if !ok {
		return
	}
	a.Deleted, a.Online = true, false
	if req, ok := s.requests[a.Request]; ok && req.Result == "" {
		a.DeletedBusy = true
		s.finishRequest(req, "abandoned", false)
	}
	if sess := s.sessionOfAgent(a.ID); sess != nil {
		s.offline(sess)
	}
	for tok, id := range s.tokens {
		if id == a.ID {
			delete(s.tokens, tok)
		}
	}
	s.failUnmeetableAll()
	w.WriteHeader(http.StatusNoContent)
}

// listRequests lists a pool's job requests, the unfinished ones alone with
// completedRequestCount=0, a page at a time with X-MS-ContinuationToken.
func (s *Server) listRequests(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pid, ok := s.poolOf(w, r)
	if !ok {
		return
	}
	unfinished := r.URL.Query().Get("completedRequestCount") == "0"
	after := int64(0)
	if t := r.URL.Query().Get("continuationToken"); t != "" {
		b, err := base64.RawURLEncoding.DecodeString(t)
		if err == nil {
			after, err = strconv.ParseInt(string(b), 10, 64)
		}
		if err != nil {
			fail(w, http.StatusBadRequest, "InvalidContinuationTokenException", "The continuation token is not valid.")
			return
		}
	}
	var out []map[string]any
	var last int64
	for _, id := range slices.Sorted(maps.Keys(s.requests)) {
		req := s.requests[id]
		if req.PoolID != pid || id <= after || unfinished && req.Result != "" {
			continue
		}
		if len(out) == s.opt.PageSize {
			w.Header().Set("X-MS-ContinuationToken", base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(last, 10))))
			break
		}
		out = append(out, s.requestJSON(req))
		last = id
	}
	list(w, out)
}

// requestJSON is a job request as the REST API answers it. Called with
// s.mu held.
func (s *Server) requestJSON(req *Request) map[string]any {
	out := map[string]any{
		"requestId": req.ID, "poolId": req.PoolID, "queueTime": timeJSON(req.Queued),
		"assignTime": timeJSON(req.Assigned), "receiveTime": timeJSON(req.Received), "finishTime": timeJSON(req.Finished),
		"lockedUntil": timeJSON(req.LockedUntil), "planType": "Build", "planId": req.PlanID, "jobId": req.JobID,
		"jobName": req.Name, "demands": req.Demands, "serviceOwner": "00025394-6065-48ca-87d9-7f5672854ef7",
		"hostId":     "9a8b7c6d-0000-4000-8000-000000000001",
		"definition": map[string]any{"id": 7, "name": "ci"},
		"owner":      map[string]any{"id": req.BuildID, "name": fmt.Sprintf("20261125.%d", req.BuildID)},
	}
	if req.Result != "" {
		out["result"] = req.Result
	}
	if req.AgentID != 0 {
		out["reservedAgent"] = map[string]any{"id": req.AgentID, "name": req.AgentName}
	}
	return out
}
