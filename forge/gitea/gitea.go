// Package gitea is the forge driver for Gitea and Forgejo Actions.
//
// The manager registers each runner itself, through the runner service's
// Register call, and hands the agent only the resulting per-runner
// credential (gitea-runner's .runner file). Gitea's registration token is
// reusable and would let whoever holds it enrol more runners, so it never
// leaves the manager.
package gitea

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	runnerv1 "code.gitea.io/actions-proto-go/runner/v1"
	"code.gitea.io/actions-proto-go/runner/v1/runnerv1connect"
	sdk "code.gitea.io/sdk/gitea"
	"connectrpc.com/connect"
	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/version"
)

// Scope is where runners are registered.
type Scope struct {
	Kind  string // repo, org or instance
	Owner string // repo owner, or org
	Repo  string
}

// Config configures a Forge.
type Config struct {
	URL string
	// RunnerURL is Gitea's address as the runners see it (from inside a
	// container, say); URL when empty.
	RunnerURL string
	Token     string // API token of a user allowed to manage runners in Scope
	Scope     Scope
	// HTTPClient is used for every call; http.DefaultClient's transport
	// when nil.
	HTTPClient *http.Client
	// CallTimeout bounds each request (30s if 0), also on an HTTPClient
	// that has no timeout of its own: a Gitea that accepts connections
	// and never answers fails the call instead of holding the pass.
	CallTimeout time.Duration
	// Budget paces the API calls (forge.Budgeted); nil is none.
	Budget *rate.Limiter
	// Owed keeps the lost runners\' re-runs the connection owes, for
	// the next manager (forge.Following.Ledger); nil keeps none.
	Owed forge.Ledger
	// Version is reported to Gitea as the runner version.
	Version string
	// UserAgent names runfleet in every request (version.UserAgent by
	// default).
	UserAgent string
	// SettleTime is how long RemoveRunner waits between disabling a
	// runner and checking it has no job, so that a task fetch that was
	// already under way is seen. Defaults to the runner's FetchTimeout
	// and a second.
	SettleTime time.Duration
	Logger     *slog.Logger
}

// Forge talks to one Gitea instance in one scope.
type Forge struct {
	cfg    Config
	hc     *http.Client
	runner runnerv1connect.RunnerServiceClient
	log    *slog.Logger

	mu       sync.Mutex
	regToken string // cached: Gitea returns the same token until it is reset
	calls    atomic.Int64
	losing   forge.Following // runners whose lost job is being re-run
	reruns   map[int64]bool  // runs re-run already
}

// Stats reports the calls sent; Gitea sends no rate-limit figures.
func (d *Forge) Stats() forge.Stats { return forge.Stats{Calls: d.calls.Load(), RateRemaining: -1} }

