package bbsim

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// maxRunners is how many runners a scope may have, as the autoscaler's
// MAX_RUNNERS_COUNT.
const maxRunners = 100

var labelRE = regexp.MustCompile(`^[a-z0-9.]+$`)

// handle registers a route whose calls are recorded; runner routes take a
// runner's token, the others the manager's credentials.
func (s *Server) handle(mux *http.ServeMux, pattern string, runner bool, h func(w http.ResponseWriter, r *http.Request, body []byte)) {
	mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		r.Body = io.NopCloser(bytes.NewReader(body))
		rec := &recorder{ResponseWriter: w, status: http.StatusOK}
		defer func() {
			route := pattern
			if _, r, ok := strings.Cut(pattern, " "); ok {
				route = r
			}
			s.mu.Lock()
			s.calls = append(s.calls, Call{Method: r.Method, Route: route, Body: string(body), Status: rec.status, Runner: runner})
			s.mu.Unlock()
		}()
		s.mu.Lock()
		down, throttled := s.down, !runner && s.throttle > 0
		if throttled {
			s.throttle--
			s.limited++
		}
		if !runner && !down && !throttled && s.rateLimited(rec, r) {
			throttled = true
			s.limited++
		}
		s.mu.Unlock()
		switch {
		case down:
			fail(rec, http.StatusServiceUnavailable, "Bitbucket is unavailable")
		case !runner && !s.authorized(r):
			fail(rec, http.StatusUnauthorized, "Token is invalid, expired, or not supported for this endpoint.")
		case !runner && !s.scoped(rec, r):
		case throttled:
			// Bitbucket says nothing of when to come back.
			fail(rec, http.StatusTooManyRequests, "Rate limit for this resource has been exceeded")
		default:
			h(rec, r, body)
		}
	})
}

type recorder struct {
	http.ResponseWriter
	status int
}

func (r *recorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

func (s *Server) authorized(r *http.Request) bool {
	h := r.Header.Get("Authorization")
	if tok, ok := strings.CutPrefix(h, "Bearer "); ok {
		return s.opt.Token != "" && tok == s.opt.Token
	}
	if b, ok := strings.CutPrefix(h, "Basic "); ok && s.opt.User != "" {
		raw, err := base64.StdEncoding.DecodeString(b)
		return err == nil && string(raw) == s.opt.User+":"+s.opt.Password
	}
	return false
}

func (s *Server) restRoutes(mux *http.ServeMux) {
	s.handle(mux, "GET /2.0/workspaces/{workspace}", false, s.getWorkspace)
	s.handle(mux, "GET /2.0/repositories/{workspace}/{repo}", false, s.getRepo)
	s.handle(mux, "GET /2.0/repositories/{workspace}/{repo}/pipelines", false, s.listPipelines)
	s.handle(mux, "POST /2.0/repositories/{workspace}/{repo}/pipelines", false, s.runPipeline)
	s.handle(mux, "GET /2.0/repositories/{workspace}/{repo}/pipelines/{pipeline}", false, s.getPipeline)
	s.handle(mux, "GET /2.0/repositories/{workspace}/{repo}/pipelines/{pipeline}/steps", false, s.listSteps)
	s.handle(mux, "GET /2.0/repositories/{workspace}/{repo}/src/{commit}/{path...}", false, s.getFile)
	for _, scope := range []string{"/internal/workspaces/{workspace}", "/internal/repositories/{workspace}/{repo}"} {
		base := scope + "/pipelines-config/runners"
		s.handle(mux, "GET "+base, false, s.listRunners)
		s.handle(mux, "POST "+base, false, s.createRunner)
		s.handle(mux, "GET "+base+"/{runner}", false, s.getRunner)
		s.handle(mux, "DELETE "+base+"/{runner}", false, s.deleteRunner)
		s.handle(mux, "PUT "+base+"/{runner}/state", false, s.setState)
	}
	// Anything else is recorded, so that a test sees a call the
	// driver should not make.
	s.handle(mux, "/", false, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		fail(w, http.StatusNotFound, "Resource not found")
	})
}

