// Package forge defines what runfleet needs from a CI forge (Gitea, GitHub,
// GitLab, ...): registering single-use runners, listing and removing them,
// and the optional capabilities a forge may add (queued jobs, webhooks,
// re-running a lost job). Each forge has a driver in a sub-package, which
// registers itself with Register.
package forge

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

// ErrBusy is returned by RemoveRunner when the runner is running a job.
// A busy runner is never removed: its job would be lost.
var ErrBusy = errors.New("runner is busy")

// ErrNotFound is returned when a runner does not exist at the forge.
var ErrNotFound = errors.New("runner not found")

// ErrRejected is wrapped by an error of a request the forge refused as
// invalid (a 422 for labels it does not accept): no retry can fix it, so
// it is reported, not retried.
var ErrRejected = errors.New("the forge rejected the request")

// RunnerRequest asks the forge for a new single-use runner registration.
type RunnerRequest struct {
	Name   string
	Labels []string
	// OneRunnerOnly says that the credential will stay where the job
	// can read it for its machine's life (a cloud instance's boot
	// data): a forge whose only other credential enrols further runners
	// (GitHub's registration token, where just-in-time runners are not
	// offered) refuses, with ErrRejected.
	OneRunnerOnly bool
}

// Credential is what one runner needs to act as itself at the forge. It is
// single-use: it can take one job and cannot register further runners.
type Credential struct {
	RunnerID int64
	// Files are written into the runner's working directory, keyed by
	// relative path (gitea-runner's .runner, for instance). They hold
	// the runner's own token and so are written with mode 0600.
	Files map[string][]byte
	// Env is put in the agent's environment for credentials the agent
	// reads from there (GitHub's runner takes its JIT config from
	// ACTIONS_RUNNER_INPUT_JITCONFIG and clears it before any job step
	// runs), so that they are never a process argument.
	Env map[string]string
}

// Status is a runner's state as the forge sees it.
type Status string

const (
	StatusOffline Status = "offline" // registered, never connected or no longer connected
	StatusIdle    Status = "idle"    // connected and waiting for a job
	StatusBusy    Status = "busy"    // running a job
)

// Runner is a runner registration at the forge.
type Runner struct {
	ID     int64
	Name   string
	Status Status
	Labels []string
	// Cordoned is set when the forge gives the runner no further job
	// (Cordoner): it ran one, and once that ends it is done.
	Cordoned bool
	// Connected is set where the forge tells that the runner's agent
	// has reached it, though it is offline now (Bitbucket lists such a
	// runner OFFLINE, one that never connected UNREGISTERED): a runner
	// whose machine ended before a pass saw it online has served.
	Connected bool
}

// JobStatus is where a job is in its life. A job only moves forward
// through them, so a late or repeated report of an earlier status changes
// nothing. Each driver maps its forge's own words (queued, pending,
// running, success, ...) to these.
type JobStatus int

const (
	JobQueued JobStatus = iota + 1
	JobInProgress
	JobCompleted
)

func (s JobStatus) String() string {
	switch s {
	case JobQueued:
		return "queued"
	case JobInProgress:
		return "in_progress"
	case JobCompleted:
		return "completed"
	}
	return "unknown"
}

// Job is a workflow job as the forge reports it. Times the forge leaves
// unset are zero.
type Job struct {
	ID     int64
	RunID  int64
	Name   string
	Labels []string
	Status JobStatus
	// Conclusion is the forge's word for how it ended: success, failure,
	// ...; a driver reports a job its forge cancelled for hitting its
	// time limit as ConclusionTimedOut.
	Conclusion string
	Attempt    int   // the run's attempt the job belongs to, from 1; 0 unknown
	RunnerID   int64 // set once a runner has taken it; never reused
	RunnerName string
	CreatedAt  time.Time
	StartedAt  time.Time
	EndedAt    time.Time
	// URL is the job's page at the forge, where the forge says.
	URL string
	// Source is where the job's code came from, where the forge says.
	Source Source
}

// Source is where a job's code came from: the repository (owner/name, a
// project's path), the commit, the branch or tag, the workflow or
// pipeline, and who started the run. Empty fields are unknown.
type Source struct {
	Repository, Commit, Ref, Workflow, Actor string
}

