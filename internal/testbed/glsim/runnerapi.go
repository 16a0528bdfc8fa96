package glsim

import (
	"cmp"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// runnerRoutes are the calls gitlab-runner makes with its own token and
// its jobs' tokens.
func (s *Server) runnerRoutes(mux *http.ServeMux) {
	handle := func(pattern string, h http.HandlerFunc) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			s.mu.Lock()
			s.calls[pattern]++
			down := s.down
			s.mu.Unlock()
			if down {
				fail(w, http.StatusServiceUnavailable, "Service Unavailable")
				return
			}
			h(w, r)
		})
	}
	handle("POST /api/v4/jobs/request", s.requestJob)
	handle("PUT /api/v4/jobs/{jid}", s.updateJob)
	handle("PATCH /api/v4/jobs/{jid}/trace", s.patchTrace)
	handle("POST /api/v4/runners/verify", s.verifyRunner)
	handle("POST /api/v4/runners/reset_authentication_token", s.resetOwnToken)
}

// verifyRunner is POST /runners/verify (docs.gitlab.com/api/runners,
// "Verify authentication for a registered runner"; lib/api/ci/runner.rb):
// 200 with the runner's id for a live token, 403 for any other, a reset
// or deleted runner's included. gitlab-runner's `verify` reads the 403 as
// "is not valid" (network/gitlab.go, VerifyRunner).
func (s *Server) verifyRunner(w http.ResponseWriter, r *http.Request) {
	s.withRunnerToken(w, r, func(run *Runner) {
		writeJSON(w, http.StatusOK, map[string]any{"id": run.ID, "token": run.Token, "token_expires_at": nil})
	})
}

// withRunnerToken calls f, with s.mu held, with the live runner whose
// token the request's body carries; 400 without a token, 403 for one no
// live runner holds.
func (s *Server) withRunnerToken(w http.ResponseWriter, r *http.Request, f func(*Runner)) {
	var req jobRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || req.Token == "" {
		invalid(w, "token is missing")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	run := s.runnerByToken(req.Token)
	if run == nil {
		fail(w, http.StatusForbidden, "Forbidden")
		return
	}
	f(run)
}

// resetOwnToken is POST /runners/reset_authentication_token with the
// runner's current token (docs.gitlab.com/api/runners, "Reset runner's
// authentication token by using the current token";
// gitlab-org/gitlab!74336): whoever holds a live token can swap it for a
// new one; a dead one is refused.
func (s *Server) resetOwnToken(w http.ResponseWriter, r *http.Request) {
	s.withRunnerToken(w, r, func(run *Runner) { writeJSON(w, http.StatusCreated, run.reset()) })
}

// jobRequest is common.JobRequest.
type jobRequest struct {
	Token      string          `json:"token"`
	SystemID   string          `json:"system_id"`
	LastUpdate string          `json:"last_update"`
	Info       json.RawMessage `json:"info"`
}

// requestJob hands the oldest pending job the runner may take to it.
func (s *Server) requestJob(w http.ResponseWriter, r *http.Request) {
	var req jobRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		invalid(w, "token is missing")
		return
	}
	if req.Token == "" {
		invalid(w, "token is missing")
		return
	}
	s.mu.Lock()
	run := s.runnerByToken(req.Token)
	if run == nil {
		s.mu.Unlock()
		fail(w, http.StatusForbidden, "Forbidden")
		return
	}
	run.ContactedAt = time.Now()
	w.Header().Set("X-GitLab-Last-Update", strconv.FormatInt(run.ContactedAt.UnixNano(), 36))
	j := s.nextJobFor(run)
	if j == nil {
		s.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
		return
	}
	j.Status, j.RunnerID, j.RunnerDescription = "running", run.ID, run.Description
	j.StartedAt, j.Token = time.Now().UTC(), "glcbt-"+randHex(12)
	payload := s.jobPayload(j)
	snap, path := *j, s.projects[j.ProjectID].Path
	s.mu.Unlock()
	s.deliver(snap, path)
	writeJSON(w, http.StatusCreated, payload)
}