// workspaceOK reports whether a path's workspace is the simulator's, by
// slug or uuid.
func (s *Server) workspaceOK(w http.ResponseWriter, r *http.Request) bool {
	if ws := r.PathValue("workspace"); ws == s.opt.Workspace || ws == s.wsUUID {
		return true
	}
	fail(w, http.StatusNotFound, "No workspace with identifier '"+r.PathValue("workspace")+"'.")
	return false
}

// repo finds a path's repository, by slug or uuid: its slug and uuid.
func (s *Server) repo(w http.ResponseWriter, r *http.Request) (slug, uuid string, ok bool) {
	if !s.workspaceOK(w, r) {
		return "", "", false
	}
	name := r.PathValue("repo")
	for slug, uuid := range s.repos {
		if name == slug || name == uuid {
			return slug, uuid, true
		}
	}
	fail(w, http.StatusNotFound, "Repository "+s.opt.Workspace+"/"+name+" not found")
	return "", "", false
}

func (s *Server) getWorkspace(w http.ResponseWriter, r *http.Request, _ []byte) {
	if s.workspaceOK(w, r) {
		writeJSON(w, http.StatusOK, map[string]any{"type": "workspace", "uuid": s.wsUUID, "slug": s.opt.Workspace, "name": s.opt.Workspace})
	}
}

func (s *Server) getRepo(w http.ResponseWriter, r *http.Request, _ []byte) {
	if slug, uuid, ok := s.repo(w, r); ok {
		writeJSON(w, http.StatusOK, map[string]any{"type": "repository", "uuid": uuid, "slug": slug, "name": slug,
			"full_name": s.opt.Workspace + "/" + slug, "is_private": true})
	}
}

// paged answers one page of a collection as Bitbucket does, its next
// the same query with the next page.
func (s *Server) paged(w http.ResponseWriter, r *http.Request, items []any) {
	q := r.URL.Query()
	n := s.opt.PageLen
	if v := q.Get("pagelen"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 || n > 100 {
			fail(w, http.StatusBadRequest, "Invalid pagelen")
			return
		}
	}
	pg := 1
	if v := q.Get("page"); v != "" {
		var err error
		if pg, err = strconv.Atoi(v); err != nil || pg < 1 {
			fail(w, http.StatusBadRequest, "Invalid page")
			return
		}
	}
	lo := min((pg-1)*n, len(items))
	hi := min(lo+n, len(items))
	body := map[string]any{"size": len(items), "page": pg, "pagelen": n, "values": append([]any{}, items[lo:hi]...)}
	if hi < len(items) {
		q.Set("page", strconv.Itoa(pg+1))
		body["next"] = s.URL + r.URL.EscapedPath() + "?" + q.Encode()
	}
	writeJSON(w, http.StatusOK, body)
}

// ---- pipelines ----

func (s *Server) pipelineState(p *pipeline) (name, result string) {
	pending, done, ok := 0, 0, true
	for _, st := range p.Steps {
		switch st.State {
		case "PENDING":
			pending++
		case "COMPLETED":
			done++
			ok = ok && st.Result == "SUCCESSFUL"
		}
	}
	switch {
	case pending == len(p.Steps):
		return "PENDING", ""
	case done < len(p.Steps):
		return "IN_PROGRESS", ""
	case ok:
		return "COMPLETED", "SUCCESSFUL"
	}
	return "COMPLETED", "FAILED"
}

func (s *Server) pipelineJSON(p *pipeline) map[string]any {
	name, result := s.pipelineState(p)
	state := map[string]any{"name": name, "type": "pipeline_state_" + strings.ToLower(name)}
	switch {
	case result != "":
		state["result"] = map[string]any{"name": result, "type": "pipeline_state_completed_" + strings.ToLower(result)}
	case name == "IN_PROGRESS":
		state["stage"] = map[string]any{"name": "RUNNING", "type": "pipeline_state_in_progress_running"}
	}
	return map[string]any{
		"type": "pipeline", "uuid": p.UUID, "build_number": p.Build, "state": state,
		"target": map[string]any{"type": "pipeline_ref_target", "ref_type": "branch", "ref_name": "main",
			"commit": map[string]any{"type": "commit", "hash": p.Commit}},
		// The account that ran it, as the pipeline object's creator
		// (developer.atlassian.com, "Pipelines": pipeline.creator).
		"creator":    map[string]any{"type": "user", "display_name": "Ada Lovelace", "nickname": "ada", "account_id": "557058:0e1b"},
		"created_on": timeJSON(p.Created),
	}
}