// New returns a driver. It makes no call: an unreachable Gitea shows up
// on the first call, which the caller retries.
func New(cfg Config) *Forge {
	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{}
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.SettleTime == 0 {
		cfg.SettleTime = FetchTimeout + time.Second
	}
	if cfg.Version == "" {
		cfg.Version = "runfleet"
	}
	if cfg.UserAgent == "" {
		cfg.UserAgent = version.UserAgent()
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	cfg.URL = strings.TrimRight(cfg.URL, "/")
	d := &Forge{cfg: cfg, log: log}
	d.losing.Ledger = cfg.Owed
	// A copy of the client that counts its requests.
	counted := *hc
	counted.Transport = forge.Budgeted(forge.CountCalls(forge.WithUserAgent(counted.Transport, cfg.UserAgent), &d.calls), cfg.Budget)
	if counted.Timeout <= 0 || counted.Timeout > cfg.CallTimeout {
		counted.Timeout = cfg.CallTimeout
	}
	d.hc = &counted
	d.runner = runnerv1connect.NewRunnerServiceClient(d.hc, cfg.URL+"/api/actions")
	return d
}

// api returns an SDK client bound to ctx. The SDK keeps one context per
// client, so a light client is made per call rather than sharing one
// whose context another call could replace.
func (d *Forge) api(ctx context.Context) (*sdk.Client, error) {
	c, err := sdk.NewClient(d.cfg.URL,
		sdk.SetHTTPClient(d.hc),
		sdk.SetToken(d.cfg.Token),
		sdk.SetContext(ctx),
		sdk.SetGiteaVersion(""), // skip the version probe: one call less per request
	)
	if err != nil {
		return nil, fmt.Errorf("gitea client: %w", err)
	}
	return c, nil
}

func (d *Forge) where() string {
	switch d.cfg.Scope.Kind {
	case "repo":
		return fmt.Sprintf("repo %s/%s", d.cfg.Scope.Owner, d.cfg.Scope.Repo)
	case "org":
		return "org " + d.cfg.Scope.Owner
	}
	return "instance"
}

// apiError adds the HTTP status to an SDK error, whose text alone can be
// empty for some statuses.
func apiError(op string, resp *sdk.Response, err error) error {
	if resp != nil && resp.Response != nil {
		if resp.StatusCode == http.StatusNotFound {
			return fmt.Errorf("%s: %w (HTTP 404: %v)", op, forge.ErrNotFound, err)
		}
		return fmt.Errorf("%s: HTTP %d: %w", op, resp.StatusCode, err)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// scopeError is apiError for a call on the scope itself (its runners, its
// jobs, a registration token), where a 404 says the scope is not there:
// no such repository or organisation, a token that cannot see it, or a
// URL that is not a Gitea at all; never that a runner was not found.
func (d *Forge) scopeError(op string, resp *sdk.Response, err error) error {
	if resp != nil && resp.Response != nil && resp.StatusCode == http.StatusNotFound {
		return fmt.Errorf("%s: HTTP 404: %s is not at %s, the token cannot see it, or %s is not a Gitea (%v)", op, d.where(), d.cfg.URL, d.cfg.URL, err)
	}
	return apiError(op, resp, err)
}

func (d *Forge) registrationToken(ctx context.Context, refresh bool) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.regToken != "" && !refresh {
		return d.regToken, nil
	}
	c, err := d.api(ctx)
	if err != nil {
		return "", err
	}
	var (
		tok  *sdk.RegistrationToken
		resp *sdk.Response
	)
	s := d.cfg.Scope
	switch s.Kind {
	case "repo":
		tok, resp, err = c.CreateRepoActionRunnerRegistrationToken(s.Owner, s.Repo)
	case "org":
		tok, resp, err = c.CreateOrgActionRunnerRegistrationToken(s.Owner)
	default:
		tok, resp, err = c.CreateAdminActionRunnerRegistrationToken()
	}
	if err != nil {
		return "", d.scopeError("get registration token for "+d.where(), resp, err)
	}
	d.regToken = tok.Token
	return d.regToken, nil
}

// Registration is gitea-runner's .runner file.
type Registration struct {
	Warning   string   `json:"WARNING"`
	ID        int64    `json:"id"`
	UUID      string   `json:"uuid"`
	Name      string   `json:"name"`
	Token     string   `json:"token"`
	Address   string   `json:"address"`
	Labels    []string `json:"labels"`
	Ephemeral bool     `json:"ephemeral"`
}

// RegistrationFile is the name gitea-runner reads its registration from.
const RegistrationFile = ".runner"

// Register registers an ephemeral runner and returns its .runner file.
func (d *Forge) Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	var (
		resp *connect.Response[runnerv1.RegisterResponse]
		err  error
	)
	for attempt := range 2 {
		var tok string
		tok, err = d.registrationToken(ctx, attempt > 0)
		if err != nil {
			return forge.Credential{}, err
		}
		resp, err = d.runner.Register(ctx, connect.NewRequest(&runnerv1.RegisterRequest{
			Name:      req.Name,
			Token:     tok,
			Version:   d.cfg.Version,
			Labels:    req.Labels,
			Ephemeral: true,
		}))
		// Gitea answers a reset token with a plain error; fetch the
		// current token once and try again.
		if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "registration token") {
			break
		}
	}
	if err != nil {
		return forge.Credential{}, fmt.Errorf("register runner %s in %s: %w", req.Name, d.where(), err)
	}
	r := resp.Msg.GetRunner()
	if !r.GetEphemeral() {
		// A non-ephemeral runner could take more than one job: refuse it.
		_ = d.deleteRunner(ctx, r.GetId())
		return forge.Credential{}, fmt.Errorf("register runner %s: Gitea did not make it ephemeral (Gitea 1.21 or later is required)", req.Name)
	}
	file, err := json.MarshalIndent(Registration{
		Warning:   "Written by runfleet. This runner takes one job.",
		ID:        r.GetId(),
		UUID:      r.GetUuid(),
		Name:      r.GetName(),
		Token:     r.GetToken(),
		Address:   cmp.Or(d.cfg.RunnerURL, d.cfg.URL),
		Labels:    req.Labels,
		Ephemeral: true,
	}, "", "  ")
	if err != nil {
		return forge.Credential{}, fmt.Errorf("encode registration: %w", err)
	}
	return forge.Credential{RunnerID: r.GetId(), Files: map[string][]byte{RegistrationFile: file}}, nil
}

