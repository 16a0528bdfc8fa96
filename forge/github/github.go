// Package github is the GitHub Actions forge driver, on go-github.
//
// Runners are registered just in time: each gets a single-use JIT config
// from generate-jitconfig, which can run one job and cannot register
// further runners. Where JIT is not offered (an older GitHub Enterprise
// Server), the driver falls back to a registration token and an ephemeral
// runner, and says so in the log.
//
// The driver spends few API calls: the runner list is read at most once
// per CacheTTL and kept current in between from what the driver itself did
// (registered, removed) and from what the pool learns from the agents'
// logs. Rate limits are honoured: a call answered 403 or 429 with
// X-RateLimit-Remaining: 0 or Retry-After waits until the reset, then is
// tried again; every HTTP request is counted.
package github

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bradleyfalzon/ghinstallation/v2"
	gh "github.com/google/go-github/v92/github"
	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
)

// Environment variables through which GitHub's runner takes its
// credential (it reads ACTIONS_RUNNER_INPUT_<OPTION> like --<option>, and
// clears them before any job step runs), so that it is never a process
// argument.
const (
	EnvJITConfig = "ACTIONS_RUNNER_INPUT_JITCONFIG"
	EnvToken     = "ACTIONS_RUNNER_INPUT_TOKEN"
	EnvURL       = "ACTIONS_RUNNER_INPUT_URL"
)

// Config configures a Forge.
type Config struct {
	// URL is the repository (https://github.com/owner/repo) or the
	// organisation (https://github.com/org) whose runners are managed, on
	// github.com or a GitHub Enterprise Server.
	URL string
	// APIURL overrides the REST base derived from URL
	// (https://api.github.com/ or https://<host>/api/v3/).
	APIURL string
	// Token is a personal access token. Or a GitHub App: AppID,
	// InstallationID and PrivateKey (PEM).
	Token                 string
	AppID, InstallationID int64
	PrivateKey            []byte
	// RunnerGroupID is the group JIT runners join (1, "Default", if 0).
	RunnerGroupID int64
	// CacheTTL is how long a listing of runners is reused (30s if 0).
	CacheTTL time.Duration
	// RerunPoll is how often a run that lost its runner is checked until
	// it ends (5s if 0); RerunWait is how long that goes on (1h if 0).
	RerunPoll, RerunWait time.Duration
	Version              string // for the User-Agent
	Logger               *slog.Logger
	// Budget paces the API calls (forge.Budgeted); nil is none.
	Budget *rate.Limiter
	// Owed keeps the lost runners\' re-runs the connection owes, for
	// the next manager (forge.Following.Ledger); nil keeps none.
	Owed forge.Ledger
	// CallTimeout bounds each API request (30s if 0): a forge that
	// accepts connections and never answers cannot hold a pass.
	CallTimeout time.Duration
}

// Scope is where runners are registered.
type Scope struct {
	Owner string
	Repo  string // empty for an organisation
}

func (s Scope) String() string {
	if s.Repo == "" {
		return "organisation " + s.Owner
	}
	return "repository " + s.Owner + "/" + s.Repo
}

// ParseURL infers the API base and the scope from a repository or
// organisation URL, as CML does: one path segment is an organisation, two
// a repository.
func ParseURL(raw string) (api string, s Scope, err error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return "", Scope{}, fmt.Errorf("github url %q: want https://<host>/<owner>[/<repo>]", raw)
	}
	parts := strings.FieldsFunc(strings.TrimSuffix(u.Path, ".git"), func(r rune) bool { return r == '/' })
	switch len(parts) {
	case 1:
		s = Scope{Owner: parts[0]}
	case 2:
		s = Scope{Owner: parts[0], Repo: parts[1]}
	default:
		return "", Scope{}, fmt.Errorf("github url %q: want an organisation (/<org>) or a repository (/<owner>/<repo>)", raw)
	}
	host := strings.ToLower(u.Host)
	if host == "github.com" || host == "www.github.com" {
		return "https://api.github.com/", s, nil
	}
	return u.Scheme + "://" + u.Host + "/api/v3/", s, nil
}

// Forge is a GitHub forge driver.
type Forge struct {
	cfg   Config
	scope Scope
	api   *gh.Client
	log   *slog.Logger

	calls     atomic.Int64 // HTTP requests sent
	waits     atomic.Int64 // waits for a rate-limit reset
	remaining atomic.Int64 // X-RateLimit-Remaining of the last answer, -1 before one

	listMu sync.Mutex // one listing at a time
	kept   forge.Kept // the listing of registrations, between reads
	mu     sync.Mutex
	noJIT  bool
	reruns map[int64]bool    // runs whose failed jobs were re-run
	losing forge.Following   // lost runners being followed
	seen   map[int64]runSeen // runs listed by polls, by id
}

