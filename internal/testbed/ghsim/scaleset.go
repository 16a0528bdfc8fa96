package ghsim

// The runner scale set side of the simulator: the Actions service that
// github.com/actions/scaleset talks to, following that client's types and
// GitHub's documentation of scale sets.
//
//   - POST /api/v3/actions/runner-registration, with "RemoteAuth <a
//     registration token>", answers the service's URL and an admin token
//     (a JWT that expires).
//   - Under that URL (/_services/pipelines/): runner groups by name; scale
//     sets (list by group and name, create, get, delete); message sessions
//     (create, 409 while another lives, refresh, delete); acquirejobs;
//     generatejitconfig (409 AgentExistsException for a name in use); and
//     agents (get by name or id, delete: 404 AgentNotFoundException, 400
//     JobStillRunningException).
//   - The message queue (/_msgqueue/<session>): a long poll that answers
//     202 when nothing came, or 200 with one message batching up to 50
//     events (JobAvailable, JobAssigned, JobStarted, JobCompleted) and the
//     scale set's statistics; the message is redelivered until it is
//     deleted or a later lastMessageId acknowledges it. The poll must
//     carry X-ScaleSetMaxCapacity: no more jobs are acquired than that.
//
// A job is for a scale set when its runs-on names the scale set (and its
// other labels are the scale set's or self-hosted). It is offered
// (JobAvailable) to the set's session, acquired by the session, then
// taken only by the set's own runners. A session not polled for
// SessionTimeout is dropped; a new one gets the jobs still available.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v4"
)

const servicePath = "/_services/pipelines"

type scaleState struct {
	regTokens   map[string]string // registration token -> scope
	adminTokens map[string]adminToken
	admins      int // admin tokens issued
	adminLate   int // service calls refused for an expired admin token
	sets        map[int]*scaleSet
	nextSet     int
	maxSeen     []int // X-ScaleSetMaxCapacity of every poll
	sessions    int   // sessions created
	expired     int   // queue calls refused for an expired token
	failAcquire int   // acquire calls still to fail with a 500
}

// adminToken is what an admin token is for, and until when.
type adminToken struct {
	scope string
	exp   time.Time
}

func (st *scaleState) remember(tok, scope string) {
	if st.regTokens == nil {
		st.regTokens = map[string]string{}
	}
	st.regTokens[tok] = scope
}

type scaleSet struct {
	ID     int
	Name   string
	Group  int
	Scope  string
	Labels []string
	sess   *session
	// capacity is the X-ScaleSetMaxCapacity of the last poll: no more
	// jobs are acquired than that.
	capacity int
}

type session struct {
	id          string
	owner       string
	token       string
	issued      time.Time // of the token
	lastPoll    time.Time
	pending     []map[string]any // events not yet in a message
	outstanding *outMessage      // delivered, not yet acknowledged
	nextMsg     int
	wake        chan struct{}
}

type outMessage struct {
	id     int
	events []map[string]any
}

// ScaleSetInfo is a scale set as a test sees it.
type ScaleSetInfo struct {
	ID      int
	Name    string
	Session bool // a message session holds it
}

// ScaleSets returns the scale sets, with whether a session holds each.
func (s *Server) ScaleSets() []ScaleSetInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireSessions()
	var out []ScaleSetInfo
	for _, set := range s.scale.sets {
		out = append(out, ScaleSetInfo{ID: set.ID, Name: set.Name, Session: set.sess != nil})
	}
	slices.SortFunc(out, func(a, b ScaleSetInfo) int { return a.ID - b.ID })
	return out
}

// ExpiredTokenCalls counts the message queue calls refused because their
// token had expired.
func (s *Server) ExpiredTokenCalls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.scale.expired
}

// Sessions returns how many message sessions were created in all.
func (s *Server) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.scale.sessions
}

// MaxCapacities returns the X-ScaleSetMaxCapacity of every message poll.
func (s *Server) MaxCapacities() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.scale.maxSeen)
}

