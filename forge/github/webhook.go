package github

import (
	"fmt"
	"net/http"

	gh "github.com/google/go-github/v92/github"

	"github.com/runfleet/runfleet/forge"
)

// ParseWebhook requires a delivery's X-Hub-Signature-256, checks it with
// go-github's ValidatePayload, and reads its workflow_job event; other
// events give no job.
func (d *Forge) ParseWebhook(r *http.Request, secret []byte) (forge.Delivery, error) {
	// ValidatePayload takes the legacy SHA-1 X-Hub-Signature when the
	// SHA-256 one is absent; SHA-1 is not accepted here.
	if r.Header.Get(gh.SHA256SignatureHeader) == "" {
		return forge.Delivery{}, fmt.Errorf("%w: no %s header (a SHA-1 %s alone is not accepted)", forge.ErrBadSignature, gh.SHA256SignatureHeader, gh.SHA1SignatureHeader)
	}
	payload, err := gh.ValidatePayload(r, secret)
	if err != nil {
		return forge.Delivery{}, fmt.Errorf("%w: %v", forge.ErrBadSignature, err)
	}
	dl := forge.Delivery{Event: gh.WebHookType(r)}
	if dl.Event != "workflow_job" {
		return dl, nil
	}
	parsed, err := gh.ParseWebHook(dl.Event, payload)
	if err != nil {
		return dl, fmt.Errorf("%w: workflow_job payload: %v", forge.ErrBadPayload, err)
	}
	e, ok := parsed.(*gh.WorkflowJobEvent)
	if !ok || e.WorkflowJob == nil || e.WorkflowJob.GetID() == 0 {
		return dl, fmt.Errorf("%w: workflow_job payload without a job", forge.ErrBadPayload)
	}
	j := job(e.WorkflowJob)
	// The delivery names the repository and who set the run going.
	j.Source.Repository, j.Source.Actor = e.GetRepo().GetFullName(), e.GetSender().GetLogin()
	if st, ok := statuses[e.GetAction()]; ok {
		j.Status = st // the action is the news; the job's field may lag
	}
	if j.Status == 0 {
		return dl, nil // an action runfleet has no use for ("waiting")
	}
	dl.Job = &j
	return dl, nil
}
