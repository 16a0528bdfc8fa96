package gitea

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/forge"
)

// statuses maps Gitea's job status words, in the API and in workflow_job
// actions, to runfleet's: "queued" is a job a runner may take now;
// "waiting" is one blocked on its needs, which no runner can take yet, so
// it is left out.
var statuses = map[string]forge.JobStatus{
	"queued":      forge.JobQueued,
	"in_progress": forge.JobInProgress,
	"running":     forge.JobInProgress,
	"completed":   forge.JobCompleted,
	"success":     forge.JobCompleted,
	"failure":     forge.JobCompleted,
	"cancelled":   forge.JobCompleted,
	"skipped":     forge.JobCompleted,
}

// statusWords are the words the job list takes for each status.
var statusWords = map[forge.JobStatus]string{
	forge.JobQueued:     "queued",
	forge.JobInProgress: "in_progress",
	forge.JobCompleted:  "completed",
}

// cleanTime drops the placeholder Gitea writes for a time that has not
// come (the Unix epoch, for a job not yet completed).
func cleanTime(t time.Time) time.Time {
	if t.Year() < 2000 {
		return time.Time{}
	}
	return t
}

// job converts Gitea's job; action, when set, is a webhook's action,
// which tells the status before the job's own field does.
func job(j *sdk.ActionWorkflowJob, action string) forge.Job {
	st, ok := statuses[action]
	if !ok {
		st = statuses[j.Status]
	}
	return forge.Job{
		ID: j.ID, RunID: j.RunID, Name: j.Name, Labels: j.Labels, Status: st, Conclusion: j.Conclusion,
		RunnerID: j.RunnerID, RunnerName: j.RunnerName, Attempt: int(j.RunAttempt),
		CreatedAt: cleanTime(j.CreatedAt), StartedAt: cleanTime(j.StartedAt), EndedAt: cleanTime(j.CompletedAt),
		URL:    j.HTMLURL,
		Source: forge.Source{Commit: j.HeadSha, Ref: j.HeadBranch},
	}
}

// payload is Gitea's workflow_job delivery (api.WorkflowJobPayload); the
// job itself is the SDK's type.
type payload struct {
	Action      string                 `json:"action"`
	WorkflowJob *sdk.ActionWorkflowJob `json:"workflow_job"`
	Repository  *struct {
		FullName string `json:"full_name"`
	} `json:"repository"`
	Sender *struct {
		Login string `json:"login"`
	} `json:"sender"`
}

// ParseWebhook checks a delivery's X-Gitea-Signature (the hex HMAC-SHA256
// of the body) and reads its workflow_job event.
func (d *Forge) ParseWebhook(r *http.Request, secret []byte) (forge.Delivery, error) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return forge.Delivery{}, fmt.Errorf("%w: read body: %v", forge.ErrBadPayload, err)
	}
	sig, err := hex.DecodeString(r.Header.Get("X-Gitea-Signature"))
	if err != nil || len(sig) == 0 {
		return forge.Delivery{}, fmt.Errorf("%w: X-Gitea-Signature is missing or not hex", forge.ErrBadSignature)
	}
	mac := hmac.New(sha256.New, secret)
	mac.Write(body)
	if !hmac.Equal(sig, mac.Sum(nil)) {
		return forge.Delivery{}, forge.ErrBadSignature
	}
	event := r.Header.Get("X-Gitea-Event-Type")
	if event == "" {
		event = r.Header.Get("X-Gitea-Event")
	}
	dl := forge.Delivery{Event: event}
	if event != "workflow_job" {
		return dl, nil
	}
	var p payload
	if err := json.Unmarshal(body, &p); err != nil {
		return dl, fmt.Errorf("%w: workflow_job payload: %v", forge.ErrBadPayload, err)
	}
	if p.WorkflowJob == nil || p.WorkflowJob.ID == 0 {
		return dl, fmt.Errorf("%w: workflow_job payload without a job", forge.ErrBadPayload)
	}
	j := job(p.WorkflowJob, p.Action)
	if p.Repository != nil {
		j.Source.Repository = p.Repository.FullName
	}
	if p.Sender != nil {
		j.Source.Actor = p.Sender.Login
	}
	if j.Status == 0 {
		return dl, nil // an action runfleet has no use for ("waiting")
	}
	dl.Job = &j
	return dl, nil
}