// Forge is a CI forge that runfleet provides runners for.
type Forge interface {
	// Register creates a single-use registration for one runner.
	Register(ctx context.Context, req RunnerRequest) (Credential, error)
	// Runners lists the runner registrations in the forge's scope.
	Runners(ctx context.Context) ([]Runner, error)
	// RemoveRunner removes a registration. It returns ErrBusy, and
	// removes nothing, while the runner runs a job.
	RemoveRunner(ctx context.Context, id int64) error
}

// The optional capabilities of a Forge, found by type assertion.

// JobLister is implemented by forges whose jobs can be listed: a poll of
// the queue finds jobs whose webhook was lost.
type JobLister interface {
	// Jobs lists the jobs in the forge's scope with the given status. It
	// returns an error wrapping errors.ErrUnsupported where the forge
	// cannot list them in this scope (GitHub lists jobs per repository,
	// not per organisation).
	Jobs(ctx context.Context, status JobStatus) ([]Job, error)
}

// WebhookParser is implemented by forges that report jobs through
// webhooks.
type WebhookParser interface {
	// ParseWebhook authenticates a delivery with the forge's webhook
	// secret and reads the job it reports. The body is already limited
	// in size. A delivery that is not authentic is an error wrapping
	// ErrBadSignature; a malformed one wraps ErrBadPayload. A delivery
	// of another event, or of an action that says nothing runfleet uses,
	// has a nil Job.
	ParseWebhook(r *http.Request, secret []byte) (Delivery, error)
}

// Delivery is what one webhook delivery reported.
type Delivery struct {
	Event string // the forge's event name, for logs
	Job   *Job
}

// Errors of ParseWebhook.
var (
	ErrBadSignature = errors.New("signature does not match the webhook secret")
	ErrBadPayload   = errors.New("bad payload")
)

// Labeler is implemented by forges that give every runner labels of their
// own, which jobs may name in runs-on without a pool listing them
// (GitHub's self-hosted, linux, x64).
type Labeler interface {
	ImplicitLabels() []string
}

// Rerunner is implemented by forges that can re-run a job whose runner's
// machine went away mid-job (a spot instance taken back, a killed
// container).
type Rerunner interface {
	// Lost is told that the runner's machine is gone while it ran a job.
	// The runner's ID is 0 when the pool never saw its registration. It
	// must return at once; the re-run happens in the background, with
	// ctx's values, until it is done or the connection's Drain ends it
	// (Following).
	Lost(ctx context.Context, r Runner)
}

// Drainer is implemented by connections that do work in the background
// (a lost runner's job re-run once its run ends, Rerunner): Drain cancels
// it and waits for it to return, at most until ctx ends, so that none
// outlives the manager. The manager drains its connections after its
// pools; a re-run left undone is the next manager's, which finds the
// lost runner again or, where the forge deleted its registration
// meanwhile, in the connection's ledger (Env.Owed, Following.Ledger).
type Drainer interface {
	Drain(ctx context.Context)
}

// ConclusionTimedOut is the conclusion of a job that hit its time limit.
const ConclusionTimedOut = "timed_out"

// JobRerunner is implemented by forges that can re-run one ended job (a
// job that hit its time limit, for a pool with rerun_on_timeout).
type JobRerunner interface {
	RerunJob(ctx context.Context, j Job) error
}

// Refresher is implemented by forges whose driver keeps its listing of
// runners between reads (Kept): Refresh makes the next Runners read the
// forge, for when something has changed that the driver cannot see (a
// runner's machine ended: its agent may have reached the forge since the
// kept listing was read).
type Refresher interface {
	Refresh()
}

// EndObserver is implemented by forges whose driver keeps a list of
// runners between listings.
type EndObserver interface {
	// Ended is told that a runner's agent finished its job: the forge
	// deleted its ephemeral registration, which the driver learns
	// without a call.
	Ended(id int64)
}

// Demander is implemented by forges that say themselves how many runners
// their pool needs (GitHub's runner scale sets), in place of webhooks and
// polls of the queue. Such a forge serves one pool.
type Demander interface {
	// Listen holds the forge's session and follows its demand until ctx
	// ends, calling changed whenever the demand may have changed. It
	// closes the session before it returns; an error says why the
	// session ended early, and the caller opens another, with backoff.
	// max is the most runners the pool may run.
	Listen(ctx context.Context, max int, changed func()) error
	// Unserved returns how many jobs the forge assigned to the pool that
	// no runner has taken yet. took are the registrations of runners seen
	// taking a job lately, whose start the forge may not have reported.
	Unserved(took []int64) int
}