func (s *Server) scaleSetRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /api/v3/actions/runner-registration", s.count("POST /api/v3/actions/runner-registration", s.runnerRegistration))
	svc := func(pattern string, h http.HandlerFunc) {
		method, path, _ := strings.Cut(pattern, " ")
		full := method + " " + servicePath + path
		mux.HandleFunc(full, s.count(full, s.admin(h)))
	}
	svc("GET /_apis/runtime/runnergroups/", s.runnerGroups)
	svc("GET /_apis/runtime/runnerscalesets", s.listScaleSets)
	svc("POST /_apis/runtime/runnerscalesets", s.createScaleSet)
	svc("GET /_apis/runtime/runnerscalesets/{id}", s.getScaleSet)
	svc("DELETE /_apis/runtime/runnerscalesets/{id}", s.deleteScaleSet)
	svc("POST /_apis/runtime/runnerscalesets/{id}/sessions", s.createSession)
	svc("PATCH /_apis/runtime/runnerscalesets/{id}/sessions/{sid}", s.refreshSession)
	svc("DELETE /_apis/runtime/runnerscalesets/{id}/sessions/{sid}", s.deleteSession)
	svc("POST /_apis/runtime/runnerscalesets/{id}/generatejitconfig", s.scaleSetJIT)
	svc("GET /_apis/distributedtask/pools/0/agents", s.agentByName)
	svc("GET /_apis/distributedtask/pools/0/agents/{id}", s.agentByID)
	svc("DELETE /_apis/distributedtask/pools/0/agents/{id}", s.deleteAgent)
	// acquirejobs takes the session's message queue token.
	mux.HandleFunc("POST "+servicePath+"/_apis/runtime/runnerscalesets/{id}/acquirejobs", s.count("POST /_apis/runtime/runnerscalesets/{id}/acquirejobs", s.acquireJobs))
	mux.HandleFunc("GET /_msgqueue/{sid}", s.count("GET /_msgqueue/{sid}", s.getMessage))
	mux.HandleFunc("DELETE /_msgqueue/{sid}/{mid}", s.count("DELETE /_msgqueue/{sid}/{mid}", s.deleteMessage))
}

// count counts a call of the Actions service by its pattern.
func (s *Server) count(pattern string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.calls[pattern]++
		s.mu.Unlock()
		h(w, r)
	}
}

// exception answers as the Actions service does: a typeName and message.
func exception(w http.ResponseWriter, code int, typeName, msg string) {
	writeJSON(w, code, map[string]any{"typeName": "GitHub.DistributedTask.WebApi." + typeName, "message": msg})
}

func (s *Server) runnerRegistration(w http.ResponseWriter, r *http.Request) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "RemoteAuth ")
	s.mu.Lock()
	scope, known := s.scale.regTokens[tok]
	s.mu.Unlock()
	if !ok || !known {
		fail(w, http.StatusUnauthorized, "Bad credentials", "")
		return
	}
	exp := time.Now().Add(s.opt.AdminTokenLifetime)
	admin, err := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.RegisteredClaims{ExpiresAt: jwt.NewNumericDate(exp), Subject: scope}).SignedString([]byte("ghsim"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	s.mu.Lock()
	if s.scale.adminTokens == nil {
		s.scale.adminTokens = map[string]adminToken{}
	}
	s.scale.adminTokens[admin] = adminToken{scope, exp}
	s.scale.admins++
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"url": s.URL + servicePath + "/", "token": admin})
}

// admin checks the service's admin token: known, and not expired (its
// JWT's exp; the token is a bearer token the service checks as such).
func (s *Server) admin(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		s.mu.Lock()
		at, ok := s.scale.adminTokens[tok]
		late := ok && !time.Now().Before(at.exp)
		if late {
			s.scale.adminLate++
		}
		s.mu.Unlock()
		if !ok || late {
			exception(w, http.StatusUnauthorized, "UnauthorizedException", "the token is not valid")
			return
		}
		h(w, r)
	}
}

