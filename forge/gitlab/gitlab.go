// Package gitlab is the forge driver for GitLab CI, on GitLab's own Go
// client (gitlab.com/gitlab-org/api/client-go).
//
// The manager creates one runner per slot with POST /user/runners, which
// answers with the runner's own glrt- token: that token, and nothing of
// the access token that created it, goes to the runner's agent
// (gitlab-runner run-single, in a config file of its own). A GitLab runner token
// is not single-use, so the manager deletes each runner once its one job
// has ended, and the runners a crashed manager left are found by their
// description (the runner's name) and removed by the pool and by
// `runfleet gc`.
package gitlab

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	gl "gitlab.com/gitlab-org/api/client-go"
	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
)

// Scope is where runners are created and jobs are read.
type Scope struct {
	Kind string // project, group or instance
	// Ref is the project's or group's full path ("acme/models") or
	// numeric id; empty for the instance.
	Ref string
}

// Config configures a Forge.
type Config struct {
	URL string
	// RunnerURL is GitLab's address as the runners see it; URL when
	// empty.
	RunnerURL string
	// Token is an access token allowed to create and delete runners in
	// Scope (a personal, group or project access token with the
	// create_runner and manage_runner scopes, or api).
	Token string
	Scope Scope
	// RunUntagged lets the runners take jobs without tags.
	RunUntagged bool
	// AccessLevel is the runners' access_level: ref_protected (the
	// default) takes only jobs of protected branches and tags;
	// not_protected takes any.
	AccessLevel string
	// MaximumTimeout caps the jobs' timeout on these runners; 0 leaves
	// the project's.
	MaximumTimeout time.Duration
	HTTPClient     *http.Client
	// CallTimeout bounds each call, its retries included (30s if 0).
	CallTimeout time.Duration
	// Budget paces the API calls (forge.Budgeted); nil is none.
	Budget *rate.Limiter
	// Owed keeps the lost runners\' re-runs the connection owes, for
	// the next manager (forge.Following.Ledger); nil keeps none.
	Owed forge.Ledger
	// SettleTime is how long RemoveRunner waits between pausing a runner
	// and reading its jobs, so that a job request already under way is
	// seen (1s if 0).
	SettleTime time.Duration
	// CacheTTL is how long a listing of runners is reused (15s if 0;
	// negative: never). The runners the driver creates, removes or finds
	// busy are updated in it at once; the agents' own output tells the
	// pool sooner than any listing when a job starts or ends.
	CacheTTL time.Duration
	Version  string
	Logger   *slog.Logger
}

// Forge talks to one GitLab instance in one scope.
type Forge struct {
	cfg   Config
	api   *gl.Client
	log   *slog.Logger
	calls atomic.Int64

	kept    forge.Kept // the listing of runners, between reads
	mu      sync.Mutex
	prot    protectedRefs   // the project's protected branches, for ref_protected runners
	scopeID int64           // the project's or group's id, once resolved
	losing  forge.Following // runners whose lost job is being re-run
	retried map[int64]bool  // jobs retried already
	// timedOut holds the project of each job a hook reported timed out,
	// for RerunJob outside a project scope; at most maxTimedOut.
	timedOut map[int64]int64
}

// Stats reports the calls sent. GitLab's RateLimit headers are read by
// the client, which waits out a 429 itself.
func (d *Forge) Stats() forge.Stats { return forge.Stats{Calls: d.calls.Load(), RateRemaining: -1} }

