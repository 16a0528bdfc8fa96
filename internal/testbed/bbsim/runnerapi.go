package bbsim

import (
	"encoding/json"
	"net/http"
	"strings"
	"time"
)

// The runner's side: this package's invention, since Bitbucket does not
// publish its runner's protocol. A runner authenticates with its OAuth
// client (client credentials), then sends heartbeats, asks for its next
// step, sends the step's log and its result, each with its access token,
// on its own runner's routes only.

func (s *Server) runnerRoutes(mux *http.ServeMux) {
	s.handle(mux, "POST /oauth/token", true, s.token)
	s.handle(mux, "PUT /runner-api/runners/{runner}/state", true, s.heartbeat)
	s.handle(mux, "GET /runner-api/runners/{runner}/step", true, s.nextStep)
	s.handle(mux, "POST /runner-api/runners/{runner}/steps/{step}/log", true, s.appendLog)
	s.handle(mux, "PUT /runner-api/runners/{runner}/steps/{step}/result", true, s.result)
}

// token grants an access token for a runner's OAuth client.
func (s *Server) token(w http.ResponseWriter, r *http.Request, _ []byte) {
	if err := r.ParseForm(); err != nil || r.PostForm.Get("grant_type") != "client_credentials" {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": "unsupported_grant_type"})
		return
	}
	id, secret := r.PostForm.Get("client_id"), r.PostForm.Get("client_secret")
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rn := range s.runners {
		if !rn.Deleted && rn.ClientID == id && rn.Secret == secret && secret != "" {
			tok := "bbrunner-" + randHex(24)
			s.tokens[tok] = rn.UUID
			writeJSON(w, http.StatusOK, map[string]any{"access_token": tok, "token_type": "Bearer", "expires_in": 3600,
				"check_interval_ms": s.opt.RunnerCheck.Milliseconds(), "step_setup_ms": s.opt.StepSetup.Milliseconds()})
			return
		}
	}
	writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "access_denied", "error_description": "Unauthorized"})
}

// self finds the runner a runner route names, authenticated as itself.
// Called with s.mu held.
func (s *Server) self(w http.ResponseWriter, r *http.Request) *Runner {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	id, ok := s.tokens[tok]
	if !ok || id != r.PathValue("runner") {
		fail(w, http.StatusUnauthorized, "Unauthorized")
		return nil
	}
	rn := s.runners[id]
	if rn == nil || rn.Deleted {
		fail(w, http.StatusNotFound, "Runner not found")
		return nil
	}
	return rn
}

func (s *Server) heartbeat(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		Status string `json:"status"`
	}
	if json.Unmarshal(body, &req) != nil || (req.Status != "ONLINE" && req.Status != "OFFLINE") {
		fail(w, http.StatusBadRequest, "Invalid runner status")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rn := s.self(w, r)
	if rn == nil {
		return
	}
	rn.Connected = true
	rn.Seen = time.Now()
	if req.Status == "OFFLINE" {
		rn.Seen = time.Time{}
		s.lapse(time.Now())
	}
	s.assign()
	w.WriteHeader(http.StatusNoContent)
}

// nextStep gives the runner the step assigned to it: 204 when there is
// none.
func (s *Server) nextStep(w http.ResponseWriter, r *http.Request, _ []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rn := s.self(w, r)
	if rn == nil {
		return
	}
	rn.Connected, rn.Seen = true, time.Now()
	s.assign()
	st := s.fetch(rn)
	if st == nil {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"uuid": st.UUID, "pipeline_uuid": st.Pipeline, "repository_uuid": s.repos[st.Repo],
		"build_number": st.Build, "name": st.Name, "script": st.Script,
	})
}

// step finds the runner's step a route names. Called with s.mu held.
func (s *Server) ownStep(w http.ResponseWriter, r *http.Request) *Step {
	rn := s.self(w, r)
	if rn == nil {
		return nil
	}
	st := s.step(r.PathValue("step"))
	if st == nil || st.Runner != rn.UUID || st.State != "IN_PROGRESS" {
		fail(w, http.StatusConflict, "The step is not running on this runner")
		return nil
	}
	rn.Seen = time.Now()
	return st
}

func (s *Server) appendLog(w http.ResponseWriter, r *http.Request, body []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := s.ownStep(w, r); st != nil {
		st.Log = append(st.Log, body...)
		w.WriteHeader(http.StatusNoContent)
	}
}

func (s *Server) result(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		Result string `json:"result"`
	}
	if json.Unmarshal(body, &req) != nil || (req.Result != "SUCCESSFUL" && req.Result != "FAILED") {
		fail(w, http.StatusBadRequest, "Invalid result")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := s.ownStep(w, r); st != nil {
		s.finish(st, req.Result)
		w.WriteHeader(http.StatusNoContent)
	}
}