// New returns a driver. It makes no network call.
func New(cfg Config) (*Forge, error) {
	api, scope, err := ParseURL(cfg.URL)
	if err != nil {
		return nil, err
	}
	if cfg.APIURL != "" {
		api = strings.TrimRight(cfg.APIURL, "/") + "/"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RunnerGroupID == 0 {
		cfg.RunnerGroupID = 1
	}
	if cfg.CacheTTL == 0 {
		cfg.CacheTTL = 30 * time.Second
	}
	if cfg.RerunPoll == 0 {
		cfg.RerunPoll = 5 * time.Second
	}
	if cfg.RerunWait == 0 {
		cfg.RerunWait = time.Hour
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	d := &Forge{cfg: cfg, scope: scope, log: cfg.Logger, reruns: map[int64]bool{}, seen: map[int64]runSeen{}}
	d.losing.Ledger = cfg.Owed
	d.remaining.Store(-1)
	// Every request that leaves the driver is counted, the installation
	// token requests of a GitHub App included.
	rt := forge.Budgeted(forge.CountCalls(http.DefaultTransport, &d.calls), cfg.Budget)
	opts := []gh.ClientOptionsFunc{gh.WithURLs(&api, &api), gh.WithUserAgent("runfleet/" + cfg.Version), gh.WithTimeout(cfg.CallTimeout)}
	switch {
	case cfg.AppID != 0:
		if cfg.Token != "" {
			return nil, errors.New("github: set a token or a GitHub App, not both")
		}
		if cfg.InstallationID == 0 || len(cfg.PrivateKey) == 0 {
			return nil, errors.New("github: a GitHub App needs app_id, installation_id and private_key")
		}
		itr, err := ghinstallation.New(rt, cfg.AppID, cfg.InstallationID, cfg.PrivateKey)
		if err != nil {
			// The key itself is never part of the message.
			return nil, fmt.Errorf("github app %d: private key: %w", cfg.AppID, errors.Unwrap(err))
		}
		itr.BaseURL = strings.TrimRight(api, "/")
		rt = itr
	case cfg.Token != "":
		opts = append(opts, gh.WithAuthToken(cfg.Token))
	default:
		return nil, errors.New("github: a token or a GitHub App is required")
	}
	opts = append(opts, gh.WithTransport(rt))
	d.api, err = gh.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("github: %w", err)
	}
	return d, nil
}

// Calls returns the HTTP requests sent so far.
func (d *Forge) Calls() int64 { return d.calls.Load() }

// RateLimitWaits returns how many times a call waited for a rate-limit reset.
func (d *Forge) RateLimitWaits() int64 { return d.waits.Load() }

// RateRemaining returns the last X-RateLimit-Remaining seen, -1 before any.
func (d *Forge) RateRemaining() int64 { return d.remaining.Load() }

// Stats reports the calls sent, the rate limit left and the waits for it.
func (d *Forge) Stats() forge.Stats {
	return forge.Stats{Calls: d.calls.Load(), RateRemaining: d.remaining.Load(), RateLimitWaits: d.waits.Load()}
}

const maxRateLimitWaits = 5

// maxPages bounds a listing (100 a page), so that answers that never end
// their pages cannot hold a pass or a poll for ever.
const maxPages = 100

// call runs one API request, waiting out rate limits: until the reset that
// GitHub announced, or Retry-After, and at least a second, so that it
// never loops tightly. Other errors are returned for the caller's backoff.
func (d *Forge) call(ctx context.Context, what string, fn func(context.Context) (*gh.Response, error)) error {
	for attempt := 0; ; attempt++ {
		resp, err := fn(ctx)
		if resp != nil && resp.Response != nil && resp.Header.Get(gh.HeaderRateRemaining) != "" {
			d.remaining.Store(int64(resp.Rate.Remaining))
		}
		if err == nil {
			return nil
		}
		wait, limited := rateLimitWait(err, resp)
		if !limited || attempt >= maxRateLimitWaits {
			return err
		}
		d.waits.Add(1)
		d.log.Warn("github rate limit reached; waiting for the reset", "call", what, "wait", wait.Round(time.Millisecond))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%s: waiting for the rate limit reset: %w", what, ctx.Err())
		case <-t.C:
		}
	}
}