// JobLimiter is implemented by forges that end a job running longer than a
// limit of their own when the job does not set one (GitHub's 6 hours),
// for a pool that sets no job_timeout: a provider whose machines have a
// time limit (a Slurm job's --time) makes room for a job this long.
type JobLimiter interface {
	JobLimit() time.Duration
}

// Cordoner is implemented by forges whose runner agents cannot be trusted
// to stop after one job: Azure Pipelines' agent, whose `run --once` has
// taken a second job and has stayed registered after its first in the
// field, and Bitbucket's runner, which has no single-job mode at all. The
// pool cordons such a runner as soon as it sees it take a job (or, at the
// latest, its agent say the job ended), so that the forge hands it no
// other, and retires it once the forge lists it cordoned and idle, or its
// agent exits, whichever comes first.
type Cordoner interface {
	// Cordon stops the forge from giving the runner another job; the
	// job it runs goes on. Cordoning a cordoned runner is no error; a
	// runner that is gone is ErrNotFound.
	Cordon(ctx context.Context, id int64) error
}

// ExitedRemover is implemented by forges whose RemoveRunner guards a live
// runner with calls that an exited one does not need (Azure Pipelines
// disables an agent and reads its request before it deletes it, so that
// no job comes to it meanwhile; Bitbucket does the same with a runner): the pool removes the registration of a
// runner whose agent has exited, or whose machine is gone, with
// RemoveExited. An agent that no longer runs takes no job; one that held a
// job as it died has lost it already, and the forge fails it.
type ExitedRemover interface {
	RemoveExited(ctx context.Context, id int64) error
}

// Placeholder is implemented by a forge that fails a queued job at once
// when no runner registered in its pool could take it, offline and
// disabled ones included (Azure Pipelines): a pool that scales from zero,
// or whose runners all come and go, keeps there a registration that is
// never run, with the labels its runners have.
type Placeholder interface {
	// Placehold registers the pool's placeholder, or gives it these
	// labels; it changes nothing when it has them.
	Placehold(ctx context.Context, pool string, labels []string) error
}

// DemandMatcher is implemented by forges whose jobs ask for runners by more
// than label names (Azure Pipelines' demands: "cuda" for a capability that
// exists, "gpu -equals a100" for one with a value): it decides whether a
// pool whose runners have the labels meets a job's. A forge that does not
// implement it is matched by name: every job label among the pool's.
type DemandMatcher interface {
	Meets(labels, demands []string) bool
}

// StatsReporter is implemented by forges that count their API calls.
type StatsReporter interface {
	Stats() Stats
}

// Stats is what a driver counts.
type Stats struct {
	Calls int64 // HTTP requests sent
	// RateRemaining is the forge's last X-RateLimit-Remaining, -1 when
	// it sends none.
	RateRemaining int64
	// RateLimitWaits counts the waits for a rate-limit reset.
	RateLimitWaits int64
}

// Budgeted wraps a transport so that every request it sends waits for a
// token of the connection's budget: however a pool misbehaves, the
// connection sends no more than the budget allows. A request whose context
// ends first is not sent. A nil budget is none.
func Budgeted(next http.RoundTripper, budget *rate.Limiter) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	if budget == nil {
		return next
	}
	return budgeted{next: next, budget: budget}
}

type budgeted struct {
	next   http.RoundTripper
	budget *rate.Limiter
}

func (b budgeted) RoundTrip(r *http.Request) (*http.Response, error) {
	if err := b.budget.Wait(r.Context()); err != nil {
		return nil, fmt.Errorf("the forge connection's call budget: %w", err)
	}
	return b.next.RoundTrip(r)
}

// CountCalls wraps a transport so that every request it sends adds one to
// n, for a driver's call count (runfleet_forge_api_calls_total).
func CountCalls(next http.RoundTripper, n *atomic.Int64) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return counting{next: next, n: n}
}

// WithUserAgent returns a transport that names the client in every
// request's User-Agent, for a client library that offers no option of
// its own for it (or offers one per client of several, as Gitea's SDK
// and its runner service do).
func WithUserAgent(next http.RoundTripper, ua string) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return userAgent{next: next, ua: ua}
}

type userAgent struct {
	next http.RoundTripper
	ua   string
}

func (u userAgent) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context()) // a RoundTripper must not change its request
	r.Header.Set("User-Agent", u.ua)
	return u.next.RoundTrip(r)
}

type counting struct {
	next http.RoundTripper
	n    *atomic.Int64
}

func (c counting) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}
