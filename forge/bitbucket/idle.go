package bitbucket

import (
	"time"

	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
)

// Bitbucket Cloud allows 1,000 calls an hour per user or token, over a
// rolling hour, for everything that token does (Bitbucket's "API request
// limits"; Atlassian's runners-autoscaler reads its runners every 600 s).
// A manager with nothing to do must not spend that: while no pipeline is
// pending or in progress and its runners are calm, the driver reads the
// runners every IdleCacheTTL and each repository's pipelines at a wait
// that doubles to IdlePollMax, each spending 4% of the connection's
// budget (every 100 s for the default 900 calls an hour: about 75 calls
// an hour in all); anything moving (a pipeline, a runner made, starting,
// busy or disabled) brings the usual pace back at once.

// idleShare is the share of the connection's hourly budget that each of
// the idle reads (runners, a repository's pipelines) may take.
const idleShare = 0.04

// idleGap is the wait between idle reads that spends idleShare of the
// budget: 2 minutes without a budget, at most 10.
func idleGap(budget *rate.Limiter) time.Duration {
	if budget == nil || budget.Limit() <= 0 || budget.Limit() == rate.Inf {
		return 2 * time.Minute
	}
	perHour := float64(budget.Limit()) * 3600
	return min(time.Duration(float64(time.Hour)/(perHour*idleShare)), 10*time.Minute)
}

// firstIdleGap is the wait after the first read that found nothing: the
// daemon's default poll interval, so that a single empty read changes
// nothing.
const firstIdleGap = 30 * time.Second

// pace is when a repository's pipelines are read next while it is idle.
type pace struct {
	next time.Time
	gap  time.Duration
}

// calm reports whether a listing of runners needs no watching: every
// runner online, idle and enabled (none made, starting, busy or
// disabled). A listing of none is calm.
func calm(list []forge.Runner) bool {
	for _, r := range list {
		if r.Status != forge.StatusIdle || !r.Connected || r.Cordoned {
			return false
		}
	}
	return true
}

// keptCalm is the kept listing, while it is calm and younger than
// IdleCacheTTL.
func (d *Forge) keptCalm() ([]forge.Runner, bool) {
	list, ok, _ := d.kept.Get(d.cfg.IdleCacheTTL)
	return list, ok && calm(list)
}

// skipRead reports whether repo's pipelines need not be read now: it was
// idle when last read, its wait has not passed, and the runners are calm.
func (d *Forge) skipRead(repo string) bool {
	if _, ok := d.keptCalm(); !ok {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	p := d.pace[repo]
	return p != nil && d.cfg.Clock().Before(p.next)
}

// paced notes what a read of repo's pipelines found: nothing pending or
// in progress doubles its wait, anything brings the usual pace back.
func (d *Forge) paced(repo string, busy bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if busy {
		delete(d.pace, repo)
		return
	}
	p := d.pace[repo]
	if p == nil {
		p = &pace{}
		d.pace[repo] = p
	}
	p.gap = min(max(2*p.gap, firstIdleGap), d.cfg.IdlePollMax)
	p.next = d.cfg.Clock().Add(p.gap)
}
