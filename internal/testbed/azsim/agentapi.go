package azsim

import (
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v4"
)

// The agent's side: its token, its session and messages, its job
// request, and its job's log.
func (s *Server) agentRoutes(mux *http.ServeMux) {
	o := "/" + s.opt.Org
	agent, unversioned := route{versioned: true}, route{}
	s.handle(mux, "POST "+o+"/_apis/oauth2/token", unversioned, s.token)
	s.handle(mux, "POST "+o+"/_apis/distributedtask/pools/{poolId}/sessions", agent, s.createSession)
	s.handle(mux, "DELETE "+o+"/_apis/distributedtask/pools/{poolId}/sessions/{sessionId}", agent, s.deleteSession)
	s.handle(mux, "GET "+o+"/_apis/distributedtask/pools/{poolId}/messages", agent, s.getMessage)
	s.handle(mux, "DELETE "+o+"/_apis/distributedtask/pools/{poolId}/messages/{messageId}", agent, s.deleteMessage)
	s.handle(mux, "PATCH "+o+"/_apis/distributedtask/pools/{poolId}/jobrequests/{requestId}", agent, s.updateRequest)
	s.handle(mux, "POST "+o+"/{project}/_apis/distributedtask/hubs/build/plans/{planId}/logs", unversioned, s.createLog)
	s.handle(mux, "POST "+o+"/{project}/_apis/distributedtask/hubs/build/plans/{planId}/logs/{logId}", unversioned, s.appendLog)
	s.handle(mux, "POST "+o+"/{project}/_apis/distributedtask/hubs/build/plans/{planId}/events", agent, s.planEvent)
}

// token answers the OAuth token request of an agent: the client
// credentials grant, the client authenticated by a JWT it signed with its
// key (RFC 7523), as VssOAuthJwtBearerClientCredential sends it.
func (s *Server) token(w http.ResponseWriter, r *http.Request) {
	deny := func(code, desc string) {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": code, "error_description": desc})
	}
	if err := r.ParseForm(); err != nil {
		deny("invalid_request", err.Error())
		return
	}
	if g := r.PostForm.Get("grant_type"); g != "client_credentials" {
		deny("unsupported_grant_type", fmt.Sprintf("grant_type %q", g))
		return
	}
	if t := r.PostForm.Get("client_assertion_type"); t != "urn:ietf:params:oauth:client-assertion-type:jwt-bearer" {
		deny("invalid_client", fmt.Sprintf("client_assertion_type %q", t))
		return
	}
	audience := s.URL + "/_apis/oauth2/token"
	var claims jwt.RegisteredClaims
	var agent *Agent
	_, err := jwt.ParseWithClaims(r.PostForm.Get("client_assertion"), &claims, func(t *jwt.Token) (any, error) {
		if t.Method != jwt.SigningMethodRS256 {
			return nil, fmt.Errorf("signed with %v, not RS256", t.Header["alg"])
		}
		c := t.Claims.(*jwt.RegisteredClaims)
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, a := range s.agents {
			if !a.Deleted && a.ClientID != "" && a.ClientID == c.Issuer {
				agent = a
				return a.PublicKey, nil
			}
		}
		return nil, fmt.Errorf("no agent has the client id %q", c.Issuer)
	})
	switch {
	case err != nil:
		deny("invalid_client", err.Error())
		return
	case claims.Subject != claims.Issuer:
		deny("invalid_client", "sub is not the client id")
		return
	case !claims.VerifyAudience(audience, true):
		deny("invalid_client", fmt.Sprintf("aud %v is not %s", claims.Audience, audience))
		return
	case claims.ExpiresAt == nil || claims.NotBefore == nil || claims.ExpiresAt.Sub(claims.NotBefore.Time) > 10*time.Minute:
		deny("invalid_client", "the assertion must carry nbf and exp, at most 10 minutes apart")
		return
	case claims.ID == "":
		deny("invalid_client", "the assertion has no jti")
		return
	}
	tok := "eyJ0eXAiOiJKV1QifQ." + randHex(24)
	s.mu.Lock()
	s.tokens[tok] = agent.ID
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"access_token": tok, "token_type": "jwt-bearer", "expires_in": 3600, "scope": "/tfs_agent"})
}

// agentOfToken is the agent whose access token the request carries; it
// answers 401 itself. Called with s.mu held.
func (s *Server) agentOfToken(w http.ResponseWriter, r *http.Request) (*Agent, bool) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if id, known := s.tokens[tok]; ok && known {
		if a := s.agents[id]; a != nil && !a.Deleted {
			return a, true
		}
	}
	http.Error(w, "Unauthorized", http.StatusUnauthorized)
	return nil, false
}