// rateLimitWait tells whether err is a rate limit and how long to wait.
func rateLimitWait(err error, resp *gh.Response) (time.Duration, bool) {
	const least = time.Second
	if e, ok := errors.AsType[*gh.RateLimitError](err); ok {
		// The reset is given in whole seconds; half a second more absorbs
		// the difference between the two clocks.
		return max(time.Until(e.Rate.Reset.Time)+500*time.Millisecond, least), true
	}
	if e, ok := errors.AsType[*gh.AbuseRateLimitError](err); ok {
		if e.RetryAfter != nil {
			return max(*e.RetryAfter, least), true
		}
		return time.Minute, true
	}
	if e, ok := errors.AsType[*gh.ErrorResponse](err); ok && e.Response != nil {
		code := e.Response.StatusCode
		if code != http.StatusTooManyRequests && code != http.StatusForbidden {
			return 0, false
		}
		if ra := e.Response.Header.Get("Retry-After"); ra != "" {
			if d, err := time.ParseDuration(ra + "s"); err == nil {
				return max(d, least), true
			}
			if t, err := http.ParseTime(ra); err == nil {
				return max(time.Until(t), least), true
			}
		}
		if code == http.StatusTooManyRequests {
			return time.Minute, true
		}
	}
	return 0, false
}

// errEmpty is an answer of 200 with no body where a listing was due.
var errEmpty = errors.New("the answer has no body")

// status returns the HTTP status of an API error, 0 if there is none.
func status(err error) int {
	if e, ok := errors.AsType[*gh.ErrorResponse](err); ok && e.Response != nil {
		return e.Response.StatusCode
	}
	return 0
}

// apiError words an API error for the log: what was asked, where, the
// status and GitHub's message, without the request URL. The original stays
// reachable with errors.As.
func (d *Forge) apiError(what string, err error) error {
	if e, ok := errors.AsType[*gh.ErrorResponse](err); ok && e.Response != nil {
		msg := e.Message
		if msg == "" {
			msg = http.StatusText(e.Response.StatusCode)
		}
		return wrapped{fmt.Sprintf("github %s in %s: %d %s", what, d.scope, e.Response.StatusCode, msg), err}
	}
	return fmt.Errorf("github %s in %s: %w", what, d.scope, err)
}

type wrapped struct {
	msg string
	err error
}

func (w wrapped) Error() string { return w.msg }
func (w wrapped) Unwrap() error { return w.err }

// Register creates a just-in-time runner. A registration left under the
// same name (by a crash between registering and starting) is removed
// first, unless it is running a job.
func (d *Forge) Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	d.mu.Lock()
	noJIT := d.noJIT
	d.mu.Unlock()
	if !noJIT {
		cred, err := d.registerJIT(ctx, req)
		if err == nil || status(err) != http.StatusNotFound {
			return cred, err
		}
		// 404 from generate-jitconfig: the scope exists (the token
		// endpoint below proves it) but JIT runners do not.
		tok, terr := d.registrationToken(ctx)
		if terr != nil {
			return forge.Credential{}, err
		}
		d.mu.Lock()
		d.noJIT = true
		d.mu.Unlock()
		d.log.Warn("github: just-in-time runners are not available here; falling back to registration tokens with ephemeral runners (a registration token can enrol further runners for an hour)", "scope", d.scope.String())
		if req.OneRunnerOnly {
			return forge.Credential{}, errNoJIT(req.Name)
		}
		return d.tokenCredential(tok), nil
	}
	if req.OneRunnerOnly {
		return forge.Credential{}, errNoJIT(req.Name)
	}
	tok, err := d.registrationToken(ctx)
	if err != nil {
		return forge.Credential{}, err
	}
	return d.tokenCredential(tok), nil
}

// errNoJIT refuses a registration token to a runner whose credential
// would stay where its jobs can read it: with one, a job could enrol
// runners of its own for an hour and take other jobs.
func errNoJIT(name string) error {
	return fmt.Errorf("%w: github register runner %s: GitHub offers no just-in-time runners here, and a registration token in a cloud instance's boot data, readable by its jobs for the instance's life, would let a job enrol runners of its own for an hour: use a GitHub with just-in-time runners (github.com has them), or a provider whose machines keep no boot data (process, docker, kubernetes)", forge.ErrRejected, name)
}

func (d *Forge) tokenCredential(tok string) forge.Credential {
	return forge.Credential{Env: map[string]string{EnvToken: tok, EnvURL: d.cfg.URL}}
}

// GitHub's limits on a runner's labels: generate-jitconfig takes 1 to 100,
// and the runner refuses a label longer than 256 characters.
const (
	maxLabels   = 100
	maxLabelLen = 256
)