// New returns a driver. It makes no call.
func New(cfg Config) (*Forge, error) {
	if cfg.AccessLevel == "" {
		cfg.AccessLevel = AccessRefProtected
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.SettleTime <= 0 {
		cfg.SettleTime = time.Second
	}
	if cfg.CacheTTL == 0 {
		cfg.CacheTTL = 15 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.URL = strings.TrimRight(cfg.URL, "/")
	if cfg.RunnerURL == "" {
		cfg.RunnerURL = cfg.URL
	}
	d := &Forge{cfg: cfg, log: cfg.Logger, retried: map[int64]bool{}, timedOut: map[int64]int64{}}
	d.losing.Ledger = cfg.Owed
	hc := &http.Client{}
	if cfg.HTTPClient != nil {
		c := *cfg.HTTPClient
		hc = &c
	}
	hc.Transport = forge.Budgeted(forge.CountCalls(hc.Transport, &d.calls), cfg.Budget)
	if hc.Timeout <= 0 || hc.Timeout > cfg.CallTimeout {
		hc.Timeout = cfg.CallTimeout
	}
	api, err := gl.NewClient(cfg.Token,
		gl.WithBaseURL(cfg.URL+"/api/v4"),
		gl.WithHTTPClient(hc),
		// A call's retries (5xx, 429 until the reset) stay within its
		// timeout; beyond that the pool backs off.
		gl.WithCustomRetryMax(3),
		gl.WithUserAgent("runfleet/"+cmp.Or(cfg.Version, "dev")),
		// The budget above paces the calls. Without a limiter of its
		// own, the client sets one from the first answer's
		// RateLimit-Limit while other goroutines' calls read it: a data
		// race in client-go v1.46.0 (gitlab.go, configureLimiter and
		// Do), seen by -race when the pool and the poll call at once.
		gl.WithCustomLimiter(rate.NewLimiter(rate.Inf, 0)),
	)
	if err != nil {
		return nil, fmt.Errorf("gitlab client: %w", err)
	}
	d.api = api
	return d, nil
}

// call runs one API call with the call timeout. The timeout is on the
// context too: the client's retry waits are not bound by the HTTP
// client's own timeout.
func (d *Forge) call(ctx context.Context, what string, f func(opt gl.RequestOptionFunc) (*gl.Response, error)) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CallTimeout)
	defer cancel()
	if _, err := f(gl.WithContext(ctx)); err != nil {
		if need, ok := scopeShort(err); ok {
			return scopeError{fmt.Sprintf("gitlab %s (%s): the access token lacks the scope for it: GitLab takes %s (docs/forges/gitlab.md gives each call's)",
				what, d.where(), strings.Join(strings.Fields(need), " or ")), err}
		}
		return fmt.Errorf("gitlab %s (%s): %w", what, d.where(), err)
	}
	return nil
}

// scopeShort returns the scopes GitLab names when it refused a call for
// the token's scopes: 403 with insufficient_scope and the scopes that
// would do (lib/api/api_guard.rb, InsufficientScopeError).
func scopeShort(err error) (string, bool) {
	var e *gl.ErrorResponse
	if !errors.As(err, &e) || e.Response == nil || e.Response.StatusCode != http.StatusForbidden {
		return "", false
	}
	var b struct{ Error, Scope string }
	if json.Unmarshal(e.Body, &b) != nil || b.Error != "insufficient_scope" {
		return "", false
	}
	return b.Scope, true
}

// scopeError is a call refused for the token's scopes: no retry fixes it
// (forge.ErrRejected), and its words name the scopes, not the client's
// rendering of GitLab's body.
type scopeError struct {
	msg string
	err error
}

func (e scopeError) Error() string   { return e.msg }
func (e scopeError) Unwrap() []error { return []error{forge.ErrRejected, e.err} }

func (d *Forge) where() string {
	if d.cfg.Scope.Kind == "instance" {
		return "instance"
	}
	return d.cfg.Scope.Kind + " " + d.cfg.Scope.Ref
}

// status is an error's HTTP status, 0 when it has none.
func status(err error) int {
	if errors.Is(err, gl.ErrNotFound) { // the client's answer to every 404
		return http.StatusNotFound
	}
	var e *gl.ErrorResponse
	if errors.As(err, &e) && e.Response != nil {
		return e.Response.StatusCode
	}
	return 0
}

// definitive reports whether an answer is one that no retry can fix.
func definitive(err error) bool {
	switch status(err) {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound, http.StatusUnprocessableEntity:
		return true
	}
	return false
}

