package glsim

import (
	"crypto/subtle"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
)

// restRoutes are the calls a manager makes with an access token.
func (s *Server) restRoutes(mux *http.ServeMux) {
	api := func(pattern string, h http.HandlerFunc) {
		method, path, _ := strings.Cut(pattern, " ")
		full := method + " /api/v4" + path
		mux.HandleFunc(full, s.rest(full, h))
	}
	api("GET /projects/{id}", s.getProject)
	api("GET /groups/{id}", s.getGroup)
	api("POST /user/runners", s.createRunner)
	api("GET /projects/{id}/runners", s.listRunners)
	api("GET /groups/{id}/runners", s.listRunners)
	api("GET /runners/all", s.listRunners)
	api("GET /runners/{rid}", s.getRunner)
	api("PUT /runners/{rid}", s.updateRunner)
	api("DELETE /runners/{rid}", s.deleteRunner)
	api("POST /runners/{rid}/reset_authentication_token", s.resetRunnerToken)
	api("GET /runners/{rid}/jobs", s.runnerJobs)
	api("GET /projects/{id}/jobs", s.projectJobs)
	api("GET /projects/{id}/protected_branches", s.listProtectedBranches)
	api("GET /projects/{id}/jobs/{jid}", s.getJob)
	api("POST /projects/{id}/jobs/{jid}/cancel", s.cancelJob)
	api("POST /projects/{id}/jobs/{jid}/retry", s.retryJob)
}

// rest counts a call, answers 503 while down and 429 while the rate limit
// is exhausted, and checks the access token.
func (s *Server) rest(pattern string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.calls[pattern]++
		down, till := s.down, s.limitTill
		limited := time.Now().Before(till)
		if limited {
			s.limited++
		}
		s.mu.Unlock()
		if down {
			fail(w, http.StatusServiceUnavailable, "Service Unavailable")
			return
		}
		hd := w.Header()
		hd.Set("RateLimit-Limit", "2000")
		if limited {
			hd.Set("RateLimit-Remaining", "0")
			// The first whole second at which calls are taken again.
			hd.Set("RateLimit-Reset", strconv.FormatInt((till.UnixNano()+int64(time.Second)-1)/int64(time.Second), 10))
			hd.Set("RateLimit-ResetTime", till.UTC().Format(http.TimeFormat))
			hd.Set("Retry-After", strconv.Itoa(max(int(time.Until(till).Seconds()+0.999), 1)))
			writeJSON(w, http.StatusTooManyRequests, map[string]string{"message": "Retry later"})
			return
		}
		hd.Set("RateLimit-Remaining", "1999")
		tok := r.Header.Get("PRIVATE-TOKEN")
		if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			tok = b
		}
		if s.opt.Token == "" || subtle.ConstantTimeCompare([]byte(tok), []byte(s.opt.Token)) != 1 {
			fail(w, http.StatusUnauthorized, "Unauthorized")
			return
		}
		if need := s.scopeShort(r); need != nil {
			insufficientScope(w, need)
			return
		}
		h(w, r)
	}
}

// params reads a request's parameters from its query, form or JSON body,
// as Grape does.
func params(r *http.Request) (map[string]any, error) {
	out := map[string]any{}
	for k, v := range r.URL.Query() {
		out[k] = v[len(v)-1]
		if strings.HasSuffix(k, "[]") {
			out[strings.TrimSuffix(k, "[]")] = v
		}
	}
	if r.Body == nil {
		return out, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil || len(body) == 0 {
		return out, err
	}
	if strings.HasPrefix(r.Header.Get("Content-Type"), "application/json") {
		var m map[string]any
		if err := json.Unmarshal(body, &m); err != nil {
			return nil, err
		}
		for k, v := range m {
			out[k] = v
		}
		return out, nil
	}
	form, err := url.ParseQuery(string(body))
	if err != nil {
		return nil, err
	}
	for k, v := range form {
		out[strings.TrimSuffix(k, "[]")] = v[len(v)-1]
		if strings.HasSuffix(k, "[]") {
			out[strings.TrimSuffix(k, "[]")] = v
		}
	}
	return out, nil
}

func str(p map[string]any, k string) (string, bool) {
	switch v := p[k].(type) {
	case string:
		return v, true
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64), true
	case bool:
		return strconv.FormatBool(v), true
	}
	return "", false
}