// runnerByToken is the live runner holding a token. Called with s.mu held.
func (s *Server) runnerByToken(tok string) *Runner {
	for _, run := range s.runners {
		if !run.Deleted && subtle.ConstantTimeCompare([]byte(run.Token), []byte(tok)) == 1 {
			return run
		}
	}
	return nil
}

// nextJobFor is the oldest pending job a runner may take: one of its
// project (or group, or any for an instance runner) whose tags it has,
// untagged only when it runs untagged jobs; none while it is paused.
// Called with s.mu held.
func (s *Server) nextJobFor(run *Runner) *Job {
	if run.Paused {
		return nil
	}
	for _, id := range sortedKeys(s.jobs) {
		j := s.jobs[id]
		if j.Status != "pending" {
			continue
		}
		switch run.Type {
		case "project_type":
			if j.ProjectID != run.ProjectID {
				continue
			}
		case "group_type":
			if s.projects[j.ProjectID].GroupID != run.GroupID {
				continue
			}
		}
		if len(j.Tags) == 0 && !run.RunUntagged || !covers(run.Tags, j.Tags) {
			continue
		}
		if run.AccessLevel == "ref_protected" && !j.Protected {
			continue
		}
		return j
	}
	return nil
}

// jobPayload is spec.Job as the runner reads it. Called with s.mu held.
func (s *Server) jobPayload(j *Job) map[string]any {
	pr := s.projects[j.ProjectID]
	repo := fmt.Sprintf("%s/%s.git", s.runnerURL, pr.Path)
	if i := strings.Index(repo, "://"); i > 0 {
		repo = repo[:i+3] + "gitlab-ci-token:" + j.Token + "@" + repo[i+3:]
	}
	timeout := int(j.Timeout.Seconds())
	v := func(key, value string, public, masked bool) map[string]any {
		return map[string]any{"key": key, "value": value, "public": public, "masked": masked}
	}
	vars := []map[string]any{
		v("CI_JOB_ID", strconv.FormatInt(j.ID, 10), true, false),
		v("CI_JOB_NAME", j.Name, true, false),
		v("CI_JOB_STAGE", j.Stage, true, false),
		v("CI_JOB_TOKEN", j.Token, false, true),
		v("CI_PIPELINE_ID", strconv.FormatInt(j.PipelineID, 10), true, false),
		v("CI_PROJECT_ID", strconv.FormatInt(pr.ID, 10), true, false),
		v("CI_PROJECT_PATH", pr.Path, true, false),
		v("CI_SERVER_URL", s.runnerURL, true, false),
		v("CI_COMMIT_SHA", sha, true, false),
		v("CI_COMMIT_REF_NAME", "main", true, false),
		v("GITLAB_CI", "true", true, false),
	}
	return map[string]any{
		"id": j.ID, "token": j.Token, "allow_git_fetch": true,
		"job_info": map[string]any{
			"id": j.ID, "name": j.Name, "stage": j.Stage, "project_id": pr.ID,
			"project_name": pr.Path[strings.LastIndex(pr.Path, "/")+1:], "project_full_path": pr.Path,
			"pipeline_id": j.PipelineID, "time_in_queue_seconds": time.Since(j.CreatedAt).Seconds(),
		},
		"git_info": map[string]any{
			"repo_url": repo, "ref": j.Ref, "sha": sha, "before_sha": "0000000000000000000000000000000000000000",
			"ref_type": "branch", "refspecs": []string{"+refs/heads/" + j.Ref + ":refs/remotes/origin/" + j.Ref}, "depth": 20,
		},
		"runner_info": map[string]any{"timeout": timeout},
		"variables":   vars,
		"steps": []map[string]any{{
			"name": "script", "script": strings.Split(j.Script, "\n"), "timeout": timeout,
			"when": "on_success", "allow_failure": false,
		}},
		"image": map[string]any{"name": ""}, "services": []any{}, "artifacts": nil, "cache": []any{},
		"credentials": []map[string]any{{
			"type": "registry", "url": strings.TrimPrefix(s.runnerURL, "http://"),
			"username": "gitlab-ci-token", "password": j.Token,
		}},
		"dependencies": []any{},
		"features":     map[string]any{"trace_sections": true, "failure_reasons": []string{"unknown_failure", "script_failure", "runner_system_failure", "job_execution_timeout"}},
	}
}

