// Package demand tracks the jobs that wait for a runner, from a forge's
// webhooks and from polling its queue, and matches each to the pool that
// should serve it, so that pools grow when jobs queue and shrink when
// none do.
//
// Webhooks and polls report the same jobs, in any order and more than
// once: a job's state only moves forward (queued, in progress, completed),
// so a late or repeated report changes nothing.
package demand

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/forge"
)

// The job statuses a report may carry, in the order a job passes
// through them; the forge drivers map their forges' words to these.
const (
	Queued     = forge.JobQueued
	InProgress = forge.JobInProgress
	Completed  = forge.JobCompleted
)

// Job is a report of one job.
type Job struct {
	Forge      string // the config's forge name
	ID         int64
	RunID      int64
	Name       string
	Labels     []string
	Status     forge.JobStatus
	Conclusion string
	Attempt    int // of the run, from 1; 0 unknown
	Runner     string
	RunnerID   int64 // the runner's registration at the forge, never reused
	// When the forge says it was queued, started and completed; zero
	// where it does not say.
	Queued, Started, Completed time.Time
	URL                        string // the job's page, where the forge says
	Source                     forge.Source
}

// JobOf is the report of a job that a forge's driver read (from a
// webhook, or a poll of the queue) of the forge of that config name.
func JobOf(forgeName string, j forge.Job) Job {
	return Job{
		Forge: forgeName, ID: j.ID, RunID: j.RunID, Name: j.Name, Labels: j.Labels,
		Status: j.Status, Conclusion: j.Conclusion, Attempt: j.Attempt, Runner: j.RunnerName, RunnerID: j.RunnerID,
		Queued: j.CreatedAt, Started: j.StartedAt, Completed: j.EndedAt, URL: j.URL, Source: j.Source,
	}
}

// Pool is what the tracker knows of a pool.
type Pool struct {
	Name  string
	Forge string
	// Labels the pool's runners have, the forge's implicit ones
	// included (GitHub adds self-hosted, linux and x64).
	Labels []string
	// Meets decides whether runners with Labels meet a job's labels,
	// for forges whose jobs say more than label names
	// (forge.DemandMatcher); nil: every job label is among Labels,
	// case-insensitively.
	Meets func(labels, want []string) bool
}

// Event is what a report changed, for metrics and logs.
type Event struct {
	Job  Job
	Pool string // the pool the job is matched to; "" for none
	// New is set on the first report of a job; From is the status it
	// had before this report (0 when new).
	New  bool
	From forge.JobStatus
}

// maxQueued is how long a job stays queued at most: GitHub cancels a job
// that found no runner in 24 hours.
const maxQueued = 24 * time.Hour

// Tracker holds the jobs of every forge of a manager.
type Tracker struct {
	mu    sync.Mutex
	now   func() time.Time
	pools []Pool
	jobs  map[key]*entry
	// OnChange is called, without the lock held, for each report that
	// moves a job forward.
	onChange func(Event)
	keep     time.Duration // how long ended jobs are remembered
}

type key struct {
	forge string
	id    int64
}

type entry struct {
	job  Job
	pool string
	seen time.Time // first report, by our clock
}

// New returns a tracker for the pools, matched in their order.
func New(pools []Pool, onChange func(Event)) *Tracker {
	return &Tracker{now: time.Now, pools: pools, jobs: map[key]*entry{}, onChange: onChange, keep: time.Hour}
}

// SetPools replaces the pools (a reloaded config); queued jobs are matched
// again.
func (t *Tracker) SetPools(pools []Pool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.pools = pools
	for _, e := range t.jobs {
		if e.job.Status == Queued {
			e.pool = t.match(e.job)
		}
	}
}

// Match returns the pool that serves a job: the first, in config order,
// of the job's forge whose labels include all of the job's labels
// (case-insensitively, as the forges compare them) or, where the forge
// says how, meet them; "" for none.
func (t *Tracker) Match(j Job) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.match(j)
}

func (t *Tracker) match(j Job) string {
	for _, p := range t.pools {
		meets := Covers
		if p.Meets != nil {
			meets = p.Meets
		}
		if p.Forge == j.Forge && meets(p.Labels, j.Labels) {
			return p.Name
		}
	}
	return ""
}

// Covers reports whether every label wanted is among have,
// case-insensitively, as the forges compare them.
func Covers(have, want []string) bool {
	for _, w := range want {
		if !slices.ContainsFunc(have, func(h string) bool { return strings.EqualFold(h, w) }) {
			return false
		}
	}
	return true
}