// scopeID resolves the project or group to its numeric id, once:
// POST /user/runners takes ids only.
func (d *Forge) resolve(ctx context.Context) (int64, error) {
	d.mu.Lock()
	id := d.scopeID
	d.mu.Unlock()
	if id != 0 || d.cfg.Scope.Kind == "instance" {
		return id, nil
	}
	if n, err := strconv.ParseInt(d.cfg.Scope.Ref, 10, 64); err == nil {
		id = n
	} else {
		err := d.call(ctx, "find "+d.cfg.Scope.Kind, func(opt gl.RequestOptionFunc) (*gl.Response, error) {
			if d.cfg.Scope.Kind == "group" {
				g, resp, err := d.api.Groups.GetGroup(d.cfg.Scope.Ref, nil, opt)
				if err == nil {
					id = g.ID
				}
				return resp, err
			}
			p, resp, err := d.api.Projects.GetProject(d.cfg.Scope.Ref, nil, opt)
			if err == nil {
				id = p.ID
			}
			return resp, err
		})
		if err != nil {
			if definitive(err) {
				return 0, fmt.Errorf("%w: %w", forge.ErrRejected, err)
			}
			return 0, err
		}
	}
	d.mu.Lock()
	d.scopeID = id
	d.mu.Unlock()
	return id, nil
}

// Credential environment: gitlab-runner reads its URL and token from
// these (common.RunnerCredentials), so neither is a process argument.
const (
	EnvURL   = "CI_SERVER_URL"
	EnvToken = "CI_SERVER_TOKEN"
)

// Register creates a runner of the scope's type with the pool's labels as
// its tags, locked to the scope, its description the runner's name.
func (d *Forge) Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	id, err := d.resolve(ctx)
	if err != nil {
		return forge.Credential{}, err
	}
	opt := &gl.CreateUserRunnerOptions{
		RunnerType:  gl.Ptr(d.cfg.Scope.Kind + "_type"),
		Description: gl.Ptr(req.Name),
		TagList:     &req.Labels,
		RunUntagged: gl.Ptr(d.cfg.RunUntagged),
		Locked:      gl.Ptr(true),
		AccessLevel: gl.Ptr(d.cfg.AccessLevel),
	}
	switch d.cfg.Scope.Kind {
	case "project":
		opt.ProjectID = gl.Ptr(id)
	case "group":
		opt.GroupID = gl.Ptr(id)
	}
	if d.cfg.MaximumTimeout > 0 {
		opt.MaximumTimeout = gl.Ptr(int64(d.cfg.MaximumTimeout.Seconds()))
	}
	var run *gl.UserRunner
	err = d.call(ctx, "create runner "+req.Name, func(o gl.RequestOptionFunc) (*gl.Response, error) {
		var resp *gl.Response
		var err error
		// Not retried once sent: a 5xx may follow a runner that was
		// made, and a second would be a duplicate. The pool retries
		// later, and removes a runner that has no machine.
		run, resp, err = d.api.Users.CreateUserRunner(opt, o, gl.WithRequestRetry(retryUnsent))
		return resp, err
	})
	if err != nil {
		if definitive(err) {
			return forge.Credential{}, fmt.Errorf("%w: %w", forge.ErrRejected, err)
		}
		// Sent but unanswered (cancelled by a drain, timed out, a 5xx):
		// GitLab may have made the runner. The kept listing would hide
		// it for a whole cache_ttl, and a drain would end with it left.
		d.kept.Drop()
		return forge.Credential{}, err
	}
	if run.ID == 0 || !strings.HasPrefix(run.Token, "glrt-") {
		return forge.Credential{}, fmt.Errorf("gitlab create runner %s: the answer has no runner token", req.Name)
	}
	d.kept.Change(run.ID, func(list []forge.Runner, i int) []forge.Runner {
		return append(list, forge.Runner{ID: run.ID, Name: req.Name, Status: forge.StatusOffline, Labels: req.Labels})
	})
	return forge.Credential{RunnerID: run.ID, Env: map[string]string{EnvURL: d.cfg.RunnerURL, EnvToken: run.Token}}, nil
}

// forget drops a removed runner from the kept listing.
func (d *Forge) forget(id int64) { d.kept.Forget(id) }