// Runners lists the runners in the scope. A runner is busy when a job in
// progress is assigned to it: Gitea's own "busy" flag only says the runner
// reported something in the last 10 seconds.
func (d *Forge) Runners(ctx context.Context) ([]forge.Runner, error) {
	c, err := d.api(ctx)
	if err != nil {
		return nil, err
	}
	var list []*sdk.ActionRunner
	s := d.cfg.Scope
	for page := 1; ; page++ {
		opt := sdk.ListActionRunnersOptions{ListOptions: sdk.ListOptions{Page: page, PageSize: 50}}
		var (
			r    *sdk.ActionRunnersResponse
			resp *sdk.Response
		)
		switch s.Kind {
		case "repo":
			r, resp, err = c.ListRepoActionRunners(s.Owner, s.Repo, opt)
		case "org":
			r, resp, err = c.ListOrgActionRunners(s.Owner, opt)
		default:
			r, resp, err = c.ListAdminActionRunners(opt)
		}
		if err != nil {
			return nil, d.scopeError("list runners in "+d.where(), resp, err)
		}
		list = append(list, r.Runners...)
		if len(r.Runners) < 50 {
			break
		}
	}
	running, err := d.Jobs(ctx, forge.JobInProgress)
	if err != nil {
		return nil, err
	}
	busy := map[int64]bool{}
	for _, j := range running {
		busy[j.RunnerID] = true
	}
	out := make([]forge.Runner, 0, len(list))
	for _, r := range list {
		st := forge.StatusIdle
		switch {
		case busy[r.ID]:
			st = forge.StatusBusy
		case r.Status == "offline":
			st = forge.StatusOffline
		}
		labels := make([]string, 0, len(r.Labels))
		for _, l := range r.Labels {
			labels = append(labels, l.Name)
		}
		out = append(out, forge.Runner{ID: r.ID, Name: r.Name, Status: st, Labels: labels})
	}
	return out, nil
}

// maxJobPages bounds a listing of jobs (50 a page): a forge that never
// ends its pages cannot hold a poll for ever.
const maxJobPages = 200

// Jobs lists the scope's jobs with the given status.
func (d *Forge) Jobs(ctx context.Context, status forge.JobStatus) ([]forge.Job, error) {
	word, ok := statusWords[status]
	if !ok {
		return nil, fmt.Errorf("list jobs in %s: no Gitea status for %s", d.where(), status)
	}
	raw, err := d.rawJobs(ctx, word)
	if err != nil {
		return nil, err
	}
	var out []forge.Job
	for _, j := range raw {
		// A job that moved on since the filter, or one without an
		// id, is not one of these.
		if fj := job(j, ""); fj.ID != 0 && fj.Status == status {
			if d.cfg.Scope.Kind == "repo" {
				fj.Source.Repository = d.cfg.Scope.Owner + "/" + d.cfg.Scope.Repo
			}
			out = append(out, fj)
		}
	}
	return out, nil
}