// Observe records a report of a job. It reports whether the job moved
// forward; a duplicate, or a report older than what is known, changes
// nothing.
func (t *Tracker) Observe(j Job) bool {
	if j.Status == 0 {
		return false
	}
	t.mu.Lock()
	k := key{j.Forge, j.ID}
	e, ok := t.jobs[k]
	ev := Event{New: !ok}
	switch {
	case !ok:
		e = &entry{job: j, seen: t.now()}
		e.pool = t.match(j)
		t.jobs[k] = e
	case j.Status < e.job.Status, j.Status == e.job.Status && (j.RunnerID == 0 || e.job.RunnerID != 0):
		t.mu.Unlock()
		return false
	default:
		// Forward, or the same status with the runner that took it,
		// which a poll's inference lacked.
		ev.From = e.job.Status
		merge(&e.job, j)
	}
	if e.job.Queued.IsZero() && e.job.Status == Queued {
		e.job.Queued = e.seen
	}
	// A job seen to leave the queue without the forge saying when (a
	// poll no longer lists it) started about now.
	if e.job.Started.IsZero() && e.job.Status >= InProgress && (ev.New || ev.From == Queued) && !e.job.Queued.IsZero() {
		e.job.Started = t.now()
	}
	ev.Job, ev.Pool = e.job, e.pool
	t.mu.Unlock()
	if t.onChange != nil {
		t.onChange(ev)
	}
	return true
}

// merge takes what a newer report knows.
func merge(dst *Job, src Job) {
	dst.Status = src.Status
	if src.Name != "" {
		dst.Name = src.Name
	}
	if len(src.Labels) > 0 {
		dst.Labels = src.Labels
	}
	if src.Conclusion != "" {
		dst.Conclusion = src.Conclusion
	}
	if src.Attempt != 0 {
		dst.Attempt = src.Attempt
	}
	if src.Runner != "" {
		dst.Runner = src.Runner
	}
	if src.RunnerID != 0 {
		dst.RunnerID = src.RunnerID
	}
	if src.URL != "" {
		dst.URL = src.URL
	}
	if !src.Started.IsZero() {
		dst.Started = src.Started
	}
	if !src.Completed.IsZero() {
		dst.Completed = src.Completed
	}
	if dst.Queued.IsZero() {
		dst.Queued = src.Queued
	}
}

// Poll records a forge's whole queue as a poll read it, the listing asked
// for at listed: every job listed is queued, and a job known as queued
// since before listed that is not listed has left the queue (a runner
// took it, or it was cancelled), whether its report of leaving was lost
// or is still on its way. A job first reported after listed may be
// missing from the listing only because it is newer: it stays queued.
func (t *Tracker) Poll(forge string, queued []Job, listed time.Time) {
	ids := map[int64]bool{}
	for _, j := range queued {
		j.Forge, j.Status = forge, Queued
		ids[j.ID] = true
		t.Observe(j)
	}
	t.mu.Lock()
	var left []Job
	for k, e := range t.jobs {
		if k.forge == forge && e.job.Status == Queued && !ids[k.id] && e.seen.Before(listed) {
			j := e.job
			j.Status = InProgress
			left = append(left, j)
		}
	}
	t.mu.Unlock()
	for _, j := range left {
		t.Observe(j)
	}
}

// Queued returns the number of queued jobs matched to each pool. It also
// forgets jobs that ended long ago.
func (t *Tracker) Queued() map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	out := map[string]int{}
	for k, e := range t.jobs {
		switch {
		case e.job.Status == Queued && now.Sub(e.seen) > maxQueued:
			// Forges cancel a job queued this long; its report was lost.
			delete(t.jobs, k)
		case e.job.Status == Queued && e.pool != "":
			out[e.pool]++
		case e.job.Status == Completed && now.Sub(e.seen) > t.keep:
			delete(t.jobs, k)
		}
	}
	return out
}

// QueuedFor returns the number of queued jobs matched to one pool.
func (t *Tracker) QueuedFor(pool string) int { return t.Queued()[pool] }

