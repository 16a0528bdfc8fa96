package azurepipelines

import (
	"context"
	"fmt"
	"net/http"
	"strconv"

	"github.com/microsoft/azure-devops-go-api/azuredevops/v7/taskagent"

	"github.com/runfleet/runfleet/forge"
)

// Cordon disables an agent: the server assigns it no job, and the job it
// runs goes on.
func (d *Forge) Cordon(ctx context.Context, id int64) error {
	if err := d.disable(ctx, id); err != nil {
		return err
	}
	// Cordoned because it took a job: the kept listing counts it busy
	// until a listing read from now shows its job over.
	at := d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
		if i >= 0 {
			list[i].Cordoned, list[i].Status = true, forge.StatusBusy
		}
		return list
	})
	d.mu.Lock()
	d.cordoned[id] = at
	d.mu.Unlock()
	return nil
}

func (d *Forge) disable(ctx context.Context, id int64) error {
	api, poolID, err := d.pool(ctx)
	if err != nil {
		return err
	}
	agentID := int(id)
	err = d.call(ctx, "disable agent "+strconv.FormatInt(id, 10), func(ctx context.Context) error {
		_, err := api.UpdateAgent(ctx, taskagent.UpdateAgentArgs{
			PoolId: &poolID, AgentId: &agentID,
			Agent: &taskagent.TaskAgent{Id: &agentID, Enabled: new(false)},
		})
		return err
	})
	if status(err) == http.StatusNotFound {
		d.forget(id)
		return fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	}
	return err
}

// RemoveRunner deletes an agent unless a job is assigned to it. An agent
// that a listing since its cordon showed without a request has run its
// job, and no other can come to it: it is deleted at once. Any other is
// disabled first (unless the driver did already), so that no job is
// assigned to it while its requests are read, then deleted if it has none;
// one that has a job stays disabled, and goes once that job ends.
func (d *Forge) RemoveRunner(ctx context.Context, id int64) error {
	d.mu.Lock()
	done := d.idle[id]
	_, cordoned := d.cordoned[id]
	d.mu.Unlock()
	if !done {
		if !cordoned {
			if err := d.Cordon(ctx, id); err != nil {
				return err
			}
		}
		busy, err := d.assigned(ctx, id)
		if err != nil {
			return err
		}
		if busy != 0 {
			d.kept.Set(id, forge.StatusBusy)
			return fmt.Errorf("azure-pipelines agent %d runs request %d: %w", id, busy, forge.ErrBusy)
		}
	}
	return d.delete(ctx, id)
}

// RemoveExited deletes an agent whose process has exited: it takes no job
// any more, so neither disabling it nor reading its request is needed
// (forge.ExitedRemover).
func (d *Forge) RemoveExited(ctx context.Context, id int64) error { return d.delete(ctx, id) }

func (d *Forge) delete(ctx context.Context, id int64) error {
	api, poolID, err := d.pool(ctx)
	if err != nil {
		return err
	}
	agentID := int(id)
	err = d.call(ctx, "delete agent "+strconv.FormatInt(id, 10), func(ctx context.Context) error {
		return api.DeleteAgent(ctx, taskagent.DeleteAgentArgs{PoolId: &poolID, AgentId: &agentID})
	})
	if err == nil || status(err) == http.StatusNotFound {
		d.forget(id)
	}
	if status(err) == http.StatusNotFound {
		return fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	}
	return err
}

// assigned reads the request assigned to an agent: its id, 0 for none.
func (d *Forge) assigned(ctx context.Context, id int64) (uint64, error) {
	api, poolID, err := d.pool(ctx)
	if err != nil {
		return 0, err
	}
	agentID := int(id)
	var a *taskagent.TaskAgent
	err = d.call(ctx, "read agent "+strconv.FormatInt(id, 10), func(ctx context.Context) (err error) {
		a, err = api.GetAgent(ctx, taskagent.GetAgentArgs{PoolId: &poolID, AgentId: &agentID, IncludeAssignedRequest: new(true)})
		return err
	})
	switch {
	case status(err) == http.StatusNotFound:
		d.forget(id)
		return 0, fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	case err != nil:
		return 0, err
	case a.AssignedRequest == nil:
		return 0, nil
	case a.AssignedRequest.RequestId != nil:
		return *a.AssignedRequest.RequestId, nil
	}
	return 1, nil // assigned, though the server did not say which
}