func boolean(p map[string]any, k string, def bool) (bool, bool) {
	s, ok := str(p, k)
	if !ok {
		return def, true
	}
	b, err := strconv.ParseBool(s)
	return b, err == nil
}

func integer(p map[string]any, k string) (int64, bool, bool) {
	s, ok := str(p, k)
	if !ok {
		return 0, false, true
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, true, err == nil
}

// list reads an array parameter given as an array or a comma-separated
// string (both are accepted for tag_list).
func list(p map[string]any, k string) []string {
	var out []string
	switch v := p[k].(type) {
	case string:
		for _, t := range strings.Split(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				out = append(out, t)
			}
		}
	case []string:
		out = v
	case []any:
		for _, t := range v {
			if s, ok := t.(string); ok {
				out = append(out, s)
			}
		}
	}
	return out
}

// project finds a project by id or URL-encoded full path. Called with
// s.mu held.
func (s *Server) project(ref string) *project {
	return byRef(s.projects, ref, func(p *project) string { return p.Path })
}

func (s *Server) group(ref string) *group {
	return byRef(s.groups, ref, func(g *group) string { return g.Path })
}

// byRef finds a project or group by its id or its full path, as GitLab's
// :id parameters take either.
func byRef[T any](m map[int64]*T, ref string, path func(*T) string) *T {
	if id, err := strconv.ParseInt(ref, 10, 64); err == nil {
		return m[id]
	}
	for _, v := range m {
		if path(v) == ref {
			return v
		}
	}
	return nil
}

func (s *Server) getProject(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	p := s.project(r.PathValue("id"))
	s.mu.Unlock()
	if p == nil {
		fail(w, http.StatusNotFound, "Project Not Found")
		return
	}
	name := p.Path[strings.LastIndex(p.Path, "/")+1:]
	writeJSON(w, http.StatusOK, map[string]any{
		"id": p.ID, "name": name, "path": name, "path_with_namespace": p.Path,
		"web_url": s.URL + "/" + p.Path, "namespace": map[string]any{"id": p.GroupID, "kind": "group"},
	})
}