// Unserved returns a pool's queued jobs less those that the pool's
// runners took lately (tookJob, their registration ids) without the
// tracker having heard of it yet. A runner is accounted for by a running
// or ended job that names its registration (a webhook), or else by a job seen
// leaving the queue within window that names none (a poll), which it
// then claims, so that one such job accounts for one runner only; the
// rest took jobs still counted as queued.
func (t *Tracker) Unserved(pool string, tookJob []int64, window time.Duration) int {
	queued := t.QueuedFor(pool)
	if len(tookJob) == 0 {
		return queued
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	named := map[int64]bool{}
	var anonymous []*entry
	for _, e := range t.jobs {
		if e.pool != pool || e.job.Status < InProgress {
			continue
		}
		if e.job.RunnerID != 0 {
			named[e.job.RunnerID] = true
		} else if now.Sub(e.job.Started) <= window {
			anonymous = append(anonymous, e)
		}
	}
	return max(0, queued-claim(tookJob, named, anonymous))
}

// claim accounts for the runners that took a job lately: one a report
// names is accounted for; each other claims the earliest of the jobs seen
// to leave the queue without a runner's name (anonymous), so that one such
// job accounts for one runner only. It returns how many are accounted for
// by neither: they took jobs still counted as queued. Called with t.mu
// held.
func claim(took []int64, named map[int64]bool, anonymous []*entry) (unknown int) {
	slices.SortFunc(anonymous, func(a, b *entry) int { return a.job.Started.Compare(b.job.Started) })
	for _, r := range took {
		switch {
		case named[r]:
		case len(anonymous) > 0:
			anonymous[0].job.RunnerID = r
			anonymous = anonymous[1:]
		default:
			unknown++
		}
	}
	return unknown
}

// Recent returns up to n jobs, the most recently reported first, and
// forgets jobs that ended long ago.
func (t *Tracker) Recent(n int) []JobView {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	var out []JobView
	for k, e := range t.jobs {
		if e.job.Status == Completed && now.Sub(e.seen) > t.keep {
			delete(t.jobs, k)
			continue
		}
		out = append(out, JobView{Job: e.job, Pool: e.pool, Seen: e.seen})
	}
	slices.SortFunc(out, func(a, b JobView) int { return b.Seen.Compare(a.Seen) })
	if len(out) > n {
		out = out[:n]
	}
	return out
}

// JobView is a job as the status page shows it.
type JobView struct {
	Job
	Pool string
	Seen time.Time
}

// Taken returns the runners (registration ids) of a forge that the tracker
// knows a job of: a report named the runner that took it.
func (t *Tracker) Taken(forge string) map[int64]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[int64]bool{}
	for k, e := range t.jobs {
		if k.forge == forge && e.job.RunnerID != 0 {
			out[e.job.RunnerID] = true
		}
	}
	return out
}

// UnservedShapes is Unserved for a pool whose jobs choose their machine:
// by shape (dynamic.Shape of a job's labels), the queued jobs that no
// runner of that shape took, given by shape the runners that took a job
// lately.
func (t *Tracker) UnservedShapes(pool string, took map[string][]int64, window time.Duration) map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	queued := map[string]int{}
	named := map[int64]bool{}
	anonymous := map[string][]*entry{}
	for _, e := range t.jobs {
		if e.pool != pool {
			continue
		}
		shape := dynamic.Shape(e.job.Labels)
		switch {
		case e.job.Status == Queued && now.Sub(e.seen) <= maxQueued:
			queued[shape]++
		case e.job.Status < InProgress:
		case e.job.RunnerID != 0:
			named[e.job.RunnerID] = true
		case now.Sub(e.job.Started) <= window:
			anonymous[shape] = append(anonymous[shape], e)
		}
	}
	for shape, ids := range took {
		queued[shape] -= claim(ids, named, anonymous[shape])
	}
	for shape, n := range queued {
		if n <= 0 {
			delete(queued, shape)
		}
	}
	return queued
}

// Fewer returns a queued job of a forge, served by a pool of this manager,
// that a runner with labels, made for jobs of shape, could take although
// it asks for another shape: its labels are all among the runner's. ok is
// false when there is none.
func (t *Tracker) Fewer(forge string, labels []string, shape string) (job string, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, e := range t.jobs {
		// Only a job a pool of this manager serves: one that waits for
		// another fleet's runners would hold this one for nothing.
		if k.forge != forge || e.job.Status != Queued || e.pool == "" || !Covers(labels, e.job.Labels) || dynamic.Shape(e.job.Labels) == shape {
			continue
		}
		return fmt.Sprintf("%d (%s: %s)", e.job.ID, e.job.Name, strings.Join(e.job.Labels, ", ")), true
	}
	return "", false
}