// checkLabels returns every way the labels break GitHub's limits, each
// naming its field.
func checkLabels(labels []string) error {
	var errs []error
	if len(labels) == 0 || len(labels) > maxLabels {
		errs = append(errs, fmt.Errorf("labels: GitHub takes 1 to %d labels a runner, got %d", maxLabels, len(labels)))
	}
	for i, l := range labels {
		if len(l) > maxLabelLen {
			errs = append(errs, fmt.Errorf("labels[%d]: %.20q... is %d characters; GitHub takes at most %d", i, l, len(l), maxLabelLen))
		}
	}
	return errors.Join(errs...)
}

func (d *Forge) registerJIT(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	// The pool's labels passed the config's check, but hardware labels
	// are added at run time: a request GitHub would refuse is not sent.
	if err := checkLabels(req.Labels); err != nil {
		return forge.Credential{}, fmt.Errorf("%w: github register runner %s: %w", forge.ErrRejected, req.Name, err)
	}
	body := gh.CreateJITConfigRequest{Name: req.Name, RunnerGroupID: d.cfg.RunnerGroupID, Labels: req.Labels}
	var jit *gh.JITRunnerConfig
	do := func(ctx context.Context) (resp *gh.Response, err error) {
		if d.scope.Repo == "" {
			jit, resp, err = d.api.Actions.CreateOrgJITConfig(ctx, d.scope.Owner, body)
		} else {
			jit, resp, err = d.api.Actions.CreateRepoJITConfig(ctx, d.scope.Owner, d.scope.Repo, body)
		}
		return resp, err
	}
	err := d.call(ctx, "generate-jitconfig", do)
	if err != nil {
		// Sent but perhaps unanswered (cancelled by a drain, timed out,
		// a 5xx): GitHub may have made the runner. The kept listing
		// would hide it for a whole cache_ttl, and a drain would end
		// with it left.
		d.dropListing()
	}
	if nameTaken(err) {
		// GitHub documents 409 for a name in use; some versions say 422
		// "already exists". Either way: clear the stale one, try again.
		if rerr := d.removeByName(ctx, req.Name); rerr != nil {
			return forge.Credential{}, fmt.Errorf("runner name %s is taken: %w", req.Name, rerr)
		}
		err = d.call(ctx, "generate-jitconfig", do)
	}
	if code := status(err); code == http.StatusUnprocessableEntity || code == http.StatusForbidden {
		// The request itself is invalid (labels, group), or the token
		// lacks the permission ("Resource not accessible by
		// integration"; a rate limit's 403 was waited out in call, and
		// comes back as a RateLimitError): no retry can fix it.
		return forge.Credential{}, fmt.Errorf("%w: %w", forge.ErrRejected, d.apiError("register runner "+req.Name, err))
	}
	if err != nil {
		return forge.Credential{}, d.apiError("register runner "+req.Name, err)
	}
	if jit.GetEncodedJITConfig() == "" || jit.GetRunner().GetID() == 0 {
		return forge.Credential{}, fmt.Errorf("github register runner %s: answer has no JIT config", req.Name)
	}
	id := jit.GetRunner().GetID()
	d.remember(forge.Runner{ID: id, Name: req.Name, Status: forge.StatusOffline, Labels: req.Labels})
	return forge.Credential{RunnerID: id, Env: map[string]string{EnvJITConfig: jit.GetEncodedJITConfig()}}, nil
}

// dropListing stops reuse of the kept list, and of any listing under
// way, after a change whose outcome is unknown: the next call reads
// GitHub.
func (d *Forge) dropListing() { d.kept.Drop() }

// remember adds a registration the driver made to the kept list.
func (d *Forge) remember(r forge.Runner) {
	d.kept.Change(r.ID, func(list []forge.Runner, _ int) []forge.Runner {
		list = slices.DeleteFunc(list, func(x forge.Runner) bool { return x.Name == r.Name || x.ID == r.ID })
		return append(list, r)
	})
}

// markBusy notes in the kept list that the forge refused to remove a
// runner running a job.
func (d *Forge) markBusy(id int64) {
	d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
		if i >= 0 {
			list[i].Status = forge.StatusBusy
		}
		return list
	})
}

// nameTaken tells GitHub's answer to a JIT request for a name in use.
func nameTaken(err error) bool {
	e, ok := errors.AsType[*gh.ErrorResponse](err)
	if !ok || e.Response == nil {
		return false
	}
	switch e.Response.StatusCode {
	case http.StatusConflict:
		return true
	case http.StatusUnprocessableEntity:
		// "Already exists - ..." in the message, or "Validation Failed"
		// with the reason in errors[]: the description allows both.
		if strings.Contains(strings.ToLower(e.Message), "already exists") {
			return true
		}
		return slices.ContainsFunc(e.Errors, func(fe gh.Error) bool {
			return fe.Code == "already_exists" || strings.Contains(strings.ToLower(fe.Message), "already exists")
		})
	}
	return false
}

