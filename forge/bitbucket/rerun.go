package bitbucket

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// rerunPoll is how often the pipeline of a lost step is read until it
// ends; rerunWait bounds that wait (Bitbucket stops a step after 120
// minutes, and fails a step whose runner went away long before).
var (
	rerunPoll = 10 * time.Second
	rerunWait = 3 * time.Hour
)

// Lost re-runs the pipeline of a step whose runner's machine went away
// while it ran it (a spot instance taken back, a killed container).
// Bitbucket's API re-runs no single step, so once the pipeline has ended,
// with that step failed, the driver runs a new pipeline on the same target
// (POST .../pipelines, documented as "Run a pipeline"): its ref, commit and
// selector, so the same steps run again. Once per pipeline; the step is
// the one the runner was last listed running.
func (d *Driver) Lost(ctx context.Context, r forge.Runner) {
	d.mu.Lock()
	stepUUID := d.steps[r.ID]
	d.mu.Unlock()
	if r.ID == 0 || stepUUID == "" {
		d.log.Warn("bitbucket: a runner lost without a step seen; nothing to re-run", "runner", r.Name)
		return
	}
	d.losing.Go(r, func() {
		if err := d.rerunLost(ctx, stepUUID); err != nil && ctx.Err() == nil {
			d.log.Error("bitbucket: could not re-run the pipeline of a lost step", "runner", r.Name, "step", stepUUID, "err", err)
		}
	})
}

// fullPipeline is a pipeline with its target as Bitbucket gave it, to run
// it again.
type fullPipeline struct {
	pipeline
	RawTarget json.RawMessage `json:"target"`
}

func (d *Driver) rerunLost(ctx context.Context, stepUUID string) error {
	repo, pl, err := d.pipelineOf(ctx, stepUUID)
	if err != nil || pl == nil {
		return err
	}
	base := repoPath(d.cfg.Workspace, repo) + "/pipelines"
	for start := time.Now(); pl.State.Name != "COMPLETED"; {
		if time.Since(start) > rerunWait {
			return fmt.Errorf("pipeline %s did not end within %s", pl.UUID, rerunWait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(rerunPoll):
		}
		var next fullPipeline
		if err := d.call(ctx, "read pipeline "+pl.UUID, http.MethodGet, base+"/"+url.PathEscape(pl.UUID), nil, &next); err != nil {
			d.log.Warn("bitbucket: reading the pipeline of a lost step", "pipeline", pl.UUID, "err", err)
			continue
		}
		pl = &next
	}
	d.mu.Lock()
	done := d.rerun[pl.UUID]
	d.rerun[pl.UUID] = true
	d.mu.Unlock()
	if done {
		return nil
	}
	var ran pipeline
	if err := d.call(ctx, "run pipeline again", http.MethodPost, base, map[string]json.RawMessage{"target": pl.RawTarget}, &ran); err != nil {
		return err
	}
	d.log.Info("bitbucket: re-ran the pipeline of a step lost with its runner", "repository", repo, "lost_pipeline", pl.BuildNumber, "pipeline", ran.BuildNumber, "step", stepUUID)
	return nil
}

func rank(state string) int {
	if state == "IN_PROGRESS" {
		return 0
	}
	return 1
}

// pipelineOf finds the pipeline of a step among the latest pipelines of
// the repositories read for demand.
func (d *Driver) pipelineOf(ctx context.Context, stepUUID string) (string, *fullPipeline, error) {
	for _, repo := range d.demandRepos() {
		base := repoPath(d.cfg.Workspace, repo) + "/pipelines"
		var p page[fullPipeline]
		if err := d.call(ctx, "list pipelines of "+repo, http.MethodGet, base+"?sort=-created_on&pagelen=20", nil, &p); err != nil {
			return "", nil, err
		}
		// The lost step's pipeline is most likely still running.
		slices.SortStableFunc(p.Values, func(a, b fullPipeline) int {
			return cmp.Compare(rank(a.State.Name), rank(b.State.Name))
		})
		for i := range p.Values {
			steps, err := listAll[step](ctx, d, "list steps of pipeline "+p.Values[i].UUID, base+"/"+url.PathEscape(p.Values[i].UUID)+"/steps?pagelen=100")
			if err != nil {
				return "", nil, err
			}
			for _, s := range steps {
				if s.UUID == stepUUID {
					return repo, &p.Values[i], nil
				}
			}
		}
	}
	d.log.Warn("bitbucket: the pipeline of a lost step is not among the latest; not re-run", "step", stepUUID)
	return "", nil, nil
}
