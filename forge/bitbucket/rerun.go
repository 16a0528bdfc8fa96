package bitbucket

import (
	"cmp"
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// Lost re-runs the pipeline of a step whose runner can no longer run it
// (a spot instance taken back, a killed container, a runner stopped after
// its step with the next one already given to it). Bitbucket's API
// re-runs no single step, so the driver runs a new pipeline on the same
// target (POST .../pipelines, documented as "Run a pipeline"): its ref,
// commit and selector, so the same steps run again. It does so at once,
// not once the lost pipeline ends: the step can only fail, and a manager
// that crashed while it waited would lose the re-run, since the next one
// learns of the step only while Bitbucket still holds it for the runner.
// Once per pipeline, across managers: a pipeline on the same target
// created after the lost one is its re-run (this manager's, an earlier
// one's or a person's). The step is the one the runner was last listed,
// disabled or read with.
func (d *Forge) Lost(ctx context.Context, r forge.Runner) {
	d.mu.Lock()
	stepUUID := d.steps[r.ID]
	d.mu.Unlock()
	if r.ID == 0 || stepUUID == "" {
		d.log.Warn("bitbucket: a runner lost without a step seen; nothing to re-run", "runner", r.Name)
		return
	}
	d.losing.Go(ctx, r, func(ctx context.Context) {
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

// target is what makes two pipelines runs of the same steps.
type target struct {
	RefType, RefName, Commit, Selector, Pattern string
}

func (p fullPipeline) target() target {
	var t struct {
		RefType string `json:"ref_type"`
		RefName string `json:"ref_name"`
		Commit  struct {
			Hash string `json:"hash"`
		} `json:"commit"`
		Selector struct {
			Type    string `json:"type"`
			Pattern string `json:"pattern"`
		} `json:"selector"`
	}
	_ = json.Unmarshal(p.RawTarget, &t) // an unreadable target matches no other
	return target{t.RefType, t.RefName, t.Commit.Hash, t.Selector.Type, t.Selector.Pattern}
}

func (d *Forge) rerunLost(ctx context.Context, stepUUID string) error {
	found, err := d.pipelineOf(ctx, stepUUID)
	if err != nil || found.pipeline == nil {
		return err
	}
	if st := found.step; st.State.Name == "COMPLETED" && (st.State.Result == nil || st.State.Result.Name != "ERROR") {
		d.log.Info("bitbucket: the step of a lost runner had ended; not re-run", "step", stepUUID, "state", st.State.Name)
		return nil
	}
	return d.rerunPipeline(ctx, found.repo, found.pipeline, found.newer, stepUUID)
}

// rerunPipeline runs a pipeline again on its target for a lost step,
// unless a pipeline among newer, those listed as created after it, runs
// on the same target, or this driver re-ran it already.
func (d *Forge) rerunPipeline(ctx context.Context, repo string, pl *fullPipeline, newer []fullPipeline, stepUUID string) error {
	if i := slices.IndexFunc(newer, func(p fullPipeline) bool { return p.target() == pl.target() }); i >= 0 {
		d.log.Info("bitbucket: the pipeline of a lost step was run again already", "lost_pipeline", pl.BuildNumber, "pipeline", newer[i].BuildNumber, "step", stepUUID)
		return nil
	}
	d.mu.Lock()
	done := d.rerun[pl.UUID]
	d.rerun[pl.UUID] = true
	d.mu.Unlock()
	if done {
		return nil
	}
	base := repoPath(d.cfg.Workspace, repo) + "/pipelines"
	var ran pipeline
	if err := d.call(ctx, "run pipeline again", http.MethodPost, base, map[string]json.RawMessage{"target": pl.RawTarget}, &ran); err != nil {
		d.mu.Lock()
		delete(d.rerun, pl.UUID) // the next report tries again
		d.mu.Unlock()
		return err
	}
	d.log.Info("bitbucket: re-ran the pipeline of a step lost with its runner", "repository", repo, "lost_pipeline", pl.BuildNumber, "pipeline", ran.BuildNumber, "step", stepUUID)
	return nil
}

// unrunWindow is how long ago a step that failed unrun may have ended for
// rescueUnrun to run its pipeline again.
const unrunWindow = 15 * time.Minute

// rescueUnrun runs again, once, each of the latest pipelines with a step
// that failed (ERROR) without ever starting, within unrunWindow, and that
// no newer pipeline on its target followed. Bitbucket gives an enabled
// runner its next step the moment its step ends; a runner whose step ended
// while no manager was up to disable it is stopped by its agent's script
// once it says it waits for the next one, and a runner that goes offline
// fails the step it was given there and then, so no listing need ever
// show the runner holding it (as Lost needs). Called once such a runner is
// deleted, in the background; a call while a scan runs makes it scan once
// more after. Running pipelines are read at every scan (the failed step's
// pipeline may still run others), ended ones that failed once.
func (d *Forge) rescueUnrun(ctx context.Context) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.scanning {
		d.scanAgain = true
		return
	}
	d.scanning = true
	d.losing.Start(ctx, "steps failed unrun", func(ctx context.Context) {
		for {
			if err := d.scanUnrun(ctx); err != nil && ctx.Err() == nil {
				d.log.Warn("bitbucket: could not look for steps that failed unrun", "err", err)
			}
			d.mu.Lock()
			again := d.scanAgain
			d.scanAgain, d.scanning = false, again
			d.mu.Unlock()
			if !again {
				return
			}
		}
	})
}

func (d *Forge) scanUnrun(ctx context.Context) error {
	for _, repo := range d.demandRepos() {
		base := repoPath(d.cfg.Workspace, repo) + "/pipelines"
		p, err := d.latestPipelines(ctx, repo, base)
		if err != nil {
			return err
		}
		for i := range p.Values {
			pl := &p.Values[i]
			switch {
			case pl.State.Name == "IN_PROGRESS":
			case pl.State.Name != "COMPLETED", pl.State.Result == nil, pl.State.Result.Name == "SUCCESSFUL", !d.firstLook(pl.UUID):
				continue
			}
			steps, err := d.stepsOf(ctx, base, pl.UUID)
			if err != nil {
				d.mu.Lock()
				delete(d.checked, pl.UUID)
				d.mu.Unlock()
				return err
			}
			if j := slices.IndexFunc(steps, failedUnrun); j >= 0 {
				if err := d.rerunPipeline(ctx, repo, pl, p.Values[:i], steps[j].UUID); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// firstLook reports whether an ended pipeline is looked at for the first
// time, and notes it.
func (d *Forge) firstLook(uuid string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.checked[uuid] {
		return false
	}
	if len(d.checked) >= maxKeptSteps {
		clear(d.checked)
	}
	d.checked[uuid] = true
	return true
}

// failedUnrun is a step that ended in error lately without ever starting.
func failedUnrun(s step) bool {
	return s.State.Name == "COMPLETED" && s.State.Result != nil && s.State.Result.Name == "ERROR" &&
		s.StartedOn == nil && s.CompletedOn != nil && time.Since(*s.CompletedOn) < unrunWindow
}

func rank(state string) int {
	if state == "IN_PROGRESS" {
		return 0
	}
	return 1
}

// stepFound is a step, its pipeline and repository, and the pipelines of
// that repository listed as created after it.
type stepFound struct {
	repo     string
	pipeline *fullPipeline
	step     step
	newer    []fullPipeline
}

// pipelineOf finds the pipeline of a step among the latest pipelines of
// the repositories read for demand.
func (d *Forge) pipelineOf(ctx context.Context, stepUUID string) (stepFound, error) {
	for _, repo := range d.demandRepos() {
		base := repoPath(d.cfg.Workspace, repo) + "/pipelines"
		p, err := d.latestPipelines(ctx, repo, base)
		if err != nil {
			return stepFound{}, err
		}
		// The lost step's pipeline is most likely still running: those
		// are read first, newest first within each state.
		order := make([]int, len(p.Values))
		for i := range order {
			order[i] = i
		}
		slices.SortStableFunc(order, func(a, b int) int {
			return cmp.Compare(rank(p.Values[a].State.Name), rank(p.Values[b].State.Name))
		})
		for _, i := range order {
			steps, err := d.stepsOf(ctx, base, p.Values[i].UUID)
			if err != nil {
				return stepFound{}, err
			}
			if j := slices.IndexFunc(steps, func(s step) bool { return s.UUID == stepUUID }); j >= 0 {
				return stepFound{repo: repo, pipeline: &p.Values[i], step: steps[j], newer: p.Values[:i]}, nil
			}
		}
	}
	d.log.Warn("bitbucket: the pipeline of a lost step is not among the latest; not re-run", "step", stepUUID)
	return stepFound{}, nil
}

// latestPipelines lists a repository's 20 newest pipelines, newest first;
// base is its pipelines' path.
func (d *Forge) latestPipelines(ctx context.Context, repo, base string) (page[fullPipeline], error) {
	var p page[fullPipeline]
	err := d.call(ctx, "list pipelines of "+repo, http.MethodGet, base+"?sort=-created_on&pagelen=20", nil, &p)
	return p, err
}

// stepsOf lists the steps of the pipeline uuid below base.
func (d *Forge) stepsOf(ctx context.Context, base, uuid string) ([]step, error) {
	return listAll[step](ctx, d, "list steps of pipeline "+uuid, base+"/"+url.PathEscape(uuid)+"/steps?pagelen=100")
}

// Drain ends the re-runs under way and a scan for steps that failed unrun
// (forge.Drainer).
func (d *Forge) Drain(ctx context.Context) { d.losing.Stop(ctx) }