// listPipelines answers a repository's pipelines, filtered by status
// (PENDING, IN_PROGRESS, ...: each a pipeline state's name) and sorted by
// created_on or -created_on.
func (s *Server) listPipelines(w http.ResponseWriter, r *http.Request, _ []byte) {
	slug, _, ok := s.repo(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	sort := q.Get("sort")
	if sort != "" && sort != "created_on" && sort != "-created_on" {
		fail(w, http.StatusBadRequest, "Invalid sort field: "+sort)
		return
	}
	s.mu.Lock()
	var items []any
	for _, p := range s.pipelines {
		name, _ := s.pipelineState(p)
		if p.Repo != slug || len(q["status"]) > 0 && !slices.Contains(q["status"], name) {
			continue
		}
		items = append(items, s.pipelineJSON(p))
	}
	s.mu.Unlock()
	if sort == "-created_on" {
		slices.Reverse(items)
	}
	s.paged(w, r, items)
}

func (s *Server) getPipeline(w http.ResponseWriter, r *http.Request, _ []byte) {
	slug, _, ok := s.repo(w, r)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.pipelines {
		if p.Repo == slug && p.UUID == r.PathValue("pipeline") {
			writeJSON(w, http.StatusOK, s.pipelineJSON(p))
			return
		}
	}
	fail(w, http.StatusNotFound, "Pipeline not found")
}

// runPipeline runs a pipeline on a target ({"target": {"type":
// "pipeline_ref_target", "ref_type", "ref_name", "commit": {"hash"}}}):
// the steps of the commit's bitbucket-pipelines.yml, as the simulator
// wrote it.
func (s *Server) runPipeline(w http.ResponseWriter, r *http.Request, body []byte) {
	slug, _, ok := s.repo(w, r)
	if !ok {
		return
	}
	var req struct {
		Target struct {
			Type    string `json:"type"`
			RefType string `json:"ref_type"`
			RefName string `json:"ref_name"`
			Commit  struct {
				Hash string `json:"hash"`
			} `json:"commit"`
		} `json:"target"`
	}
	if err := json.Unmarshal(body, &req); err != nil || req.Target.Type != "pipeline_ref_target" || req.Target.RefName == "" {
		fail(w, http.StatusBadRequest, "A pipeline target with a ref is required")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var from *pipeline
	for _, p := range s.pipelines {
		if p.Repo == slug && p.Commit == req.Target.Commit.Hash {
			from = p
		}
	}
	if from == nil {
		fail(w, http.StatusBadRequest, "Commit not found: "+req.Target.Commit.Hash)
		return
	}
	s.start(slug, from.Commit, from.specs)
	writeJSON(w, http.StatusCreated, s.pipelineJSON(s.pipelines[len(s.pipelines)-1]))
}

func (s *Server) listSteps(w http.ResponseWriter, r *http.Request, _ []byte) {
	slug, _, ok := s.repo(w, r)
	if !ok {
		return
	}
	s.mu.Lock()
	var items []any
	found := false
	for _, p := range s.pipelines {
		if p.Repo != slug || p.UUID != r.PathValue("pipeline") {
			continue
		}
		found = true
		for _, st := range p.Steps {
			state := map[string]any{"name": st.State, "type": "pipeline_step_state_" + strings.ToLower(st.State)}
			if st.Result != "" {
				state["result"] = map[string]any{"name": st.Result}
			}
			items = append(items, map[string]any{"type": "pipeline_step", "uuid": st.UUID, "name": st.Name, "state": state,
				"started_on": timeJSON(st.Started), "completed_on": timeJSON(st.Completed)})
		}
	}
	s.mu.Unlock()
	if !found {
		fail(w, http.StatusNotFound, "Pipeline not found")
		return
	}
	s.paged(w, r, items)
}

func (s *Server) getFile(w http.ResponseWriter, r *http.Request, _ []byte) {
	if _, _, ok := s.repo(w, r); !ok {
		return
	}
	s.mu.Lock()
	yml, ok := s.files[r.PathValue("commit")]
	s.mu.Unlock()
	if !ok || r.PathValue("path") != "bitbucket-pipelines.yml" {
		fail(w, http.StatusNotFound, "No such file or directory: "+r.PathValue("path"))
		return
	}
	w.Header().Set("Content-Type", "text/plain")
	_, _ = io.WriteString(w, yml)
}

// ---- runners ----

// scope finds a runner route's scope: "" for the workspace, the
// repository's uuid for a repository. Runner routes take uuids only.
func (s *Server) scope(w http.ResponseWriter, r *http.Request) (string, bool) {
	if r.PathValue("workspace") != s.wsUUID {
		fail(w, http.StatusNotFound, "Workspace not found")
		return "", false
	}
	repo := r.PathValue("repo")
	if repo == "" {
		return "", true
	}
	for _, uuid := range s.repos {
		if repo == uuid {
			return uuid, true
		}
	}
	fail(w, http.StatusNotFound, "Repository not found")
	return "", false
}

func (s *Server) runnerJSON(rn *Runner, now time.Time, secret bool) map[string]any {
	state := map[string]any{"status": s.status(rn, now), "updated_on": timeJSON(now), "version": map[string]any{"current": "3.1.0"}}
	if rn.Step != "" {
		state["step"] = map[string]any{"type": "PIPELINE_STEP", "uuid": rn.Step}
	}
	client := map[string]any{"id": rn.ClientID, "token_endpoint": s.URL + "/oauth/token", "audience": "api.atlassian.com"}
	if secret {
		client["secret"] = rn.Secret
	}
	return map[string]any{"uuid": rn.UUID, "name": rn.Name, "labels": rn.Labels, "state": state,
		"oauth_client": client, "created_on": timeJSON(rn.Created), "updated_on": timeJSON(now)}
}

func (s *Server) listRunners(w http.ResponseWriter, r *http.Request, _ []byte) {
	scope, ok := s.scope(w, r)
	if !ok {
		return
	}
	now := time.Now()
	s.mu.Lock()
	var items []any
	for _, rn := range s.sortedRunners(scope) {
		items = append(items, s.runnerJSON(rn, now, false))
	}
	s.mu.Unlock()
	s.paged(w, r, items)
}

// createRunner takes {"name": ..., "labels": [...]} and nothing else.
func (s *Server) createRunner(w http.ResponseWriter, r *http.Request, body []byte) {
	scope, ok := s.scope(w, r)
	if !ok {
		return
	}
	var req struct {
		Name   string   `json:"name"`
		Labels []string `json:"labels"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		fail(w, http.StatusBadRequest, "Invalid request body: "+err.Error())
		return
	}
	if strings.TrimSpace(req.Name) == "" {
		fail(w, http.StatusBadRequest, "Runner name is required")
		return
	}
	labels := []string{"self.hosted", "linux"}
	custom := 0
	for _, l := range req.Labels {
		if !labelRE.MatchString(l) {
			fail(w, http.StatusBadRequest, fmt.Sprintf("Invalid label %q: labels can only contain lowercase alphanumeric characters and dots", l))
			return
		}
		if !slices.Contains(labels, l) {
			labels = append(labels, l)
			custom++
		}
	}
	if custom > 10 {
		fail(w, http.StatusBadRequest, "A runner can have at most 10 custom labels")
		return
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.sortedRunners(scope)) >= maxRunners {
		s.failShaped(w, http.StatusBadRequest, fmt.Sprintf("Maximum number of runners (%d) reached", maxRunners))
		return
	}
	rn := &Runner{UUID: newUUID(), Scope: scope, Name: req.Name, Labels: labels, Enabled: true,
		ClientID: randHex(16), Secret: "bbsecret-" + randHex(24), Created: now}
	s.runners[rn.UUID] = rn
	writeJSON(w, http.StatusOK, s.runnerJSON(rn, now, true))
}

// runner finds a runner route's runner in its scope.
func (s *Server) runner(w http.ResponseWriter, r *http.Request) *Runner {
	scope, ok := s.scope(w, r)
	if !ok {
		return nil
	}
	if rn, ok := s.runners[r.PathValue("runner")]; ok && !rn.Deleted && rn.Scope == scope {
		return rn
	}
	fail(w, http.StatusNotFound, "Runner not found")
	return nil
}

func (s *Server) getRunner(w http.ResponseWriter, r *http.Request, _ []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rn := s.runner(w, r); rn != nil {
		writeJSON(w, http.StatusOK, s.runnerJSON(rn, time.Now(), false))
	}
}

// deleteRunner removes a runner; the step assigned to it is lost.
func (s *Server) deleteRunner(w http.ResponseWriter, r *http.Request, _ []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rn := s.runner(w, r)
	if rn == nil {
		return
	}
	rn.Deleted = true
	if st := s.step(rn.Step); st != nil && st.State == "IN_PROGRESS" {
		rn.DeletedBusy = true
		st.Log = append(st.Log, "The runner was deleted with the step assigned to it.\n"...)
		s.finish(st, "ERROR")
	}
	for tok, id := range s.tokens {
		if id == rn.UUID {
			delete(s.tokens, tok)
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// setState takes {"status": "DISABLED"} or {"status": "ENABLED"}.
func (s *Server) setState(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		Status string `json:"status"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil || (req.Status != "DISABLED" && req.Status != "ENABLED") {
		fail(w, http.StatusBadRequest, "Invalid runner state: "+string(body))
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rn := s.runner(w, r)
	if rn == nil {
		return
	}
	if rn.Enabled && req.Status == "DISABLED" {
		rn.Disabled = time.Now()
	}
	rn.Enabled = req.Status == "ENABLED"
	s.assign()
	writeJSON(w, http.StatusOK, s.runnerJSON(rn, time.Now(), false))
}

// Unexpected describes each call of the manager's that is not one of the
// calls a manager may make (a route of its own, the autoscaler's runner
// calls, the documented reads and "Run a pipeline") with the body it
// takes: none for GET and DELETE, {"status":"DISABLED"} to disable, a name
// and labels alone to create a runner, a target alone to run a pipeline.
func (s *Server) Unexpected() []string {
	var out []string
	for _, c := range s.Calls() {
		if c.Runner {
			continue
		}
		bad := ""
		switch {
		case c.Route == "/":
			bad = "no such call"
		case (c.Method == http.MethodGet || c.Method == http.MethodDelete) && c.Body != "":
			bad = "a body"
		case c.Method == http.MethodPut && c.Body != `{"status":"DISABLED"}`:
			bad = "a state other than DISABLED"
		case c.Method == http.MethodPost && strings.HasSuffix(c.Route, "/pipelines"):
			var body map[string]json.RawMessage
			if json.Unmarshal([]byte(c.Body), &body) != nil || len(body) != 1 || body["target"] == nil {
				bad = "a body other than a target"
			}
		case c.Method == http.MethodPost:
			var body map[string]json.RawMessage
			if json.Unmarshal([]byte(c.Body), &body) != nil || len(body) != 2 || body["name"] == nil || body["labels"] == nil {
				bad = "a body other than a name and labels"
			}
		}
		if bad != "" {
			out = append(out, fmt.Sprintf("%s %s with %s: %q", c.Method, c.Route, bad, c.Body))
		}
	}
	return out
}

// rateLimited counts an access token's call to /2.0/repositories/* in
// the rolling hour, sets Bitbucket's rate-limit headers, and reports a
// call past HourlyLimit. Called with s.mu held.
func (s *Server) rateLimited(w http.ResponseWriter, r *http.Request) bool {
	if s.opt.HourlyLimit <= 0 || !strings.HasPrefix(r.URL.Path, "/2.0/repositories/") || !strings.HasPrefix(r.Header.Get("Authorization"), "Bearer ") {
		return false
	}
	now := time.Now()
	s.hour = slices.DeleteFunc(s.hour, func(t time.Time) bool { return now.Sub(t) >= time.Hour })
	over := len(s.hour) >= s.opt.HourlyLimit
	if !over {
		s.hour = append(s.hour, now)
	}
	left := s.opt.HourlyLimit - len(s.hour)
	h := w.Header()
	h.Set("X-RateLimit-Limit", strconv.Itoa(s.opt.HourlyLimit))
	h.Set("X-RateLimit-Resource", "api")
	h.Set("X-RateLimit-NearLimit", strconv.FormatBool(left*5 < s.opt.HourlyLimit))
	return over
}