// createSession opens an agent's session: one at a time.
func (s *Server) createSession(w http.ResponseWriter, r *http.Request) {
	var b struct {
		OwnerName string `json:"ownerName"`
		Agent     struct {
			ID            int    `json:"id"`
			Name          string `json:"name"`
			Version       string `json:"version"`
			OSDescription string `json:"osDescription"`
		} `json:"agent"`
		SystemCapabilities map[string]string `json:"systemCapabilities"`
	}
	if !decode(w, r, "TaskAgentSession", &b) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOfToken(w, r)
	if !ok {
		return
	}
	if pid, _ := strconv.Atoi(r.PathValue("poolId")); pid != a.PoolID || b.Agent.ID != a.ID {
		fail(w, http.StatusBadRequest, "ArgumentException", fmt.Sprintf("The session's agent %d in pool %s is not agent %d of pool %d.", b.Agent.ID, r.PathValue("poolId"), a.ID, a.PoolID))
		return
	}
	for _, sess := range s.sessions {
		if sess.agentID == a.ID {
			fail(w, http.StatusConflict, "TaskAgentSessionConflictException", fmt.Sprintf("A session for agent %s already exists.", a.Name))
			return
		}
	}
	sess := &session{id: newGUID(), agentID: a.ID, poolID: a.PoolID, owner: b.OwnerName, wake: make(chan struct{}), polled: time.Now()}
	s.sessions[sess.id] = sess
	a.Online = true
	a.SystemCaps = b.SystemCapabilities
	if b.Agent.Version != "" {
		a.Version = b.Agent.Version
	}
	s.assign()
	writeJSON(w, http.StatusOK, map[string]any{
		"sessionId": sess.id, "ownerName": b.OwnerName,
		"agent": map[string]any{"id": a.ID, "name": a.Name, "version": a.Version, "enabled": a.Enabled, "status": "online"},
	})
}

// sessionOf is the agent's session a request names; it answers itself.
// Called with s.mu held.
func (s *Server) sessionOf(w http.ResponseWriter, r *http.Request, a *Agent, id string) (*session, bool) {
	sess, ok := s.sessions[id]
	if !ok || sess.agentID != a.ID {
		fail(w, http.StatusNotFound, "TaskAgentSessionExpiredException", fmt.Sprintf("The session %s has expired or does not exist.", id))
		return nil, false
	}
	return sess, true
}

func (s *Server) deleteSession(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOfToken(w, r)
	if !ok {
		return
	}
	sess, ok := s.sessionOf(w, r, a, r.PathValue("sessionId"))
	if !ok {
		return
	}
	s.offline(sess)
	w.WriteHeader(http.StatusNoContent)
}

// getMessage long-polls the session's queue: its next message, or 202
// (and no body) once LongPoll passes without one, as the service answers.
func (s *Server) getMessage(w http.ResponseWriter, r *http.Request) {
	deadline := time.NewTimer(s.opt.LongPoll)
	defer deadline.Stop()
	for {
		s.mu.Lock()
		a, ok := s.agentOfToken(w, r)
		if !ok {
			s.mu.Unlock()
			return
		}
		sess, ok := s.sessionOf(w, r, a, r.URL.Query().Get("sessionId"))
		if !ok {
			s.mu.Unlock()
			return
		}
		sess.polled = time.Now()
		if len(sess.messages) > 0 {
			m := sess.messages[0]
			if req, ok := s.requests[a.Request]; ok && req.Received.IsZero() {
				req.Received = time.Now().UTC()
			}
			s.mu.Unlock()
			writeJSON(w, http.StatusOK, map[string]any{"messageId": m.ID, "messageType": m.Type, "body": m.Body, "iv": nil})
			return
		}
		wake := sess.wake
		s.mu.Unlock()
		select {
		case <-wake:
			// A message came, or the session went.
		case <-deadline.C:
			w.WriteHeader(http.StatusAccepted)
			return
		case <-r.Context().Done():
			return
		}
	}
}