// retryUnsent retries a request GitLab did not take: rate limited (429,
// which GitLab answers before doing anything), or refused before it was
// sent.
func retryUnsent(ctx context.Context, resp *http.Response, err error) (bool, error) {
	if ctx.Err() != nil {
		return false, ctx.Err()
	}
	if err != nil {
		return strings.Contains(err.Error(), "connection refused"), nil
	}
	return resp.StatusCode == http.StatusTooManyRequests, nil
}

var _ retryablehttp.CheckRetry = retryUnsent

// Runners lists the scope's runners of its type. A project's runner is
// busy while one of the project's running jobs is its; in a group or the
// instance, where no one call lists the running jobs, runners are idle or
// offline as far as the listing tells, and RemoveRunner still refuses a
// busy one.
func (d *Forge) Runners(ctx context.Context) ([]forge.Runner, error) {
	list, ok, stamp := d.kept.Get(d.cfg.CacheTTL)
	if ok {
		return list, nil
	}
	list, err := d.listRunners(ctx)
	if err != nil {
		return nil, err
	}
	// A runner made or deleted while GitLab was read may be missing from
	// (or still in) this listing: kept, it would hide the change for a
	// whole cache_ttl, long enough for the pool to take a new runner's
	// machine for an orphan. Kept does not keep it then.
	d.kept.Keep(list, stamp, time.Now(), d.cfg.CacheTTL > 0)
	return list, nil
}

// listRunners reads the runners from GitLab.
func (d *Forge) listRunners(ctx context.Context) ([]forge.Runner, error) {
	id, err := d.resolve(ctx)
	if err != nil {
		return nil, err
	}
	typ := d.cfg.Scope.Kind + "_type"
	var out []forge.Runner
	for page := int64(1); page > 0; {
		var list []*gl.Runner
		var next int64
		err := d.call(ctx, "list runners", func(o gl.RequestOptionFunc) (*gl.Response, error) {
			lo := gl.ListOptions{Page: page, PerPage: 100}
			var resp *gl.Response
			var err error
			switch d.cfg.Scope.Kind {
			case "project":
				list, resp, err = d.api.Runners.ListProjectRunners(id, &gl.ListProjectRunnersOptions{ListOptions: lo, Type: &typ}, o)
			case "group":
				list, resp, err = d.api.Runners.ListGroupsRunners(id, &gl.ListGroupsRunnersOptions{ListOptions: lo, Type: &typ}, o)
			default:
				list, resp, err = d.api.Runners.ListAllRunners(&gl.ListRunnersOptions{ListOptions: lo, Type: &typ}, o)
			}
			if resp != nil {
				next = resp.NextPage
			}
			return resp, err
		})
		if err != nil {
			return nil, err
		}
		for _, r := range list {
			st := forge.StatusOffline
			if r.Status == "online" && !r.Paused {
				st = forge.StatusIdle
			}
			// GitLab says "offline" of a runner that contacted it, but not
			// within the last hours, "never_contacted" of one that did not
			// (https://docs.gitlab.com/api/runners/#list-owned-runners).
			out = append(out, forge.Runner{ID: r.ID, Name: r.Description, Status: st, Connected: r.Status == "online" || r.Status == "offline", Cordoned: r.Paused})
		}
		page = next
	}
	if d.cfg.Scope.Kind != "project" || len(out) == 0 {
		return out, nil
	}
	running, err := d.projectJobs(ctx, id, gl.Running)
	if err != nil {
		return nil, err
	}
	busy := map[int64]bool{}
	for _, j := range running {
		busy[j.Runner.ID] = true
	}
	for i := range out {
		if busy[out[i].ID] {
			out[i].Status = forge.StatusBusy
		}
	}
	return out, nil
}

// maxJobPages bounds a listing of jobs: 500 queued jobs are more than any
// pool's max.
const maxJobPages = 5