// removeByName removes a leftover registration of that name.
func (d *Forge) removeByName(ctx context.Context, name string) error {
	var rs *gh.Runners
	err := d.call(ctx, "list runners", func(ctx context.Context) (resp *gh.Response, err error) {
		opt := &gh.ListRunnersOptions{Name: &name}
		if d.scope.Repo == "" {
			rs, resp, err = d.api.Actions.ListOrganizationRunners(ctx, d.scope.Owner, opt)
		} else {
			rs, resp, err = d.api.Actions.ListRunners(ctx, d.scope.Owner, d.scope.Repo, opt)
		}
		return resp, err
	})
	if err == nil && rs == nil {
		err = errEmpty
	}
	if err != nil {
		return d.apiError("find runner "+name, err)
	}
	for _, r := range rs.Runners {
		if r.GetName() != name {
			continue
		}
		d.log.Info("github: removing a stale registration of the same name", "runner", name, "id", r.GetID())
		if err := d.RemoveRunner(ctx, r.GetID()); err != nil && !errors.Is(err, forge.ErrNotFound) {
			return err
		}
	}
	return nil
}

func (d *Forge) registrationToken(ctx context.Context) (string, error) {
	var t *gh.RegistrationToken
	err := d.call(ctx, "registration-token", func(ctx context.Context) (resp *gh.Response, err error) {
		if d.scope.Repo == "" {
			t, resp, err = d.api.Actions.CreateOrganizationRegistrationToken(ctx, d.scope.Owner)
		} else {
			t, resp, err = d.api.Actions.CreateRegistrationToken(ctx, d.scope.Owner, d.scope.Repo)
		}
		return resp, err
	})
	if err == nil && t.GetToken() == "" {
		err = errEmpty
	}
	if err != nil {
		return "", d.apiError("registration token", err)
	}
	return t.GetToken(), nil
}

// Runners lists the runner registrations in the scope: from GitHub when
// the last listing is older than CacheTTL, from the kept list otherwise.
func (d *Forge) Runners(ctx context.Context) ([]forge.Runner, error) {
	d.listMu.Lock()
	defer d.listMu.Unlock()
	out, ok, stamp := d.kept.Get(d.cfg.CacheTTL)
	if ok {
		return out, nil
	}
	start := time.Now()
	out = nil
	opt := &gh.ListRunnersOptions{ListOptions: gh.ListOptions{PerPage: 100}}
	for {
		var (
			rs   *gh.Runners
			next int
		)
		err := d.call(ctx, "list runners", func(ctx context.Context) (resp *gh.Response, err error) {
			if d.scope.Repo == "" {
				rs, resp, err = d.api.Actions.ListOrganizationRunners(ctx, d.scope.Owner, opt)
			} else {
				rs, resp, err = d.api.Actions.ListRunners(ctx, d.scope.Owner, d.scope.Repo, opt)
			}
			if resp != nil {
				next = resp.NextPage
			}
			return resp, err
		})
		if err == nil && rs == nil {
			err = errEmpty
		}
		if err != nil {
			return nil, d.apiError("list runners", err)
		}
		for _, r := range rs.Runners {
			st := forge.StatusIdle
			switch {
			case r.GetBusy():
				st = forge.StatusBusy
			case r.GetStatus() != "online":
				st = forge.StatusOffline
			}
			labels := make([]string, 0, len(r.Labels))
			for _, l := range r.Labels {
				labels = append(labels, l.GetName())
			}
			out = append(out, forge.Runner{ID: r.GetID(), Name: r.GetName(), Status: st, Labels: labels})
		}
		if next == 0 {
			break
		}
		if opt.Page >= maxPages {
			return nil, fmt.Errorf("github %s: more than %d pages", d.scope, maxPages)
		}
		opt.Page = next
	}
	// A registration made or ended while GitHub was read may be missing
	// from (or still in) this listing: kept, it would hide the change for
	// a whole cache_ttl. Kept does not keep it then.
	d.kept.Keep(out, stamp, start, true)
	return out, nil
}

