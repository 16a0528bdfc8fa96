package gitlab

import (
	"context"
	"fmt"
	"slices"
	"time"

	gl "gitlab.com/gitlab-org/api/client-go"

	"github.com/runfleet/runfleet/forge"
)

// Lost re-runs, once, the job of a runner whose machine went away mid-job
// (a killed container, a spot instance taken back). GitLab would leave a
// job whose runner vanished running until its stuck-job cleanup, an hour
// later, so it is cancelled, then retried (POST
// /projects/:id/jobs/:job_id/cancel and /retry): the retry is a new
// pending job, which a fresh runner takes. A job the runner's agent
// failed as it was stopped (runner_system_failure) is retried as it is; a
// job that failed of itself (its script) is not.
func (d *Forge) Lost(ctx context.Context, r forge.Runner) {
	if r.ID == 0 {
		d.log.Warn("gitlab: a runner lost before its registration was seen; its job, if any, is not re-run", "runner", r.Name)
		return
	}
	d.losing.Go(ctx, r, func(ctx context.Context) {
		if err := d.rerunLost(ctx, r); err != nil && ctx.Err() == nil {
			d.log.Error("gitlab: could not re-run the job of a lost runner", "runner", r.Name, "id", r.ID, "err", err)
		}
	})
}

// lostFailures are the failure reasons of a job that failed with its
// runner, not of itself.
var lostFailures = []string{"runner_system_failure", "stuck_or_timeout_failure", "runner_unsupported", "job_canceled", "unknown_failure"}

// lostWindow is how recently a job that failed with its runner must have
// ended to be that runner's lost job.
const lostWindow = 10 * time.Minute

func (d *Forge) rerunLost(ctx context.Context, r forge.Runner) error {
	var jobs []*gl.Job
	err := d.call(ctx, fmt.Sprintf("jobs of lost runner %d", r.ID), func(o gl.RequestOptionFunc) (*gl.Response, error) {
		var resp *gl.Response
		var err error
		jobs, resp, err = d.api.Runners.ListRunnerJobs(r.ID, &gl.ListRunnerJobsOptions{
			ListOptions: gl.ListOptions{PerPage: 5}, OrderBy: gl.Ptr("id"), Sort: gl.Ptr("desc"),
		}, o)
		return resp, err
	})
	if err != nil {
		return err
	}
	for _, j := range jobs {
		lost := j.Status == "running" ||
			j.Status == "failed" && slices.Contains(lostFailures, j.FailureReason) && j.FinishedAt != nil && time.Since(*j.FinishedAt) < lostWindow
		if !lost || j.Project == nil {
			continue
		}
		d.mu.Lock()
		done := d.retried[j.ID]
		d.retried[j.ID] = true
		d.mu.Unlock()
		if done {
			continue
		}
		return d.retry(ctx, r, j)
	}
	d.log.Info("gitlab: the lost runner ran no job to re-run", "runner", r.Name, "id", r.ID)
	return nil
}

// retry cancels a job still running and retries it.
func (d *Forge) retry(ctx context.Context, r forge.Runner, j *gl.Job) error {
	pid := j.Project.ID
	if j.Status == "running" {
		err := d.call(ctx, fmt.Sprintf("cancel job %d", j.ID), func(o gl.RequestOptionFunc) (*gl.Response, error) {
			_, resp, err := d.api.Jobs.CancelJob(pid, j.ID, o)
			return resp, err
		})
		if err != nil {
			return err
		}
	}
	var n *gl.Job
	err := d.call(ctx, fmt.Sprintf("retry job %d", j.ID), func(o gl.RequestOptionFunc) (*gl.Response, error) {
		var resp *gl.Response
		var err error
		n, resp, err = d.api.Jobs.RetryJob(pid, j.ID, o)
		return resp, err
	})
	if err != nil {
		return err
	}
	d.log.Warn("gitlab: runner lost mid-job; its job was cancelled and retried", "runner", r.Name, "id", r.ID, "job", j.ID, "retry", n.ID)
	return nil
}

// maxTimedOut bounds the projects kept for jobs that timed out: a pool
// without rerun_on_timeout never asks for them.
const maxTimedOut = 1000

// noteTimedOut keeps the project of a job a hook reported timed out: a
// group's or the instance's driver needs it to retry the job.
func (d *Forge) noteTimedOut(job, project int64) {
	if project == 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.timedOut) >= maxTimedOut {
		clear(d.timedOut)
	}
	d.timedOut[job] = project
}

// RerunJob retries one ended job (POST /projects/:id/jobs/:job_id/retry):
// GitLab makes a new pending job of it, whose Job Hook's retries_count
// (its Attempt, less one) bounds rerun_on_timeout. The retry is not sent
// twice: a 5xx may follow a retry that was made.
func (d *Forge) RerunJob(ctx context.Context, j forge.Job) error {
	d.mu.Lock()
	pid, ok := d.timedOut[j.ID]
	delete(d.timedOut, j.ID)
	d.mu.Unlock()
	if !ok {
		if d.cfg.Scope.Kind != "project" {
			return fmt.Errorf("gitlab retry job %d: its project is unknown (no Job Hook reported it timed out)", j.ID)
		}
		var err error
		if pid, err = d.resolve(ctx); err != nil {
			return err
		}
	}
	var n *gl.Job
	err := d.call(ctx, fmt.Sprintf("retry job %d", j.ID), func(o gl.RequestOptionFunc) (*gl.Response, error) {
		var resp *gl.Response
		var err error
		n, resp, err = d.api.Jobs.RetryJob(pid, j.ID, o, gl.WithRequestRetry(retryUnsent))
		return resp, err
	})
	if err != nil {
		if definitive(err) {
			return fmt.Errorf("%w: %w", forge.ErrRejected, err)
		}
		return err
	}
	d.log.Info("gitlab: job retried", "job", j.ID, "retry", n.ID, "attempt", j.Attempt+1)
	return nil
}

// Drain ends the re-runs under way (forge.Drainer).
func (d *Forge) Drain(ctx context.Context) { d.losing.Stop(ctx) }