// updateJob is PUT /jobs/:id: the job's state from its runner.
func (s *Server) updateJob(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Token         string `json:"token"`
		State         string `json:"state"`
		FailureReason string `json:"failure_reason"`
		ExitCode      int    `json:"exit_code"`
		Output        struct {
			Checksum string `json:"checksum"`
			Bytesize int    `json:"bytesize"`
		} `json:"output"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		invalid(w, "token is missing")
		return
	}
	s.mu.Lock()
	j := s.jobByToken(w, r, req.Token)
	if j == nil {
		s.mu.Unlock()
		return
	}
	w.Header().Set("X-GitLab-Trace-Update-Interval", "3")
	switch req.State {
	case "running", "":
		s.mu.Unlock()
		w.WriteHeader(http.StatusOK)
		return
	case "success", "failed":
	default:
		s.mu.Unlock()
		invalid(w, "state does not have a valid value")
		return
	}
	if req.Output.Bytesize > len(j.Trace) || s.opt.AcceptFinalLater && !j.finalAccepted {
		// The trace is not all here yet: the runner sends the rest and
		// asks again.
		j.finalAccepted = true
		s.mu.Unlock()
		w.WriteHeader(http.StatusAccepted)
		return
	}
	reason := ""
	if req.State == "failed" {
		reason = cmp.Or(req.FailureReason, "script_failure")
	}
	s.finish(j, req.State, reason)
	j.ExitCode = req.ExitCode
	snap, path := *j, s.projects[j.ProjectID].Path
	s.mu.Unlock()
	s.deliver(snap, path)
	w.WriteHeader(http.StatusOK)
}

// jobByToken finds the running job of the {jid} path value whose token is
// tok; it answers 403 (with Job-Status when the job has ended) and
// returns nil otherwise. Called with s.mu held.
func (s *Server) jobByToken(w http.ResponseWriter, r *http.Request, tok string) *Job {
	id, _ := strconv.ParseInt(r.PathValue("jid"), 10, 64)
	j := s.jobs[id]
	if j == nil {
		fail(w, http.StatusNotFound, "Not Found")
		return nil
	}
	if j.Token == "" || subtle.ConstantTimeCompare([]byte(j.Token), []byte(tok)) != 1 {
		fail(w, http.StatusForbidden, "Forbidden")
		return nil
	}
	if j.Status != "running" {
		w.Header().Set("Job-Status", j.Status)
		fail(w, http.StatusForbidden, "Forbidden")
		return nil
	}
	return j
}

// patchTrace is PATCH /jobs/:id/trace: a piece of the job's log, at the
// offset Content-Range says.
func (s *Server) patchTrace(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 4<<20))
	if err != nil {
		invalid(w, "body")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	j := s.jobByToken(w, r, r.Header.Get("JOB-TOKEN"))
	if j == nil {
		return
	}
	w.Header().Set("X-GitLab-Trace-Update-Interval", "3")
	w.Header().Set("Job-Status", j.Status)
	lo, hi, ok := contentRange(r.Header.Get("Content-Range"))
	if !ok || hi-lo+1 != len(body) {
		invalid(w, "Content-Range is missing or does not match the body")
		return
	}
	if lo != len(j.Trace) {
		w.Header().Set("Range", fmt.Sprintf("0-%d", len(j.Trace)))
		w.WriteHeader(http.StatusRequestedRangeNotSatisfiable)
		return
	}
	j.Trace = append(j.Trace, body...)
	w.Header().Set("Range", fmt.Sprintf("0-%d", len(j.Trace)))
	w.WriteHeader(http.StatusAccepted)
}

// contentRange reads "start-end", both inclusive.
func contentRange(v string) (lo, hi int, ok bool) {
	a, b, found := strings.Cut(v, "-")
	if !found {
		return 0, 0, false
	}
	lo, err1 := strconv.Atoi(a)
	hi, err2 := strconv.Atoi(b)
	return lo, hi, err1 == nil && err2 == nil && lo >= 0 && hi >= lo-1
}