// RemoveRunner removes a registration. GitHub refuses (422) while the
// runner runs a job: that is ErrBusy, and nothing is removed.
func (d *Forge) RemoveRunner(ctx context.Context, id int64) error {
	if id == 0 {
		return forge.ErrNotFound
	}
	err := d.call(ctx, "remove runner", func(ctx context.Context) (*gh.Response, error) {
		if d.scope.Repo == "" {
			return d.api.Actions.RemoveOrganizationRunner(ctx, d.scope.Owner, id)
		}
		return d.api.Actions.RemoveRunner(ctx, d.scope.Owner, d.scope.Repo, id)
	})
	switch status(err) {
	case 0:
		if err != nil {
			return d.apiError(fmt.Sprintf("remove runner %d", id), err)
		}
		d.forget(id)
		return nil
	case http.StatusNotFound:
		d.forget(id)
		return fmt.Errorf("github runner %d: %w", id, forge.ErrNotFound)
	case http.StatusUnprocessableEntity:
		d.markBusy(id)
		return fmt.Errorf("github runner %d: %w", id, forge.ErrBusy)
	default:
		return d.apiError(fmt.Sprintf("remove runner %d", id), err)
	}
}

func (d *Forge) forget(id int64) { d.kept.Forget(id) }

// Ended tells the driver that a runner's agent finished its job: GitHub
// deletes an ephemeral runner then, so the kept list drops it without a
// call.
func (d *Forge) Ended(id int64) { d.forget(id) }

// ImplicitLabels are the labels GitHub gives every self-hosted runner,
// which jobs name in runs-on without a pool listing them.
func (d *Forge) ImplicitLabels() []string { return []string{"self-hosted", "linux", "x64"} }

// statuses maps GitHub's job status words to runfleet's. "waiting" (for a
// deployment's approval) and "requested" are not yet for a runner.
var statuses = map[string]forge.JobStatus{
	"queued":      forge.JobQueued,
	"in_progress": forge.JobInProgress,
	"completed":   forge.JobCompleted,
}

// Jobs lists the repository's jobs with the given status. Queued jobs are
// in queued runs and in runs in progress too (a job behind needs: is
// queued once its needs end, inside a run that has started), so both are
// searched, within a bound of maxRunsPerPoll job listings. GitHub lists
// jobs per repository only: for an organisation it returns
// errors.ErrUnsupported.
func (d *Forge) Jobs(ctx context.Context, st forge.JobStatus) ([]forge.Job, error) {
	if d.scope.Repo == "" {
		return nil, fmt.Errorf("github jobs in %s: GitHub lists jobs per repository: %w", d.scope, errors.ErrUnsupported)
	}
	word := st.String()
	runs, err := d.runs(ctx, word, false)
	if err != nil {
		return nil, err
	}
	if st == forge.JobQueued {
		more, err := d.runs(ctx, forge.JobInProgress.String(), false)
		if err != nil {
			return nil, err
		}
		runs = d.pollOrder(runs, more)
	}
	var out []forge.Job
	for _, run := range runs {
		jobs, err := d.runJobs(ctx, run.GetID())
		if err != nil {
			return nil, err
		}
		queued := false
		for _, j := range jobs {
			if j.GetStatus() == word && j.GetID() != 0 {
				fj := job(j)
				fj.Source.Repository = cmp.Or(run.GetRepository().GetFullName(), d.scope.Owner+"/"+d.scope.Repo)
				fj.Source.Actor = cmp.Or(run.GetTriggeringActor().GetLogin(), run.GetActor().GetLogin())
				out = append(out, fj)
				queued = true
			}
		}
		if st == forge.JobQueued {
			d.mu.Lock()
			d.seen[run.GetID()] = runSeen{updated: run.GetUpdatedAt().Time, listed: time.Now(), queued: queued}
			d.mu.Unlock()
		}
	}
	return out, nil
}

// maxRunsPerPoll bounds the runs whose jobs one poll lists: a repository
// with many long runs in progress costs at most this many calls a poll,
// and every run's turn still comes.
const maxRunsPerPoll = 30

// runSeen is what a poll learnt of a run.
type runSeen struct {
	updated time.Time // the run's updated_at then
	listed  time.Time // when its jobs were listed
	queued  bool      // it had queued jobs
}