func (s *Server) getGroup(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	g := s.group(r.PathValue("id"))
	s.mu.Unlock()
	if g == nil {
		fail(w, http.StatusNotFound, "Group Not Found")
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": g.ID, "name": g.Path, "path": g.Path, "full_path": g.Path})
}

// createRunner is POST /user/runners.
func (s *Server) createRunner(w http.ResponseWriter, r *http.Request) {
	p, err := params(r)
	if err != nil {
		invalid(w, "the request body is not valid")
		return
	}
	typ, ok := str(p, "runner_type")
	switch {
	case !ok:
		invalid(w, "runner_type is missing")
		return
	case !slices.Contains([]string{"instance_type", "group_type", "project_type"}, typ):
		invalid(w, "runner_type does not have a valid value")
		return
	}
	run := &Runner{Type: typ}
	run.Description, _ = str(p, "description")
	run.Tags = list(p, "tag_list")
	var okU, okL, okP bool
	run.RunUntagged, okU = boolean(p, "run_untagged", true)
	run.Locked, okL = boolean(p, "locked", false)
	run.Paused, okP = boolean(p, "paused", false)
	timeout, _, okT := integer(p, "maximum_timeout")
	if !okU || !okL || !okP || !okT {
		invalid(w, "a parameter is invalid")
		return
	}
	run.MaximumTimeout = timeout
	run.AccessLevel = "not_protected"
	if al, ok := str(p, "access_level"); ok {
		if al != "not_protected" && al != "ref_protected" {
			invalid(w, "access_level does not have a valid value")
			return
		}
		run.AccessLevel = al
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch typ {
	case "instance_type":
		if !s.opt.Admin {
			fail(w, http.StatusForbidden, "Forbidden")
			return
		}
	case "group_type":
		id, _, _ := integer(p, "group_id")
		if s.groups[id] == nil {
			invalid(w, "group_id is missing")
			return
		}
		run.GroupID = id
	case "project_type":
		id, _, _ := integer(p, "project_id")
		if s.projects[id] == nil {
			invalid(w, "project_id is missing")
			return
		}
		run.ProjectID = id
	}
	// The model's validations, in GitLab's shape.
	errs := map[string][]string{}
	if !run.RunUntagged && len(run.Tags) == 0 {
		errs["tags_list"] = []string{"can not be empty when runner is not allowed to pick untagged jobs"}
	}
	if run.MaximumTimeout != 0 && run.MaximumTimeout < 600 {
		errs["maximum_timeout"] = []string{"needs to be at least 10 minutes"}
	}
	if len(errs) > 0 {
		writeJSON(w, http.StatusBadRequest, map[string]any{"message": errs})
		return
	}
	run.ID = s.id()
	run.Token = "glrt-t1_" + randHex(10)
	run.Tokens = []string{run.Token}
	s.runners[run.ID] = run
	writeJSON(w, http.StatusCreated, map[string]any{"id": run.ID, "token": run.Token, "token_expires_at": nil})
}

// status is GitLab's word for a runner's connection: online once it
// asked for a job within the last hour.
func (run *Runner) status() string {
	switch {
	case run.ContactedAt.IsZero():
		return "never_contacted"
	case time.Since(run.ContactedAt) < time.Hour:
		return "online"
	}
	return "offline"
}

func (run *Runner) brief() map[string]any {
	return map[string]any{
		"id": run.ID, "description": run.Description, "ip_address": "", "active": !run.Paused, "paused": run.Paused,
		"is_shared": run.Type == "instance_type", "runner_type": run.Type, "name": nil,
		"online": run.status() == "online", "status": run.status(),
	}
}

func (s *Server) listRunners(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	s.mu.Lock()
	var keep func(*Runner) bool
	switch {
	case strings.HasPrefix(r.URL.Path, "/api/v4/projects/"):
		p := s.project(r.PathValue("id"))
		if p == nil {
			s.mu.Unlock()
			fail(w, http.StatusNotFound, "Project Not Found")
			return
		}
		// A project's runners include its group's and the instance's.
		keep = func(run *Runner) bool {
			return run.ProjectID == p.ID || run.GroupID == p.GroupID || run.Type == "instance_type"
		}
	case strings.HasPrefix(r.URL.Path, "/api/v4/groups/"):
		g := s.group(r.PathValue("id"))
		if g == nil {
			s.mu.Unlock()
			fail(w, http.StatusNotFound, "Group Not Found")
			return
		}
		keep = func(run *Runner) bool {
			return run.GroupID == g.ID || run.ProjectID != 0 && s.projects[run.ProjectID].GroupID == g.ID
		}
	default:
		if !s.opt.Admin {
			s.mu.Unlock()
			fail(w, http.StatusForbidden, "Forbidden")
			return
		}
		keep = func(*Runner) bool { return true }
	}
	var all []map[string]any
	for _, id := range sortedKeys(s.runners) {
		run := s.runners[id]
		if run.Deleted || !keep(run) {
			continue
		}
		if t := q.Get("type"); t != "" && run.Type != t {
			continue
		}
		if st := q.Get("status"); st != "" && run.status() != st {
			continue
		}
		if tags := q.Get("tag_list"); tags != "" && !covers(run.Tags, strings.Split(tags, ",")) {
			continue
		}
		all = append(all, run.brief())
	}
	s.mu.Unlock()
	if all == nil {
		all = []map[string]any{}
	}
	writeJSON(w, http.StatusOK, page(w, r, all))
}

// runner finds a live runner by the {rid} path value. Called with s.mu
// held.
func (s *Server) runner(w http.ResponseWriter, r *http.Request) *Runner {
	id, _ := strconv.ParseInt(r.PathValue("rid"), 10, 64)
	run := s.runners[id]
	if run == nil || run.Deleted {
		fail(w, http.StatusNotFound, "Runner Not Found")
		return nil
	}
	return run
}

func (s *Server) details(run *Runner) map[string]any {
	d := run.brief()
	d["tag_list"] = nonNil(run.Tags)
	d["run_untagged"], d["locked"], d["access_level"] = run.RunUntagged, run.Locked, run.AccessLevel
	d["maximum_timeout"], d["maintenance_note"] = nil, nil
	if run.MaximumTimeout > 0 {
		d["maximum_timeout"] = run.MaximumTimeout
	}
	d["contacted_at"] = nil
	if !run.ContactedAt.IsZero() {
		d["contacted_at"] = run.ContactedAt.Format(time.RFC3339Nano)
	}
	projects := []map[string]any{}
	if p := s.projects[run.ProjectID]; p != nil {
		projects = append(projects, map[string]any{"id": p.ID, "path_with_namespace": p.Path})
	}
	d["projects"] = projects
	return d
}

func (s *Server) getRunner(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if run := s.runner(w, r); run != nil {
		writeJSON(w, http.StatusOK, s.details(run))
	}
}

func (s *Server) updateRunner(w http.ResponseWriter, r *http.Request) {
	p, err := params(r)
	if err != nil {
		invalid(w, "the request body is not valid")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	run := s.runner(w, r)
	if run == nil {
		return
	}
	paused, ok := boolean(p, "paused", run.Paused)
	if active, has := str(p, "active"); has {
		paused = active == "false"
	}
	if !ok {
		invalid(w, "paused is invalid")
		return
	}
	run.Paused = paused
	if _, has := p["tag_list"]; has {
		run.Tags = list(p, "tag_list")
	}
	writeJSON(w, http.StatusOK, s.details(run))
}

// resetRunnerToken is POST /runners/:id/reset_authentication_token
// (docs.gitlab.com/api/runners, "Reset runner's authentication token by
// using the runner ID"; gitlab-org/gitlab!69561): a new token, the old one
// refused from then on.
func (s *Server) resetRunnerToken(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if run := s.runner(w, r); run != nil {
		writeJSON(w, http.StatusCreated, run.reset())
	}
}

// reset gives the runner a new token. Called with s.mu held.
func (run *Runner) reset() map[string]any {
	run.Token = "glrt-t1_" + randHex(10)
	run.Tokens = append(run.Tokens, run.Token)
	return map[string]any{"token": run.Token, "token_expires_at": nil}
}

// listProtectedBranches is GET /projects/:id/protected_branches
// (docs.gitlab.com/api/protected_branches): each with its id and name.
func (s *Server) listProtectedBranches(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.project(r.PathValue("id")) == nil {
		fail(w, http.StatusNotFound, "404 Project Not Found")
		return
	}
	out := []map[string]any{}
	for i, name := range s.protectedBranches() {
		out = append(out, map[string]any{"id": i + 1, "name": name, "allow_force_push": false, "code_owner_approval_required": false,
			"push_access_levels": []any{}, "merge_access_levels": []any{}, "unprotect_access_levels": []any{}})
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteRunner deletes a runner whatever it runs, as GitLab does: its
// job carries on with its job token.
func (s *Server) deleteRunner(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if run := s.runner(w, r); run != nil {
		run.Deleted = true
		w.WriteHeader(http.StatusNoContent)
	}
}

func (s *Server) runnerJobs(w http.ResponseWriter, r *http.Request) {
	status := r.URL.Query().Get("status")
	if status != "" && !slices.Contains([]string{"running", "success", "failed", "canceled"}, status) {
		invalid(w, "status does not have a valid value")
		return
	}
	s.mu.Lock()
	run := s.runner(w, r)
	if run == nil {
		s.mu.Unlock()
		return
	}
	var all []map[string]any
	for _, id := range slices.Backward(sortedKeys(s.jobs)) {
		if j := s.jobs[id]; j.RunnerID == run.ID && (status == "" || j.Status == status) {
			// A runner's jobs name their project in full.
			out, p := s.jobJSON(j), s.projects[j.ProjectID]
			out["project"] = map[string]any{"id": p.ID, "name": p.Path[strings.LastIndex(p.Path, "/")+1:],
				"path_with_namespace": p.Path, "name_with_namespace": strings.ReplaceAll(p.Path, "/", " / ")}
			all = append(all, out)
		}
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, page(w, r, nonNil(all)))
}

var jobStates = []string{"created", "pending", "running", "failed", "success", "canceled", "skipped", "waiting_for_resource", "manual", "preparing", "scheduled", "canceling"}

func (s *Server) projectJobs(w http.ResponseWriter, r *http.Request) {
	p, _ := params(r)
	scope := list(p, "scope")
	for _, st := range scope {
		if !slices.Contains(jobStates, st) {
			invalid(w, "scope does not have a valid value")
			return
		}
	}
	s.mu.Lock()
	pr := s.project(r.PathValue("id"))
	if pr == nil {
		s.mu.Unlock()
		fail(w, http.StatusNotFound, "Project Not Found")
		return
	}
	var all []map[string]any
	for _, id := range slices.Backward(sortedKeys(s.jobs)) {
		if j := s.jobs[id]; j.ProjectID == pr.ID && (len(scope) == 0 || slices.Contains(scope, j.Status)) {
			all = append(all, s.jobJSON(j))
		}
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, page(w, r, nonNil(all)))
}

// job finds a project's job by the {id} and {jid} path values. Called
// with s.mu held.
func (s *Server) job(w http.ResponseWriter, r *http.Request) *Job {
	pr := s.project(r.PathValue("id"))
	if pr == nil {
		fail(w, http.StatusNotFound, "Project Not Found")
		return nil
	}
	id, _ := strconv.ParseInt(r.PathValue("jid"), 10, 64)
	j := s.jobs[id]
	if j == nil || j.ProjectID != pr.ID {
		fail(w, http.StatusNotFound, "Not found")
		return nil
	}
	return j
}

func (s *Server) getJob(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if j := s.job(w, r); j != nil {
		writeJSON(w, http.StatusOK, s.jobJSON(j))
	}
}

func (s *Server) cancelJob(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	j := s.job(w, r)
	if j == nil {
		s.mu.Unlock()
		return
	}
	changed := !j.Finished()
	if changed {
		s.finish(j, "canceled", "")
	}
	out, snap, path := s.jobJSON(j), *j, s.projects[j.ProjectID].Path
	s.mu.Unlock()
	if changed {
		s.deliver(snap, path)
	}
	writeJSON(w, http.StatusCreated, out)
}

// retryJob makes a new pending job of a finished one.
func (s *Server) retryJob(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	j := s.job(w, r)
	if j == nil {
		s.mu.Unlock()
		return
	}
	if !j.Finished() {
		s.mu.Unlock()
		fail(w, http.StatusForbidden, "Forbidden  - Job is not retryable")
		return
	}
	n := &Job{
		ID: s.id(), PipelineID: j.PipelineID, ProjectID: j.ProjectID, Name: j.Name, Stage: j.Stage,
		Tags: slices.Clone(j.Tags), Script: j.Script, Timeout: j.Timeout, Status: "pending",
		RetryOf: j.ID, CreatedAt: time.Now().UTC(), Ref: j.Ref, Protected: j.Protected,
	}
	s.jobs[n.ID] = n
	out, snap, path := s.jobJSON(n), *n, s.projects[n.ProjectID].Path
	s.mu.Unlock()
	s.deliver(snap, path)
	writeJSON(w, http.StatusCreated, out)
}

// jobJSON is a job as the jobs API shows it. Called with s.mu held.
func (s *Server) jobJSON(j *Job) map[string]any {
	t := func(at time.Time) any {
		if at.IsZero() {
			return nil
		}
		return at.Format(time.RFC3339Nano)
	}
	out := map[string]any{
		"id": j.ID, "name": j.Name, "stage": j.Stage, "status": j.Status, "ref": j.Ref, "tag": false,
		"allow_failure": false, "coverage": nil, "tag_list": nonNil(j.Tags),
		"created_at": t(j.CreatedAt), "started_at": t(j.StartedAt), "finished_at": t(j.FinishedAt), "erased_at": nil,
		"pipeline": map[string]any{"id": j.PipelineID, "project_id": j.ProjectID, "ref": j.Ref, "sha": sha, "status": j.Status},
		"web_url":  s.URL + "/" + s.projects[j.ProjectID].Path + "/-/jobs/" + strconv.FormatInt(j.ID, 10),
		"runner":   nil, "runner_manager": nil, "artifacts": []any{},
	}
	if j.FailureReason != "" {
		out["failure_reason"] = j.FailureReason
	}
	if !j.StartedAt.IsZero() && !j.FinishedAt.IsZero() {
		out["duration"] = j.FinishedAt.Sub(j.StartedAt).Seconds()
	}
	if run := s.runners[j.RunnerID]; run != nil && !run.Deleted {
		out["runner"] = run.brief()
	}
	return out
}

const sha = "2dc6aa325a317eda67812f05600bdf0fcdc70ab0"

func covers(have, want []string) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

func sortedKeys[V any](m map[int64]V) []int64 {
	keys := make([]int64, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
