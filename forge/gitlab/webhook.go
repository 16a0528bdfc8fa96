package gitlab

import (
	"context"
	"crypto/subtle"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	gl "gitlab.com/gitlab-org/api/client-go"

	"github.com/runfleet/runfleet/forge"
)

// hookLabelTimeout bounds the read of a queued job's tags while a Job
// Hook waits for its answer: GitLab gives a hook 10 s, and disables one
// that keeps failing.
const hookLabelTimeout = 5 * time.Second

// ParseWebhook authenticates a delivery by its X-Gitlab-Token (compared in
// constant time) and reads a Job Hook. A Job Hook carries no tags of the
// job, so a queued job's are read from the jobs API; if that fails the
// job is reported without them, and the next poll brings them.
func (d *Forge) ParseWebhook(r *http.Request, secret []byte) (forge.Delivery, error) {
	tok := gl.HookEventToken(r)
	if tok == "" {
		return forge.Delivery{}, fmt.Errorf("%w: no X-Gitlab-Token header", forge.ErrBadSignature)
	}
	if subtle.ConstantTimeCompare([]byte(tok), secret) != 1 {
		return forge.Delivery{}, fmt.Errorf("%w: X-Gitlab-Token is not the webhook secret", forge.ErrBadSignature)
	}
	dl := forge.Delivery{Event: string(gl.HookEventType(r))}
	if gl.HookEventType(r) != gl.EventTypeJob {
		return dl, nil
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return dl, fmt.Errorf("%w: %v", forge.ErrBadPayload, err)
	}
	parsed, err := gl.ParseWebhook(gl.EventTypeJob, body)
	if err != nil {
		return dl, fmt.Errorf("%w: job hook: %v", forge.ErrBadPayload, err)
	}
	e, ok := parsed.(*gl.JobEvent)
	if !ok || e.BuildID == 0 {
		return dl, fmt.Errorf("%w: job hook without a job", forge.ErrBadPayload)
	}
	st, conclusion := jobStatus(e.BuildStatus, e.BuildFailureReason)
	if st == 0 {
		return dl, nil // created, manual, scheduled: not runnable yet
	}
	j := forge.Job{
		ID: e.BuildID, RunID: e.PipelineID, Name: e.BuildName, Status: st, Conclusion: conclusion,
		// A retry is a new job; retries_count says how many came before.
		Attempt:  int(max(e.RetriesCount, 0)) + 1,
		RunnerID: e.Runner.ID, RunnerName: e.Runner.Description,
		CreatedAt: hookTime(e.BuildCreatedAt), StartedAt: hookTime(e.BuildStartedAt), EndedAt: hookTime(e.BuildFinishedAt),
		Source: forge.Source{Commit: e.SHA, Ref: e.Ref},
	}
	if e.User != nil {
		j.Source.Actor = e.User.Username
	}
	if e.Repository != nil {
		// The hook's repository has its page, not its path.
		if u, err := url.Parse(e.Repository.Homepage); err == nil {
			j.Source.Repository = strings.Trim(u.Path, "/")
		}
	}
	if conclusion == forge.ConclusionTimedOut {
		d.noteTimedOut(j.ID, e.ProjectID)
	}
	if st == forge.JobQueued {
		j.Labels = d.tags(r.Context(), e.ProjectID, e.BuildID)
		if !d.mayTake(r.Context(), e.ProjectID, e.Ref, e.Tag) {
			j.Labels = []string{NotProtected}
		}
	}
	dl.Job = &j
	return dl, nil
}

// tags reads a job's tag list; nil when it cannot be read.
func (d *Forge) tags(ctx context.Context, project, id int64) []string {
	ctx, cancel := context.WithTimeout(ctx, hookLabelTimeout)
	defer cancel()
	var tags []string
	err := d.call(ctx, fmt.Sprintf("read job %d", id), func(o gl.RequestOptionFunc) (*gl.Response, error) {
		j, resp, err := d.api.Jobs.GetJob(project, id, o)
		if err == nil {
			tags = j.TagList
		}
		return resp, err
	})
	if err != nil {
		d.log.Warn("job hook: could not read the job's tags; the next poll brings them", "job", id, "err", err)
		return nil
	}
	return d.labels(tags)
}

// hookTime reads a hook's time ("2021-02-23 02:41:37 UTC"); zero when
// absent or unreadable.
func hookTime(s string) time.Time {
	for _, layout := range []string{"2006-01-02 15:04:05 MST", "2006-01-02 15:04:05 -0700", time.RFC3339Nano} {
		if t, err := time.Parse(layout, s); err == nil {
			return t
		}
	}
	return time.Time{}
}