// pollOrder picks, within maxRunsPerPoll, the runs whose jobs a poll
// lists: queued runs first, then runs in progress that changed since
// their last listing or had queued jobs then, then the others, those
// listed longest ago first.
func (d *Forge) pollOrder(queued, inProgress []*gh.WorkflowRun) []*gh.WorkflowRun {
	d.mu.Lock()
	defer d.mu.Unlock()
	type cand struct {
		run    *gh.WorkflowRun
		rank   int
		listed time.Time
	}
	var cands []cand
	live := map[int64]bool{}
	for _, r := range queued {
		live[r.GetID()] = true
		cands = append(cands, cand{r, 0, d.seen[r.GetID()].listed})
	}
	for _, r := range inProgress {
		if live[r.GetID()] {
			continue
		}
		live[r.GetID()] = true
		seen, ok := d.seen[r.GetID()]
		rank := 2
		if !ok || seen.queued || !seen.updated.Equal(r.GetUpdatedAt().Time) {
			rank = 1
		}
		cands = append(cands, cand{r, rank, seen.listed})
	}
	for id := range d.seen {
		if !live[id] {
			delete(d.seen, id)
		}
	}
	slices.SortStableFunc(cands, func(a, b cand) int {
		if a.rank != b.rank {
			return a.rank - b.rank
		}
		return a.listed.Compare(b.listed)
	})
	out := make([]*gh.WorkflowRun, 0, min(len(cands), maxRunsPerPoll))
	for _, c := range cands[:min(len(cands), maxRunsPerPoll)] {
		out = append(out, c.run)
	}
	return out
}

func job(j *gh.WorkflowJob) forge.Job {
	return forge.Job{
		ID: j.GetID(), RunID: j.GetRunID(), Name: j.GetName(), Labels: j.Labels, Status: statuses[j.GetStatus()],
		Conclusion: j.GetConclusion(), RunnerID: j.GetRunnerID(), RunnerName: j.GetRunnerName(), Attempt: int(j.GetRunAttempt()),
		CreatedAt: j.GetCreatedAt().Time, StartedAt: j.GetStartedAt().Time, EndedAt: j.GetCompletedAt().Time,
		URL:    j.GetHTMLURL(),
		Source: forge.Source{Commit: j.GetHeadSHA(), Ref: j.GetHeadBranch(), Workflow: j.GetWorkflowName()},
	}
}

// RerunJob re-runs one ended job ("Re-run a job from a workflow run"), a
// new attempt of its run.
func (d *Forge) RerunJob(ctx context.Context, j forge.Job) error {
	if d.scope.Repo == "" {
		return fmt.Errorf("re-run job %d: re-running needs a repository scope", j.ID)
	}
	err := d.call(ctx, "rerun job", func(ctx context.Context) (*gh.Response, error) {
		return d.api.Actions.RerunJobByID(ctx, d.scope.Owner, d.scope.Repo, j.ID)
	})
	if err != nil {
		return d.apiError(fmt.Sprintf("re-run job %d", j.ID), err)
	}
	return nil
}

// runs lists the repository's runs with the status, newest first; only
// the first page when firstPage is set.
func (d *Forge) runs(ctx context.Context, st string, firstPage bool) ([]*gh.WorkflowRun, error) {
	var out []*gh.WorkflowRun
	opt := &gh.ListWorkflowRunsOptions{Status: st, ListOptions: gh.ListOptions{PerPage: 100}}
	for {
		var (
			rs   *gh.WorkflowRuns
			next int
		)
		err := d.call(ctx, "list runs", func(ctx context.Context) (resp *gh.Response, err error) {
			rs, resp, err = d.api.Actions.ListRepositoryWorkflowRuns(ctx, d.scope.Owner, d.scope.Repo, opt)
			if resp != nil {
				next = resp.NextPage
			}
			return resp, err
		})
		if err == nil && rs == nil {
			err = errEmpty
		}
		if err != nil {
			return nil, d.apiError("list runs", err)
		}
		out = append(out, rs.WorkflowRuns...)
		if next == 0 || firstPage {
			return out, nil
		}
		if opt.Page >= maxPages {
			return nil, fmt.Errorf("github %s: more than %d pages", d.scope, maxPages)
		}
		opt.Page = next
	}
}

func (d *Forge) runJobs(ctx context.Context, runID int64) ([]*gh.WorkflowJob, error) {
	var out []*gh.WorkflowJob
	opt := &gh.ListWorkflowJobsOptions{Filter: "latest", ListOptions: gh.ListOptions{PerPage: 100}}
	for {
		var (
			js   *gh.Jobs
			next int
		)
		err := d.call(ctx, "list jobs", func(ctx context.Context) (resp *gh.Response, err error) {
			js, resp, err = d.api.Actions.ListWorkflowJobs(ctx, d.scope.Owner, d.scope.Repo, runID, opt)
			if resp != nil {
				next = resp.NextPage
			}
			return resp, err
		})
		if err == nil && js == nil {
			err = errEmpty
		}
		if err != nil {
			return nil, d.apiError(fmt.Sprintf("list jobs of run %d", runID), err)
		}
		out = append(out, js.Jobs...)
		if next == 0 {
			return out, nil
		}
		if opt.Page >= maxPages {
			return nil, fmt.Errorf("github %s: more than %d pages", d.scope, maxPages)
		}
		opt.Page = next
	}
}