func (d *Forge) projectJobs(ctx context.Context, id int64, states ...gl.BuildStateValue) ([]*gl.Job, error) {
	var out []*gl.Job
	for page := int64(1); page > 0 && page <= maxJobPages; {
		var next int64
		err := d.call(ctx, "list jobs", func(o gl.RequestOptionFunc) (*gl.Response, error) {
			list, resp, err := d.api.Jobs.ListProjectJobs(id, &gl.ListJobsOptions{ListOptions: gl.ListOptions{Page: page, PerPage: 100}, Scope: &states}, o)
			out = append(out, list...)
			if resp != nil {
				next = resp.NextPage
			}
			return resp, err
		})
		if err != nil {
			return nil, err
		}
		page = next
	}
	return out, nil
}

// Cordon resets the token of a runner the moment it is seen to take its
// job, and pauses it (forge.Cordoner). gitlab-runner's --max-builds 1 is
// the runner's own word, and GitLab hands an active runner's token a job
// whenever it asks (lib/api/ci/runner.rb, POST /jobs/request checks only
// that the runner is active), also while its first job runs. The reset
// kills the token the job could read, which its runner's hooks wait for
// (tokenGuard); gitlab-runner needs it no more, reporting the job with
// the job's own token. The new token is thrown away. The pause comes
// second, so that a runner listed paused had its token reset (a pass
// that finds it paused cordons it no more), and shows in GitLab.
func (d *Forge) Cordon(ctx context.Context, id int64) error {
	err := d.call(ctx, "reset runner token "+strconv.FormatInt(id, 10), func(o gl.RequestOptionFunc) (*gl.Response, error) {
		_, resp, err := d.api.Runners.ResetRunnerAuthenticationToken(id, o)
		return resp, err
	})
	if err != nil {
		return d.gone(id, err)
	}
	return d.pause(ctx, id)
}

// gone is err, as forge.ErrNotFound (the runner forgotten) when GitLab
// answered 404.
func (d *Forge) gone(id int64, err error) error {
	if status(err) != http.StatusNotFound {
		return err
	}
	d.forget(id)
	return fmt.Errorf("%w: %w", forge.ErrNotFound, err)
}

// pause pauses a runner, marking it so in the kept listing.
func (d *Forge) pause(ctx context.Context, id int64) error {
	err := d.call(ctx, "pause runner "+strconv.FormatInt(id, 10), func(o gl.RequestOptionFunc) (*gl.Response, error) {
		_, resp, err := d.api.Runners.UpdateRunnerDetails(id, &gl.UpdateRunnerDetailsOptions{Paused: gl.Ptr(true)}, o)
		return resp, err
	})
	if err != nil {
		return d.gone(id, err)
	}
	d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
		if i >= 0 {
			list[i].Cordoned = true
		}
		return list
	})
	return nil
}

// RemoveRunner pauses the runner, so that it takes no job, waits for a
// request already under way, and deletes it unless it runs a job: GitLab
// would delete a busy runner, and its job would be lost.
func (d *Forge) RemoveRunner(ctx context.Context, id int64) error {
	what := "remove runner " + strconv.FormatInt(id, 10)
	if err := d.pause(ctx, id); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d.cfg.SettleTime):
	}
	var running []*gl.Job
	err := d.call(ctx, what, func(o gl.RequestOptionFunc) (*gl.Response, error) {
		var resp *gl.Response
		var err error
		running, resp, err = d.api.Runners.ListRunnerJobs(id, &gl.ListRunnerJobsOptions{Status: gl.Ptr("running")}, o)
		return resp, err
	})
	switch {
	case status(err) == http.StatusNotFound:
		return fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	case err != nil:
		return err
	case len(running) > 0:
		d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
			if i >= 0 {
				list[i].Status = forge.StatusBusy
			}
			return list
		})
		return fmt.Errorf("gitlab runner %d runs job %d: %w", id, running[0].ID, forge.ErrBusy)
	}
	err = d.call(ctx, what, func(o gl.RequestOptionFunc) (*gl.Response, error) {
		return d.api.Runners.DeleteRegisteredRunnerByID(id, o)
	})
	if err == nil || status(err) == http.StatusNotFound {
		d.forget(id)
	}
	if status(err) == http.StatusNotFound {
		return fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	}
	return err
}