// AdminTokens returns how many admin tokens were issued, and how many
// service calls were refused for an expired one.
func (s *Server) AdminTokens() (issued, refused int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.scale.admins, s.scale.adminLate
}

func (s *Server) scopeOf(r *http.Request) string {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return s.scale.adminTokens[tok].scope
}

func (s *Server) runnerGroups(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("groupName")
	var groups []map[string]any
	if strings.EqualFold(name, "default") {
		groups = append(groups, map[string]any{"id": 1, "name": "Default", "isDefaultGroup": true})
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(groups), "value": groups})
}

func (set *scaleSet) json(stats map[string]int) map[string]any {
	labels := []map[string]string{}
	for _, l := range set.Labels {
		labels = append(labels, map[string]string{"type": "System", "name": l})
	}
	return map[string]any{"id": set.ID, "name": set.Name, "runnerGroupId": set.Group, "labels": labels, "statistics": stats}
}

func (s *Server) listScaleSets(w http.ResponseWriter, r *http.Request) {
	group, _ := strconv.Atoi(r.URL.Query().Get("runnerGroupId"))
	name := r.URL.Query().Get("name")
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, set := range s.scale.sets {
		if set.Group == group && set.Name == name && set.Scope == s.scopeOf(r) {
			out = append(out, set.json(s.statistics(set)))
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(out), "value": out})
}