// rawJobs lists the scope's jobs with a status word, all pages.
func (d *Forge) rawJobs(ctx context.Context, word string) ([]*sdk.ActionWorkflowJob, error) {
	c, err := d.api(ctx)
	if err != nil {
		return nil, err
	}
	var out []*sdk.ActionWorkflowJob
	s := d.cfg.Scope
	for page := 1; page <= maxJobPages; page++ {
		opt := sdk.ListRepoActionJobsOptions{ListOptions: sdk.ListOptions{Page: page, PageSize: 50}, Status: word}
		var (
			r    *sdk.ActionWorkflowJobsResponse
			resp *sdk.Response
		)
		switch s.Kind {
		case "repo":
			r, resp, err = c.ListRepoActionJobs(s.Owner, s.Repo, opt)
		case "org":
			r, resp, err = c.ListOrgActionJobs(s.Owner, opt)
		default:
			r, resp, err = c.ListAdminActionJobs(opt)
		}
		if err != nil {
			return nil, d.scopeError("list "+word+" jobs in "+d.where(), resp, err)
		}
		for _, j := range r.Jobs {
			if j != nil {
				out = append(out, j)
			}
		}
		if len(r.Jobs) < 50 {
			break
		}
	}
	return out, nil
}

// maxSettle bounds RemoveRunner's wait for task fetches under way.
const maxSettle = 15 * time.Second

// RemoveRunner removes a runner that has no job. Gitea itself deletes a
// runner whatever it is doing, so the driver first disables it (Gitea then
// assigns it nothing more), waits for any task fetch already under way,
// and deletes it only if no job is assigned to it. A busy runner is left
// disabled: it is ephemeral and goes away after its job.
//
// The wait: a fetch that read the runner before the disable committed can
// still assign it a task (Gitea re-reads the runner, then picks a task in
// a transaction of its own). The runner abandons a fetch after its fetch
// timeout, and a task assigned after that is lost to the runner anyway,
// so waiting that long after the disable's answer sees every task the
// runner can run.
func (d *Forge) RemoveRunner(ctx context.Context, id int64) error {
	start := time.Now()
	r, err := d.setDisabled(ctx, id, true)
	if err != nil {
		return err
	}
	// On a loaded server everything takes longer: the wait grows with
	// how slowly the disable was answered.
	settle := min(max(d.cfg.SettleTime, 4*time.Since(start)), maxSettle)
	select {
	case <-time.After(settle):
	case <-ctx.Done():
		return ctx.Err()
	}
	running, err := d.Jobs(ctx, forge.JobInProgress)
	if err != nil {
		return err
	}
	for _, j := range running {
		if j.RunnerID == id {
			return fmt.Errorf("remove runner %s (id %d): %w: job %d %q", r.Name, id, forge.ErrBusy, j.ID, j.Name)
		}
	}
	return d.deleteRunner(ctx, id)
}

func (d *Forge) setDisabled(ctx context.Context, id int64, disabled bool) (*sdk.ActionRunner, error) {
	c, err := d.api(ctx)
	if err != nil {
		return nil, err
	}
	opt := sdk.EditActionRunnerOption{Disabled: &disabled}
	var (
		r    *sdk.ActionRunner
		resp *sdk.Response
	)
	s := d.cfg.Scope
	switch s.Kind {
	case "repo":
		r, resp, err = c.UpdateRepoActionRunner(s.Owner, s.Repo, id, opt)
	case "org":
		r, resp, err = c.UpdateOrgActionRunner(s.Owner, id, opt)
	default:
		r, resp, err = c.UpdateAdminActionRunner(id, opt)
	}
	if err != nil {
		return nil, apiError(fmt.Sprintf("disable runner %d", id), resp, err)
	}
	return r, nil
}

func (d *Forge) deleteRunner(ctx context.Context, id int64) error {
	c, err := d.api(ctx)
	if err != nil {
		return err
	}
	var resp *sdk.Response
	s := d.cfg.Scope
	switch s.Kind {
	case "repo":
		resp, err = c.DeleteRepoActionRunner(s.Owner, s.Repo, id)
	case "org":
		resp, err = c.DeleteOrgActionRunner(s.Owner, id)
	default:
		resp, err = c.DeleteAdminActionRunner(id)
	}
	if err != nil {
		err = apiError(fmt.Sprintf("delete runner %d", id), resp, err)
		if errors.Is(err, forge.ErrNotFound) {
			return nil
		}
		return err
	}
	return nil
}

// JobLimit is Gitea's ENDLESS_TASK_TIMEOUT default: the server stops a
// task still running after 3 hours (docs.gitea.com, config cheat sheet,
// [actions]); the agent's own limit is set longer (Agent.Spec).
func (*Forge) JobLimit() time.Duration { return 3 * time.Hour }