// Jobs lists a project's jobs in a status: pending for queued, running
// for in progress. A group or the instance has no such listing.
func (d *Forge) Jobs(ctx context.Context, st forge.JobStatus) ([]forge.Job, error) {
	if d.cfg.Scope.Kind != "project" {
		return nil, fmt.Errorf("gitlab lists jobs per project, not per %s: %w", d.cfg.Scope.Kind, errors.ErrUnsupported)
	}
	id, err := d.resolve(ctx)
	if err != nil {
		return nil, err
	}
	var states []gl.BuildStateValue
	switch st {
	case forge.JobQueued:
		states = []gl.BuildStateValue{gl.Pending}
	case forge.JobInProgress:
		states = []gl.BuildStateValue{gl.Running}
	default:
		return nil, fmt.Errorf("gitlab jobs %s: %w", st, errors.ErrUnsupported)
	}
	list, err := d.projectJobs(ctx, id, states...)
	if err != nil {
		return nil, err
	}
	out := make([]forge.Job, 0, len(list))
	for _, j := range list {
		fj := job(j)
		if fj.Status == 0 {
			continue // not runnable yet: no demand
		}
		fj.Labels = d.labels(fj.Labels)
		if fj.Source.Repository == "" && strings.Contains(d.cfg.Scope.Ref, "/") {
			fj.Source.Repository = d.cfg.Scope.Ref // a path, not an id
		}
		if st == forge.JobQueued && !d.mayTake(ctx, id, j.Ref, j.Tag) {
			fj.Labels = []string{NotProtected}
		}
		out = append(out, fj)
	}
	return out, nil
}

// NoTags is the label of a job without tags when the runners do not run
// untagged jobs: no pool has it, so such a job starts no runner that
// could not take it.
const NoTags = "(no tags; run_untagged is off)"

// labels are a job's tags as demand matches them.
func (d *Forge) labels(tags []string) []string {
	if len(tags) == 0 && !d.cfg.RunUntagged {
		return []string{NoTags}
	}
	return tags
}

// job maps a job of the jobs API.
func job(j *gl.Job) forge.Job {
	out := forge.Job{
		ID: j.ID, RunID: j.Pipeline.ID, Name: j.Name, Labels: j.TagList,
		RunnerID: j.Runner.ID, RunnerName: j.Runner.Description, URL: j.WebURL,
		Source: forge.Source{Ref: j.Ref},
	}
	if j.Commit != nil {
		out.Source.Commit = j.Commit.ID
	}
	if j.User != nil {
		out.Source.Actor = j.User.Username
	}
	if j.Project != nil {
		out.Source.Repository = j.Project.PathWithNamespace
	}
	out.Status, out.Conclusion = jobStatus(j.Status, j.FailureReason)
	if j.CreatedAt != nil {
		out.CreatedAt = *j.CreatedAt
	}
	if j.StartedAt != nil {
		out.StartedAt = *j.StartedAt
	}
	if j.FinishedAt != nil {
		out.EndedAt = *j.FinishedAt
	}
	return out
}

// jobStatus maps GitLab's job statuses. Jobs not yet runnable (created:
// waiting on earlier stages; manual and scheduled: waiting on a person or
// a time) are no demand: 0.
func jobStatus(st, failure string) (forge.JobStatus, string) {
	switch st {
	case "pending", "waiting_for_resource", "preparing":
		return forge.JobQueued, ""
	case "running", "canceling":
		return forge.JobInProgress, ""
	case "success":
		return forge.JobCompleted, "success"
	case "failed":
		if failure == "job_execution_timeout" {
			return forge.JobCompleted, forge.ConclusionTimedOut
		}
		return forge.JobCompleted, "failure"
	case "canceled":
		return forge.JobCompleted, "cancelled"
	case "skipped":
		return forge.JobCompleted, "skipped"
	}
	return 0, "" // created, manual, scheduled
}

// Refresh drops the kept listing of runners (forge.Refresher).
func (d *Forge) Refresh() { d.kept.Drop() }

// JobLimit is a project's job timeout when it sets none: 60 minutes
// (docs.gitlab.com, "CI/CD pipelines settings", job timeout).
func (*Forge) JobLimit() time.Duration { return time.Hour }