func (s *Server) deleteMessage(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOfToken(w, r)
	if !ok {
		return
	}
	sess, ok := s.sessionOf(w, r, a, r.URL.Query().Get("sessionId"))
	if !ok {
		return
	}
	id, _ := strconv.ParseInt(r.PathValue("messageId"), 10, 64)
	for i, m := range sess.messages {
		if m.ID == id {
			sess.messages = append(sess.messages[:i], sess.messages[i+1:]...)
			break
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// updateRequest renews a job request's lock, or finishes it when the body
// has a result, as the agent's RenewAgentRequestAsync and
// FinishAgentRequestAsync send them (lockToken is the empty GUID: the
// agent has never used it).
func (s *Server) updateRequest(w http.ResponseWriter, r *http.Request) {
	var b struct {
		RequestID  int64  `json:"requestId"`
		FinishTime string `json:"finishTime"`
		Result     string `json:"result"`
	}
	if !decode(w, r, "TaskAgentJobRequest", &b) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.agentOfToken(w, r)
	if !ok {
		return
	}
	if _, err := parseGUID(r.URL.Query().Get("lockToken")); err != nil {
		fail(w, http.StatusBadRequest, "ArgumentException", "lockToken: "+err.Error())
		return
	}
	id, _ := strconv.ParseInt(r.PathValue("requestId"), 10, 64)
	req, ok := s.requests[id]
	if !ok || req.AgentID != a.ID || b.RequestID != id {
		fail(w, http.StatusNotFound, "TaskAgentJobNotFoundException", fmt.Sprintf("No job request %d is assigned to agent %s.", id, a.Name))
		return
	}
	if req.Result != "" {
		fail(w, http.StatusBadRequest, "TaskAgentJobTokenExpiredException", fmt.Sprintf("The job request %d has finished.", id))
		return
	}
	if b.Result == "" {
		req.LockedUntil = time.Now().Add(s.opt.LockTimeout).UTC()
		req.Started = true
	} else {
		if !taskResult(w, b.Result) {
			return
		}
		s.finishRequest(req, b.Result, false)
	}
	writeJSON(w, http.StatusOK, s.requestJSON(req))
}

// planEvent takes the worker's JobCompleted event, by which a plan of
// version 8 or later learns that its job ended (the listener then sends no
// completion of its own). agentShuttingDown, which an agent run with
// --once sets, keeps the service from giving the agent another job
// between this event and its exit (azure-pipelines-agent pull 2728).
func (s *Server) planEvent(w http.ResponseWriter, r *http.Request) {
	var b struct {
		Name              string `json:"name"`
		JobID             string `json:"jobId"`
		RequestID         int64  `json:"requestId"`
		Result            string `json:"result"`
		AgentShuttingDown bool   `json:"agentShuttingDown"`
	}
	if !decode(w, r, "JobEvent", &b) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	req, ok := s.jobOfToken(w, r)
	if !ok {
		return
	}
	if b.Name != "JobCompleted" || b.JobID != req.JobID || b.RequestID != req.ID {
		fail(w, http.StatusBadRequest, "ArgumentException", fmt.Sprintf("event %q for job %s, request %d: not this job's completion", b.Name, b.JobID, b.RequestID))
		return
	}
	if !taskResult(w, b.Result) {
		return
	}
	s.finishRequest(req, b.Result, b.AgentShuttingDown)
	w.WriteHeader(http.StatusNoContent)
}

// jobOfToken is the running request whose job token the request
// carries; it answers 401 itself. Called with s.mu held.
func (s *Server) jobOfToken(w http.ResponseWriter, r *http.Request) (*Request, bool) {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	for _, req := range s.requests {
		if req.jobToken != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(req.jobToken)) == 1 && req.PlanID == r.PathValue("planId") {
			return req, true
		}
	}
	http.Error(w, "Unauthorized", http.StatusUnauthorized)
	return nil, false
}

func (s *Server) createLog(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.jobOfToken(w, r); !ok {
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": 1, "path": "logs/1", "lineCount": 0})
}

func (s *Server) appendLog(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 4<<20))
	if err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	req, ok := s.jobOfToken(w, r)
	if !ok {
		return
	}
	req.Log = append(req.Log, body...)
	writeJSON(w, http.StatusOK, map[string]any{"id": 1, "path": "logs/1", "lineCount": strings.Count(string(req.Log), "\n")})
}

func parseGUID(s string) (string, error) {
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return "", fmt.Errorf("%q is not a GUID", s)
	}
	return s, nil
}

// taskResult checks a TaskResult, and answers 400 itself when it is not
// one.
func taskResult(w http.ResponseWriter, result string) bool {
	switch result {
	case "succeeded", "succeededWithIssues", "failed", "canceled", "skipped", "abandoned":
		return true
	}
	fail(w, http.StatusBadRequest, "ArgumentException", fmt.Sprintf("result %q is not a TaskResult", result))
	return false
}

// decode reads a request's JSON body, and answers 400 itself when it is
// not one of what: a TaskAgent, a TaskAgentSession, ...
func decode(w http.ResponseWriter, r *http.Request, what string, v any) bool {
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		fail(w, http.StatusBadRequest, "VssPropertyValidationException", "The request body is not a valid "+what+": "+err.Error())
		return false
	}
	return true
}
