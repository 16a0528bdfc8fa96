package gitea

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/forge"
)

// Lost re-runs, once, the job of a runner whose machine went away
// mid-job (a spot instance taken back). Gitea re-runs only the jobs of a
// run that has ended, so the run is watched until it does (its runner
// stopped cleanly reports the job failed at once; a runner that vanished
// is failed by Gitea's zombie-task cleanup), then its failed jobs are
// re-run (POST .../runs/{run}/rerun-failed-jobs, Gitea 1.26).
func (d *Forge) Lost(ctx context.Context, r forge.Runner) {
	d.losing.Go(ctx, r, func(ctx context.Context) {
		if err := d.rerunLost(ctx, r); err != nil && ctx.Err() == nil {
			d.log.Error("gitea: could not re-run the job of a lost runner", "runner", r.Name, "id", r.ID, "err", err)
		}
	})
}

// Rerun's pacing: how often the lost job's run is read, and for how long.
var (
	RerunPoll = 5 * time.Second
	RerunWait = time.Hour
)

func (d *Forge) rerunLost(ctx context.Context, r forge.Runner) error {
	ctx, cancel := context.WithTimeout(ctx, RerunWait)
	defer cancel()
	j, err := d.lostJob(ctx, r)
	if err != nil || j == nil {
		if j == nil && err == nil {
			d.log.Info("gitea: the lost runner's job is not running or failed; nothing to re-run", "runner", r.Name, "id", r.ID)
		}
		return err
	}
	owner, repo, err := d.repoOf(j)
	if err != nil {
		return err
	}
	d.log.Warn("gitea: runner lost mid-job; its run's failed jobs are re-run once the run ends", "runner", r.Name, "id", r.ID, "job", j.ID, "run", j.RunID)
	t := time.NewTicker(RerunPoll)
	defer t.Stop()
	for {
		c, err := d.api(ctx)
		if err != nil {
			return err
		}
		run, resp, err := c.GetRepoActionRun(owner, repo, j.RunID)
		if err != nil {
			return apiError(fmt.Sprintf("get run %d", j.RunID), resp, err)
		}
		if run.Status == "completed" {
			return d.rerunOnce(ctx, c, owner, repo, r, run)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// lostJob finds the job the runner ran: in progress, or failed already
// (a runner stopped cleanly reports its job failed).
func (d *Forge) lostJob(ctx context.Context, r forge.Runner) (*sdk.ActionWorkflowJob, error) {
	for _, st := range []forge.JobStatus{forge.JobInProgress, forge.JobCompleted} {
		jobs, err := d.rawJobs(ctx, statusWords[st])
		if err != nil {
			return nil, err
		}
		for _, j := range jobs {
			if r.ID != 0 && j.RunnerID == r.ID || r.ID == 0 && st == forge.JobInProgress && j.RunnerName == r.Name {
				if st == forge.JobCompleted && j.Conclusion == "success" {
					return nil, nil
				}
				return j, nil
			}
		}
	}
	return nil, nil
}

// repoOf is the job's repository: the scope's, or, for an organisation or
// an instance, the one its run URL names (/repos/{owner}/{repo}/...).
func (d *Forge) repoOf(j *sdk.ActionWorkflowJob) (string, string, error) {
	if s := d.cfg.Scope; s.Kind == "repo" {
		return s.Owner, s.Repo, nil
	}
	u, err := url.Parse(j.RunURL)
	if err == nil {
		parts := strings.Split(u.Path, "/")
		for i := 0; i+2 < len(parts); i++ {
			if parts[i] == "repos" {
				return parts[i+1], parts[i+2], nil
			}
		}
	}
	return "", "", fmt.Errorf("job %d: no repository in its run URL %q", j.ID, j.RunURL)
}

// rerunOnce re-runs an ended run's failed jobs, unless it succeeded or
// was re-run already.
func (d *Forge) rerunOnce(ctx context.Context, c *sdk.Client, owner, repo string, r forge.Runner, run *sdk.ActionWorkflowRun) error {
	if run.Conclusion == "success" {
		d.log.Info("gitea: the lost runner's run succeeded; nothing to re-run", "runner", r.Name, "id", r.ID, "run", run.ID)
		return nil
	}
	d.mu.Lock()
	if d.reruns == nil {
		d.reruns = map[int64]bool{}
	}
	done := d.reruns[run.ID]
	d.reruns[run.ID] = true
	d.mu.Unlock()
	if done {
		// Two runners of one run lost together: one re-run of its
		// failed jobs re-runs both their jobs. Said for each, so that
		// no lost runner's job is left unaccounted for in the log.
		d.log.Info("gitea: re-ran the failed jobs of a run whose runner was lost, with another lost runner's", "runner", r.Name, "id", r.ID, "run", run.ID)
		return nil
	}
	resp, err := c.RerunRepoActionRunFailedJobs(owner, repo, run.ID)
	if err != nil {
		return apiError(fmt.Sprintf("re-run the failed jobs of run %d", run.ID), resp, err)
	}
	d.log.Info("gitea: re-ran the failed jobs of a run whose runner was lost", "runner", r.Name, "id", r.ID, "run", run.ID)
	return nil
}

// Drain ends the re-runs under way (forge.Drainer).
func (d *Forge) Drain(ctx context.Context) { d.losing.Stop(ctx) }