// Lost is told that a runner's machine went away while it ran a job. It
// finds that job by the runner's registration id, which GitHub never
// reuses (names are: every runner of a slot has the same), and once
// GitHub has failed the job and the run has ended, re-runs the run's
// failed jobs: once per run, as CML does for a spot instance taken back.
// It returns at once; the wait is in the background, bound to ctx.
func (d *Forge) Lost(ctx context.Context, r forge.Runner) {
	if d.scope.Repo == "" {
		d.log.Warn("github: a runner was lost mid-job; re-running needs a repository scope, so its job is left failed", "runner", r.Name)
		return
	}
	d.losing.Go(ctx, r, func(ctx context.Context) {
		if err := d.rerunLost(ctx, r); err != nil && ctx.Err() == nil {
			d.log.Error("github: could not re-run the job of a lost runner", "runner", r.Name, "id", r.ID, "err", err)
		}
	})
}

// lostJobRun finds the run of the job the runner held: among the runs in
// progress (GitHub still waits for the runner), then the latest failed
// ones (it has given up on it). Without a registration id, only a job in
// progress under the runner's name can be its: a failed one may be an
// earlier runner's of the same name.
func (d *Forge) lostJobRun(ctx context.Context, r forge.Runner) (int64, error) {
	match := func(j *gh.WorkflowJob) bool {
		if r.ID != 0 {
			return j.GetRunnerID() == r.ID
		}
		return j.GetStatus() == "in_progress" && j.GetRunnerName() == r.Name
	}
	for _, st := range []string{"in_progress", "failure"} {
		if st == "failure" && r.ID == 0 {
			break
		}
		runs, err := d.runs(ctx, st, st == "failure")
		if err != nil {
			return 0, err
		}
		for _, run := range runs {
			jobs, err := d.runJobs(ctx, run.GetID())
			if err != nil {
				return 0, err
			}
			if slices.ContainsFunc(jobs, match) {
				return run.GetID(), nil
			}
		}
	}
	return 0, nil
}

func (d *Forge) rerunLost(ctx context.Context, r forge.Runner) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.RerunWait)
	defer cancel()
	runID, err := d.lostJobRun(ctx, r)
	if err != nil {
		return err
	}
	if runID == 0 {
		d.log.Info("github: the lost runner's job is not in progress any more; nothing to re-run", "runner", r.Name, "id", r.ID)
		return nil
	}
	d.log.Warn("github: runner lost mid-job; its run's failed jobs are re-run once the run ends", "runner", r.Name, "id", r.ID, "run", runID)
	t := time.NewTicker(d.cfg.RerunPoll)
	defer t.Stop()
	for {
		var run *gh.WorkflowRun
		err := d.call(ctx, "get run", func(ctx context.Context) (resp *gh.Response, err error) {
			run, resp, err = d.api.Actions.GetWorkflowRunByID(ctx, d.scope.Owner, d.scope.Repo, runID)
			return resp, err
		})
		if err != nil {
			return d.apiError(fmt.Sprintf("get run %d", runID), err)
		}
		if run.GetStatus() == "completed" {
			return d.rerunOnce(ctx, r, run)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// rerunOnce re-runs an ended run's failed jobs, unless it succeeded or was
// re-run already.
func (d *Forge) rerunOnce(ctx context.Context, r forge.Runner, run *gh.WorkflowRun) error {
	runID := run.GetID()
	if run.GetConclusion() == "success" {
		return nil
	}
	d.mu.Lock()
	done := d.reruns[runID]
	d.reruns[runID] = true
	d.mu.Unlock()
	if done {
		return nil
	}
	err := d.call(ctx, "rerun failed jobs", func(ctx context.Context) (*gh.Response, error) {
		return d.api.Actions.RerunFailedJobsByID(ctx, d.scope.Owner, d.scope.Repo, runID)
	})
	if err != nil {
		return d.apiError(fmt.Sprintf("re-run failed jobs of run %d", runID), err)
	}
	d.log.Info("github: re-ran the failed jobs of a run whose runner was lost", "runner", r.Name, "id", r.ID, "run", runID)
	return nil
}

// Refresh drops the kept listing of runners (forge.Refresher).
func (d *Forge) Refresh() { d.kept.Drop() }

// JobLimit is a job's timeout-minutes when its workflow sets none: 360
// (docs.github.com, "Workflow syntax for GitHub Actions",
// jobs.<job_id>.timeout-minutes).
func (*Forge) JobLimit() time.Duration { return 6 * time.Hour }

// Drain ends the re-runs under way (forge.Drainer).
func (d *Forge) Drain(ctx context.Context) { d.losing.Stop(ctx) }