func (s *Server) createScaleSet(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name          string `json:"name"`
		RunnerGroupID int    `json:"runnerGroupId"`
		Labels        []struct {
			Name string `json:"name"`
		} `json:"labels"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.Name == "" || body.RunnerGroupID == 0 {
		exception(w, http.StatusBadRequest, "ArgumentException", "a scale set needs a name and a runner group")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	scope := s.scopeOf(r)
	for _, set := range s.scale.sets {
		if set.Scope == scope && set.Group == body.RunnerGroupID && set.Name == body.Name {
			exception(w, http.StatusConflict, "RunnerScaleSetExistsException", "a runner scale set named "+body.Name+" exists")
			return
		}
	}
	if s.scale.sets == nil {
		s.scale.sets = map[int]*scaleSet{}
	}
	s.scale.nextSet++
	set := &scaleSet{ID: s.scale.nextSet, Name: body.Name, Group: body.RunnerGroupID, Scope: scope}
	for _, l := range body.Labels {
		set.Labels = append(set.Labels, l.Name)
	}
	s.scale.sets[set.ID] = set
	writeJSON(w, http.StatusOK, set.json(s.statistics(set)))
}

// setIn returns the scale set named by the path, or answers 404.
func (s *Server) setIn(w http.ResponseWriter, r *http.Request) *scaleSet {
	id, _ := strconv.Atoi(r.PathValue("id"))
	if set, ok := s.scale.sets[id]; ok && set.Scope == s.scopeOf(r) {
		return set
	}
	exception(w, http.StatusNotFound, "RunnerScaleSetNotFoundException", fmt.Sprintf("no runner scale set %s", r.PathValue("id")))
	return nil
}

func (s *Server) getScaleSet(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if set := s.setIn(w, r); set != nil {
		writeJSON(w, http.StatusOK, set.json(s.statistics(set)))
	}
}

func (s *Server) deleteScaleSet(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if set := s.setIn(w, r); set != nil {
		delete(s.scale.sets, set.ID)
		w.WriteHeader(http.StatusNoContent)
	}
}

// expireSessions drops sessions not polled for SessionTimeout. Called
// with s.mu held.
func (s *Server) expireSessions() {
	for _, set := range s.scale.sets {
		if set.sess != nil && time.Since(set.sess.lastPoll) > s.opt.SessionTimeout {
			set.sess = nil
		}
	}
}

func (s *Server) sessionJSON(set *scaleSet) map[string]any {
	return map[string]any{
		"sessionId": set.sess.id, "ownerName": set.sess.owner, "runnerScaleSet": set.json(nil),
		"messageQueueUrl": s.URL + "/_msgqueue/" + set.sess.id, "messageQueueAccessToken": set.sess.token,
		"statistics": s.statistics(set),
	}
}

func (s *Server) createSession(w http.ResponseWriter, r *http.Request) {
	var body struct {
		OwnerName string `json:"ownerName"`
	}
	_ = json.NewDecoder(r.Body).Decode(&body)
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.setIn(w, r)
	if set == nil {
		return
	}
	s.expireSessions()
	if set.sess != nil {
		exception(w, http.StatusConflict, "TaskAgentSessionConflictException", "the scale set already has a session, owned by "+set.sess.owner)
		return
	}
	s.scale.sessions++
	set.sess = &session{id: newUUID(), owner: body.OwnerName, token: randHex(20), issued: time.Now(), lastPoll: time.Now(), wake: make(chan struct{}, 1)}
	// A new session is offered every job still waiting for the set.
	for _, j := range s.jobs {
		if j.Status == "queued" && j.scaleSet == 0 && s.forSet(set, j) {
			set.sess.add(jobEvent(j, "JobAvailable"))
		}
	}
	writeJSON(w, http.StatusOK, s.sessionJSON(set))
}

func newUUID() string {
	h := randHex(16)
	return h[0:8] + "-" + h[8:12] + "-4" + h[13:16] + "-a" + h[17:20] + "-" + h[20:32]
}

func (s *Server) refreshSession(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.setIn(w, r)
	if set == nil {
		return
	}
	if set.sess == nil || set.sess.id != r.PathValue("sid") {
		exception(w, http.StatusNotFound, "TaskAgentSessionExpiredException", "no such session")
		return
	}
	set.sess.token, set.sess.issued = randHex(20), time.Now()
	writeJSON(w, http.StatusOK, s.sessionJSON(set))
}

func (s *Server) deleteSession(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.setIn(w, r)
	if set == nil {
		return
	}
	if set.sess != nil && set.sess.id == r.PathValue("sid") {
		set.sess = nil
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) scaleSetJIT(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name       string `json:"name"`
		WorkFolder string `json:"workFolder"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.Name == "" {
		exception(w, http.StatusBadRequest, "ArgumentException", "a runner needs a name")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.setIn(w, r)
	if set == nil {
		return
	}
	for _, x := range s.runners {
		if x.Scope == set.Scope && x.Name == body.Name {
			s.dups++
			exception(w, http.StatusConflict, "AgentExistsException", "a runner named "+body.Name+" exists")
			return
		}
	}
	run := &Runner{ID: s.id(), Name: body.Name, Labels: set.Labels, Scope: set.Scope, Group: int64(set.Group), ScaleSet: set.ID, Ephemeral: true, token: randHex(20)}
	s.runners[run.ID] = run
	s.jit = append(s.jit, body.Name)
	writeJSON(w, http.StatusOK, map[string]any{
		"runner":           map[string]any{"id": run.ID, "name": run.Name, "runnerScaleSetId": set.ID},
		"encodedJITConfig": s.encodeJIT(run),
	})
}

func (x *Runner) agentJSON() map[string]any {
	return map[string]any{"id": x.ID, "name": x.Name, "runnerScaleSetId": x.ScaleSet}
}

func (s *Server) agentByName(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("agentName")
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, x := range s.runners {
		if x.Name == name && x.Scope == s.scopeOf(r) {
			out = append(out, x.agentJSON())
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(out), "value": out})
}

func (s *Server) agentIn(w http.ResponseWriter, r *http.Request) *Runner {
	id, _ := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if x, ok := s.runners[id]; ok && x.Scope == s.scopeOf(r) {
		return x
	}
	exception(w, http.StatusNotFound, "AgentNotFoundException", "no runner "+r.PathValue("id"))
	return nil
}

func (s *Server) agentByID(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if x := s.agentIn(w, r); x != nil {
		writeJSON(w, http.StatusOK, x.agentJSON())
	}
}

func (s *Server) deleteAgent(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	x := s.agentIn(w, r)
	if x == nil {
		return
	}
	if x.JobID != 0 {
		exception(w, http.StatusBadRequest, "JobStillRunningException", "runner "+x.Name+" is running a job")
		return
	}
	delete(s.runners, x.ID)
	w.WriteHeader(http.StatusNoContent)
}

// sessionFor returns the scale set whose session the request's token is,
// or answers 401.
func (s *Server) sessionFor(w http.ResponseWriter, r *http.Request, sid string) *scaleSet {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	s.expireSessions()
	for _, set := range s.scale.sets {
		if set.sess != nil && (sid == "" || set.sess.id == sid) && set.sess.token == tok {
			if time.Since(set.sess.issued) > s.opt.QueueTokenLifetime {
				s.scale.expired++
				break
			}
			return set
		}
	}
	exception(w, http.StatusUnauthorized, "TaskAgentSessionExpiredException", "the message queue token is not valid")
	return nil
}

// FailAcquires makes the next n acquire calls fail with the service's
// 500, acquiring nothing.
func (s *Server) FailAcquires(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.scale.failAcquire = n
}

func (s *Server) acquireJobs(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	if s.scale.failAcquire > 0 {
		s.scale.failAcquire--
		s.mu.Unlock()
		exception(w, http.StatusInternalServerError, "InternalServerErrorException", "acquire failed")
		return
	}
	s.mu.Unlock()
	var ids []int64
	if err := json.NewDecoder(r.Body).Decode(&ids); err != nil {
		exception(w, http.StatusBadRequest, "ArgumentException", "a list of request ids")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.sessionFor(w, r, "")
	if set == nil {
		return
	}
	room := set.capacity - s.statistics(set)["totalAssignedJobs"]
	var got []int64
	for _, id := range ids {
		j, ok := s.jobs[id]
		if !ok || j.Status != "queued" || j.scaleSet != 0 || !s.forSet(set, j) || room <= 0 {
			continue
		}
		j.scaleSet = set.ID
		room--
		got = append(got, id)
		set.sess.add(jobEvent(j, "JobAssigned"))
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(got), "value": got})
}

func (s *Server) getMessage(w http.ResponseWriter, r *http.Request) {
	sid := r.PathValue("sid")
	capacity, err := strconv.Atoi(r.Header.Get("X-ScaleSetMaxCapacity"))
	if err != nil || capacity < 0 {
		exception(w, http.StatusBadRequest, "ArgumentException", "X-ScaleSetMaxCapacity is required")
		return
	}
	last, _ := strconv.Atoi(r.URL.Query().Get("lastMessageId"))
	deadline := time.Now().Add(s.opt.LongPoll)
	s.mu.Lock()
	s.scale.maxSeen = append(s.scale.maxSeen, capacity)
	s.mu.Unlock()
	for {
		s.mu.Lock()
		set := s.sessionFor(w, r, sid)
		if set == nil {
			s.mu.Unlock()
			return
		}
		set.capacity = capacity
		ss := set.sess
		ss.lastPoll = time.Now()
		if ss.outstanding != nil && last >= ss.outstanding.id {
			ss.outstanding = nil // acknowledged by lastMessageId
		}
		if ss.outstanding == nil && len(ss.pending) > 0 {
			n := min(len(ss.pending), 50)
			ss.nextMsg++
			ss.outstanding = &outMessage{id: ss.nextMsg, events: ss.pending[:n]}
			ss.pending = slices.Clone(ss.pending[n:])
		}
		if m := ss.outstanding; m != nil {
			body, _ := json.Marshal(m.events)
			out := map[string]any{"messageId": m.id, "messageType": "RunnerScaleSetJobMessages", "body": string(body), "statistics": s.statistics(set)}
			s.mu.Unlock()
			writeJSON(w, http.StatusOK, out)
			return
		}
		wake := ss.wake
		s.mu.Unlock()
		wait := time.Until(deadline)
		if wait <= 0 {
			w.WriteHeader(http.StatusAccepted)
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-wake:
		case <-time.After(min(wait, s.opt.SessionTimeout/2)):
		}
	}
}

func (s *Server) deleteMessage(w http.ResponseWriter, r *http.Request) {
	mid, _ := strconv.Atoi(r.PathValue("mid"))
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.sessionFor(w, r, r.PathValue("sid"))
	if set == nil {
		return
	}
	if m := set.sess.outstanding; m != nil && m.id == mid {
		set.sess.outstanding = nil
	}
	w.WriteHeader(http.StatusNoContent)
}

func (ss *session) add(ev map[string]any) {
	ss.pending = append(ss.pending, ev)
	select {
	case ss.wake <- struct{}{}:
	default:
	}
}

// forSet reports whether a job is for the scale set: its runs-on names
// the set, and its other labels are the set's or self-hosted.
func (s *Server) forSet(set *scaleSet, j *Job) bool {
	owner, _, _ := strings.Cut(j.Repo, "/")
	if set.Scope != j.Repo && set.Scope != owner {
		return false
	}
	named := false
	for _, l := range j.Labels {
		switch {
		case strings.EqualFold(l, set.Name):
			named = true
		case strings.EqualFold(l, "self-hosted"), slices.ContainsFunc(set.Labels, func(x string) bool { return strings.EqualFold(x, l) }):
		default:
			return false
		}
	}
	return named
}

func jobEvent(j *Job, typ string) map[string]any {
	ev := map[string]any{
		"messageType": typ, "runnerRequestId": j.ID, "repositoryName": j.Repo[strings.Index(j.Repo, "/")+1:],
		"ownerName": j.Repo[:max(strings.Index(j.Repo, "/"), 0)], "jobId": strconv.FormatInt(j.ID, 10),
		"jobDisplayName": j.Name, "workflowRunId": j.RunID, "eventName": "push", "requestLabels": j.Labels,
		"queueTime": j.CreatedAt.UTC().Format(time.RFC3339Nano),
	}
	switch typ {
	case "JobAvailable":
		ev["acquireJobUrl"] = ""
	case "JobStarted":
		ev["runnerId"], ev["runnerName"] = j.RunnerID, j.RunnerName
	case "JobCompleted":
		ev["runnerId"], ev["runnerName"], ev["result"] = j.RunnerID, j.RunnerName, j.Conclusion
		ev["finishTime"] = j.CompletedAt.UTC().Format(time.RFC3339Nano)
	}
	return ev
}

// queued reports a job entering the queue: its webhook, and an offer to a
// scale set it is for. Called with s.mu held.
func (s *Server) queued(j *Job) {
	s.deliver("queued", j)
	for _, set := range s.scale.sets {
		if set.sess != nil && s.forSet(set, j) {
			set.sess.add(jobEvent(j, "JobAvailable"))
			return
		}
	}
}

// scaleEvent tells a job's scale set that it started or ended. Called
// with s.mu held.
func (s *Server) scaleEvent(j *Job, typ string) {
	if set, ok := s.scale.sets[j.scaleSet]; ok && set.sess != nil {
		set.sess.add(jobEvent(j, typ))
	}
}

// statistics is the scale set's figures now. Called with s.mu held.
func (s *Server) statistics(set *scaleSet) map[string]int {
	st := map[string]int{}
	for _, j := range s.jobs {
		switch {
		case j.scaleSet == 0 && j.Status == "queued" && s.forSet(set, j):
			st["totalAvailableJobs"]++
		case j.scaleSet != set.ID:
		case j.Status == "queued":
			st["totalAcquiredJobs"]++
			st["totalAssignedJobs"]++
		case j.Status == "in_progress":
			st["totalAssignedJobs"]++
			st["totalRunningJobs"]++
		}
	}
	for _, x := range s.runners {
		if x.ScaleSet != set.ID {
			continue
		}
		st["totalRegisteredRunners"]++
		switch {
		case x.JobID != 0:
			st["totalBusyRunners"]++
		case x.Online:
			st["totalIdleRunners"]++
		}
	}
	return st
}
