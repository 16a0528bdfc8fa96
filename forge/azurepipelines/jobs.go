package azurepipelines

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/microsoft/azure-devops-go-api/azuredevops/v7"
	"github.com/microsoft/azure-devops-go-api/azuredevops/v7/taskagent"

	"github.com/runfleet/runfleet/forge"
)

// jobRequestsLocation is the resource location of a pool's job requests
// (_apis/distributedtask/pools/{poolId}/jobrequests/{requestId}), as the
// agent's own client names it.
var jobRequestsLocation = uuid.MustParse("fc825784-c92a-4299-9221-998a02d1b54f")

// maxRequestPages bounds a listing of job requests: a pool's queue is not
// longer than a few pages of what the server sends at once.
const maxRequestPages = 5

// jobRequests lists the pool's job requests that have not finished. The Go
// client has no call for it (azure-devops-go-api issue 94), so it is
// written here by hand on the client's own Send (its location lookup, its
// authentication) and the driver's HTTP client (budget, counting, rate
// limits), following the continuation token the server sends while there
// are more.
func (d *Forge) jobRequests(ctx context.Context) (reqs []taskagent.TaskAgentJobRequest, complete bool, err error) {
	_, poolID, err := d.pool(ctx)
	if err != nil {
		return nil, false, err
	}
	d.mu.Lock()
	raw := d.raw
	d.mu.Unlock()
	var out []taskagent.TaskAgentJobRequest
	token := ""
	for range maxRequestPages {
		q := url.Values{"completedRequestCount": {"0"}}
		if token != "" {
			q.Set("continuationToken", token)
		}
		var page []taskagent.TaskAgentJobRequest
		err := d.call(ctx, "list job requests", func(ctx context.Context) error {
			resp, err := raw.Send(ctx, http.MethodGet, jobRequestsLocation, "7.1-preview.1",
				map[string]string{"poolId": strconv.Itoa(poolID)}, q, nil, "", "application/json", nil)
			if err != nil {
				return err
			}
			token = resp.Header.Get("X-MS-ContinuationToken")
			return raw.UnmarshalCollectionBody(resp, &page)
		})
		if err != nil {
			return nil, false, rejectDefinitive(err)
		}
		out = append(out, page...)
		if token == "" {
			return out, true, nil
		}
	}
	d.log.Warn("job requests: more pages than are read; the rest waits for the next poll", "pages", maxRequestPages)
	return out, false, nil
}

// Jobs lists the pool's job requests in a status: queued ones wait for an
// agent, those in progress have one.
func (d *Forge) Jobs(ctx context.Context, st forge.JobStatus) ([]forge.Job, error) {
	if st != forge.JobQueued && st != forge.JobInProgress {
		return nil, fmt.Errorf("azure-pipelines jobs %s: %w", st, errors.ErrUnsupported)
	}
	stamp := d.kept.Changes()
	reqs, complete, err := d.jobRequests(ctx)
	if err != nil {
		return nil, err
	}
	running := map[int64]bool{}
	var out []forge.Job
	for _, r := range reqs {
		j, ok := job(r)
		if !ok {
			continue
		}
		if j.RunnerID != 0 && j.Status != forge.JobCompleted {
			running[j.RunnerID] = true
		}
		// An agent of ours given a job is busy from now on: the kept
		// listing says so at once, so that the pass this poll wakes
		// cordons it before its job can end.
		if j.Status == forge.JobInProgress {
			d.kept.Set(j.RunnerID, forge.StatusBusy)
		}
		if j.Status == st {
			out = append(out, j)
		}
	}
	if complete { // a request left unread may be one of ours
		d.noteEnded(stamp, running)
	}
	return out, nil
}

// job maps a job request: queued until an agent is reserved for it, in
// progress until it has a result. Its labels are its demands.
func job(r taskagent.TaskAgentJobRequest) (forge.Job, bool) {
	if r.RequestId == nil {
		return forge.Job{}, false
	}
	j := forge.Job{ID: int64(*r.RequestId), Status: forge.JobQueued}
	if r.JobName != nil {
		j.Name = *r.JobName
	}
	if r.Owner != nil && r.Owner.Id != nil {
		j.RunID = int64(*r.Owner.Id)
		if j.Name == "" && r.Owner.Name != nil {
			j.Name = *r.Owner.Name
		}
	}
	// The pipeline it belongs to; a job request names no repository or
	// commit (those are the run's variables, which the agent alone gets).
	if r.Definition != nil && r.Definition.Name != nil {
		j.Source.Workflow = *r.Definition.Name
	}
	if r.Demands != nil {
		for _, dm := range *r.Demands {
			switch v := dm.(type) {
			case string:
				j.Labels = append(j.Labels, v)
			case map[string]any: // the object form some servers send
				name, _ := v["name"].(string)
				value, _ := v["value"].(string)
				if name != "" && value != "" {
					j.Labels = append(j.Labels, name+" -equals "+value)
				} else if name != "" {
					j.Labels = append(j.Labels, name)
				}
			}
		}
	}
	if r.ReservedAgent != nil && r.ReservedAgent.Id != nil {
		j.Status = forge.JobInProgress
		j.RunnerID = int64(*r.ReservedAgent.Id)
		if r.ReservedAgent.Name != nil {
			j.RunnerName = *r.ReservedAgent.Name
		}
	}
	if r.Result != nil {
		j.Status = forge.JobCompleted
		j.Conclusion = conclusion(string(*r.Result))
	}
	j.CreatedAt = timeOf(r.QueueTime)
	j.StartedAt = timeOf(r.AssignTime)
	j.EndedAt = timeOf(r.FinishTime)
	return j, true
}

// conclusion maps a TaskResult to the words the other forges use.
func conclusion(result string) string {
	switch strings.ToLower(result) {
	case "succeeded", "succeededwithissues":
		return "success"
	case "failed":
		return "failure"
	case "canceled", "abandoned":
		return "cancelled"
	case "skipped":
		return "skipped"
	}
	return strings.ToLower(result)
}

func timeOf(t *azuredevops.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.Time
}

// noteEnded marks the agents cordoned before a complete read began (of the
// agents, or of the unfinished job requests) that it showed running no
// job as done with their job: a cordoned agent gets no other, so
// RemoveRunner deletes it at once.
func (d *Forge) noteEnded(stamp int64, running map[int64]bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, at := range d.cordoned {
		if stamp >= at && !running[id] {
			d.idle[id] = true
		}
	}
}
