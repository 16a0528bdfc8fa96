package glsim

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"time"
)

// deliver sends a Job Hook for a job's status, in the payload GitLab
// documents (webhook_events: job events), from its own goroutine.
func (s *Server) deliver(j Job, projectPath string) {
	if s.opt.HookURL == "" {
		return
	}
	t := func(at time.Time) any {
		if at.IsZero() {
			return nil
		}
		return at.Format("2006-01-02 15:04:05 MST")
	}
	var duration any
	if !j.StartedAt.IsZero() && !j.FinishedAt.IsZero() {
		duration = j.FinishedAt.Sub(j.StartedAt).Seconds()
	}
	var failure any
	if j.FailureReason != "" {
		failure = j.FailureReason
	}
	runner := any(nil)
	s.mu.Lock()
	retries := s.retries(j)
	if run := s.runners[j.RunnerID]; run != nil {
		runner = map[string]any{
			"id": run.ID, "description": run.Description, "runner_type": run.Type, "active": !run.Paused,
			"is_shared": run.Type == "instance_type", "tags": nonNil(run.Tags),
		}
	}
	s.mu.Unlock()
	name := projectPath[strings.LastIndex(projectPath, "/")+1:]
	body, _ := json.Marshal(map[string]any{
		"object_kind": "build", "ref": j.Ref, "tag": false, "before_sha": sha, "sha": sha,
		"build_id": j.ID, "build_name": j.Name, "build_stage": j.Stage, "build_status": j.Status,
		"build_created_at": t(j.CreatedAt), "build_started_at": t(j.StartedAt), "build_finished_at": t(j.FinishedAt),
		"build_duration": duration, "build_queued_duration": nil, "build_allow_failure": false,
		"build_failure_reason": failure, "retries_count": retries, "pipeline_id": j.PipelineID,
		"project_id": j.ProjectID, "project_name": "acme / " + name,
		"user":   map[string]any{"id": 1, "name": "Administrator", "username": "root", "email": "[REDACTED]"},
		"commit": map[string]any{"id": j.PipelineID, "name": nil, "sha": sha, "message": "test\n", "status": j.Status},
		"repository": map[string]any{
			"name": name, "url": s.URL + "/" + projectPath + ".git", "homepage": s.URL + "/" + projectPath,
			"git_http_url": s.URL + "/" + projectPath + ".git", "visibility_level": 20,
		},
		"project": map[string]any{
			"id": j.ProjectID, "name": name, "path_with_namespace": projectPath, "web_url": s.URL + "/" + projectPath,
		},
		"runner": runner, "environment": nil,
	})
	s.hooks.Go(func() {
		req, err := http.NewRequest("POST", s.opt.HookURL, bytes.NewReader(body))
		if err != nil {
			return
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("User-Agent", "GitLab/18.6.0")
		req.Header.Set("X-Gitlab-Event", "Job Hook")
		req.Header.Set("X-Gitlab-Token", s.opt.HookSecret)
		req.Header.Set("X-Gitlab-Event-UUID", randHex(16))
		req.Header.Set("X-Gitlab-Instance", s.URL)
		code := 0
		if resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req); err == nil {
			code = resp.StatusCode
			resp.Body.Close()
		}
		s.mu.Lock()
		s.deliveries[code]++
		s.mu.Unlock()
	})
}

// retries counts the retries before a job: the jobs it retries, one
// after the other, as GitLab's retries_count does. Called with s.mu held.
func (s *Server) retries(j Job) int {
	n := 0
	for at := j.RetryOf; at != 0 && n <= len(s.jobs); {
		n++
		prev := s.jobs[at]
		if prev == nil {
			break
		}
		at = prev.RetryOf
	}
	return n
}
