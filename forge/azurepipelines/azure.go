// Package azurepipelines is the forge driver for Azure Pipelines (Azure
// DevOps Services and Server), on Microsoft's Go client
// (github.com/microsoft/azure-devops-go-api/azuredevops/v7, taskagent).
//
// The manager registers each agent itself, as the agent's own config.sh
// would: it makes the agent's RSA key, adds the agent to the agent pool
// with the public key (AddAgent), and writes the three files the agent
// keeps (.agent, .credentials, .credentials_rsaparams) for its runner. The
// agent starts configured, with run.sh --once, and authenticates with its
// key alone: the personal access token never reaches it.
//
// An agent carries the manager id and its pool as user capabilities
// (runfleet.manager, runfleet.pool), beside the pool's labels, so that a
// manager lists only its own agents and pipelines' demands select a pool.
// The agent's --once has taken a second job and has stayed registered
// after its first in the field (azure-pipelines-agent issues 2332 and
// 2220), so the driver is a forge.Cordoner: an agent is disabled as soon
// as it runs a job, and deleted as soon as that job ends. An agent is
// deleted only when the server lists no request assigned to it, after it
// is disabled, so that none is assigned in between.
//
// Demand comes from the agent pool's job requests
// (_apis/distributedtask/pools/{poolId}/jobrequests), which the Go client
// lacks (azure-devops-go-api issue 94): that call is written here by hand.
// A request's demands are matched to pools as the server matches them to
// agents' capabilities.
package azurepipelines

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

	"github.com/microsoft/azure-devops-go-api/azuredevops/v7"
	"github.com/microsoft/azure-devops-go-api/azuredevops/v7/taskagent"
	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
)

// Config configures a Forge.
type Config struct {
	// URL is the organisation (https://dev.azure.com/acme) or collection.
	URL string
	// RunnerURL is the server's address as the agents reach it; URL when
	// empty.
	RunnerURL string
	// Token is a personal access token with the Agent Pools (read &
	// manage) scope.
	Token string
	// PoolName or PoolID is the agent pool.
	PoolName string
	PoolID   int
	// Project is where a lost job's build is re-run; empty: no re-runs.
	Project string
	// AgentVersion is sent when an agent is added (DefaultAgentVersion
	// when empty).
	AgentVersion string
	// Architecture is the agents' Agent.OSArchitecture (X64 when empty).
	Architecture string
	// AcceptTeeEula is written into each agent's settings (TFVC).
	AcceptTeeEula bool
	// Manager is the manager's id, carried by its agents.
	Manager    string
	HTTPClient *http.Client
	// CallTimeout bounds each call, its rate-limit waits included (30s
	// if 0).
	CallTimeout time.Duration
	// Budget paces the API calls (forge.Budgeted); nil is none.
	Budget *rate.Limiter
	// CacheTTL is how long a listing of agents is reused (5s if 0;
	// negative: never). What the driver itself changes is updated in it
	// at once.
	CacheTTL time.Duration
	Version  string
	Logger   *slog.Logger
}

// The user capabilities that mark an agent as a manager's, and a pool's
// placeholder.
const (
	CapManager     = "runfleet.manager"
	CapPool        = "runfleet.pool"
	CapPlaceholder = "runfleet.placeholder"
)

// Forge talks to one Azure DevOps organisation and one of its agent
// pools.
type Forge struct {
	cfg   Config
	log   *slog.Logger
	hc    *http.Client
	calls atomic.Int64
	rl    *limits

	kept   forge.Kept // the listing of agents, between reads
	mu     sync.Mutex
	api    taskagent.Client // made on first use: it reads the server's locations
	raw    *azuredevops.Client
	poolID int
	// cordoned holds, for each agent the driver disabled, the count of
	// the kept listing's changes at the time: a listing read after it
	// that shows the agent without a request shows its job ended.
	cordoned map[int64]int64
	// idle holds the agents a read begun after their cordon showed
	// without a request (noteEnded): their job has ended.
	idle map[int64]bool
	// noFilter is set once the server refused the demands filter of
	// the agents' listing.
	noFilter bool
}

// New returns a driver. It makes no call.
func New(cfg Config) (*Forge, error) {
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.CacheTTL == 0 {
		cfg.CacheTTL = 5 * time.Second
	}
	if cfg.Architecture == "" {
		cfg.Architecture = "X64"
	}
	if cfg.AgentVersion == "" {
		cfg.AgentVersion = DefaultAgentVersion
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Manager == "" {
		return nil, errors.New("azure-pipelines: no manager id")
	}
	u, err := url.Parse(strings.TrimRight(cfg.URL, "/"))
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("azure-pipelines: %q is not an organisation URL", cfg.URL)
	}
	cfg.URL = u.String()
	if cfg.RunnerURL == "" {
		cfg.RunnerURL = cfg.URL
	}
	d := &Forge{cfg: cfg, log: cfg.Logger, poolID: cfg.PoolID,
		cordoned: map[int64]int64{}, idle: map[int64]bool{}}
	d.rl = &limits{remaining: -1}
	hc := &http.Client{}
	if cfg.HTTPClient != nil {
		c := *cfg.HTTPClient
		hc = &c
	}
	// Each attempt waits for the budget and is counted; the limits wrap
	// them all, so that a 429 waits and is sent again.
	hc.Transport = d.rl.transport(forge.Budgeted(forge.CountCalls(hc.Transport, &d.calls), cfg.Budget))
	d.hc = hc
	return d, nil
}

// Stats reports the calls sent, the rate limit left and the waits for it.
func (d *Forge) Stats() forge.Stats {
	return forge.Stats{Calls: d.calls.Load(), RateRemaining: d.rl.Remaining(), RateLimitWaits: d.rl.Waits()}
}

// client returns the task agent client, made on first use: the Go client
// finds each call's route through the server's resource areas and
// locations, which takes two calls once.
func (d *Forge) client(ctx context.Context) (taskagent.Client, error) {
	d.mu.Lock()
	api := d.api
	d.mu.Unlock()
	if api != nil {
		return api, nil
	}
	conn := azuredevops.NewPatConnection(d.cfg.URL, d.cfg.Token)
	conn.UserAgent = "runfleet/" + cmp.Or(d.cfg.Version, "dev")
	base := azuredevops.NewClientWithOptions(conn, d.cfg.URL, azuredevops.WithHTTPClient(d.hc))
	var areas *[]azuredevops.ResourceAreaInfo
	err := d.call(ctx, "read resource areas", func(ctx context.Context) (err error) {
		areas, err = base.GetResourceAreas(ctx)
		return err
	})
	if err != nil {
		return nil, rejectDefinitive(err)
	}
	loc := d.cfg.URL // Azure DevOps Server lists no areas: all is here
	for _, a := range *areas {
		if a.Id != nil && *a.Id == taskagent.ResourceAreaId && a.LocationUrl != nil {
			loc = strings.TrimRight(*a.LocationUrl, "/")
		}
	}
	raw := azuredevops.NewClientWithOptions(conn, loc, azuredevops.WithHTTPClient(d.hc))
	api = &taskagent.ClientImpl{Client: *raw}
	d.mu.Lock()
	d.api, d.raw = api, raw
	d.mu.Unlock()
	return api, nil
}

// call runs one API call with the call timeout, and wraps its error with
// what it did and where.
func (d *Forge) call(ctx context.Context, what string, f func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CallTimeout)
	defer cancel()
	if err := f(ctx); err != nil {
		return fmt.Errorf("azure-pipelines %s (%s): %w", what, d.where(), err)
	}
	return nil
}

func (d *Forge) where() string {
	if d.cfg.PoolName != "" {
		return fmt.Sprintf("%s, pool %s", d.cfg.URL, d.cfg.PoolName)
	}
	return fmt.Sprintf("%s, pool %d", d.cfg.URL, d.cfg.PoolID)
}

// status is an error's HTTP status, 0 when it has none.
func status(err error) int {
	if e, ok := errors.AsType[*azuredevops.WrappedError](err); ok && e.StatusCode != nil {
		return *e.StatusCode
	}
	if e, ok := errors.AsType[azuredevops.WrappedError](err); ok && e.StatusCode != nil {
		return *e.StatusCode
	}
	return 0
}

// rejectDefinitive marks an answer that no retry can fix (a PAT refused or
// without the scope, a pool or project that does not exist, a request the
// server refuses as invalid) as forge.ErrRejected.
func rejectDefinitive(err error) error {
	switch status(err) {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound:
		return fmt.Errorf("%w: %w", forge.ErrRejected, err)
	}
	return err
}

// pool returns the agent pool's id, looked up by name once.
func (d *Forge) pool(ctx context.Context) (taskagent.Client, int, error) {
	api, err := d.client(ctx)
	if err != nil {
		return nil, 0, err
	}
	d.mu.Lock()
	id := d.poolID
	d.mu.Unlock()
	if id != 0 {
		return api, id, nil
	}
	var pools *[]taskagent.TaskAgentPool
	err = d.call(ctx, "find agent pool", func(ctx context.Context) (err error) {
		pools, err = api.GetAgentPools(ctx, taskagent.GetAgentPoolsArgs{PoolName: &d.cfg.PoolName})
		return err
	})
	if err != nil {
		return nil, 0, rejectDefinitive(err)
	}
	for _, p := range *pools {
		// The name filter matches case-insensitively, and may match
		// more than one pool with wildcards.
		if p.Id != nil && p.Name != nil && strings.EqualFold(*p.Name, d.cfg.PoolName) {
			id = *p.Id
		}
	}
	if id == 0 {
		return nil, 0, fmt.Errorf("%w: azure-pipelines: no agent pool named %q at %s (or the token may not read it)", forge.ErrRejected, d.cfg.PoolName, d.cfg.URL)
	}
	d.mu.Lock()
	d.poolID = id
	d.mu.Unlock()
	return api, id, nil
}

// Runners lists the agents of the pool that carry this manager's id, with
// the request each runs. A listing is reused for CacheTTL.
func (d *Forge) Runners(ctx context.Context) ([]forge.Runner, error) {
	list, ok, stamp := d.kept.Get(d.cfg.CacheTTL)
	if ok {
		return list, nil
	}
	agents, err := d.listAgents(ctx)
	if err != nil {
		return nil, err
	}
	list = make([]forge.Runner, 0, len(agents))
	running := map[int64]bool{}
	for _, a := range agents {
		r := runner(a)
		list = append(list, r)
		running[r.ID] = r.Status == forge.StatusBusy
	}
	d.noteEnded(stamp, running)
	d.kept.Keep(list, stamp, time.Now(), d.cfg.CacheTTL > 0)
	return list, nil
}

// listAgents reads the pool's agents that carry this manager's id: the
// server filters them by that capability (a demand), and the driver checks
// it again, since an agent of another manager must never be touched.
func (d *Forge) listAgents(ctx context.Context) ([]taskagent.TaskAgent, error) {
	api, id, err := d.pool(ctx)
	if err != nil {
		return nil, err
	}
	list := func(filter bool) (agents *[]taskagent.TaskAgent, err error) {
		args := taskagent.GetAgentsArgs{PoolId: &id, IncludeCapabilities: new(true), IncludeAssignedRequest: new(true)}
		if filter {
			args.Demands = &[]string{CapManager + " -equals " + d.cfg.Manager}
		}
		err = d.call(ctx, "list agents", func(ctx context.Context) (err error) {
			agents, err = api.GetAgents(ctx, args)
			return err
		})
		return agents, err
	}
	d.mu.Lock()
	filter := !d.noFilter
	d.mu.Unlock()
	agents, err := list(filter)
	if filter && status(err) == http.StatusBadRequest {
		// A server that does not take the demands filter: the agents
		// are filtered here alone, from now on.
		d.log.Warn("azure-pipelines: the server refused the demands filter of the agent listing; filtering the agents here", "err", err)
		d.mu.Lock()
		d.noFilter = true
		d.mu.Unlock()
		agents, err = list(false)
	}
	if err != nil {
		return nil, rejectDefinitive(err)
	}
	out := make([]taskagent.TaskAgent, 0, len(*agents))
	for _, a := range *agents {
		if a.Id != nil && a.Name != nil && a.UserCapabilities != nil && (*a.UserCapabilities)[CapManager] == d.cfg.Manager {
			out = append(out, a)
		}
	}
	return out, nil
}

// runner maps an agent: busy while a request is assigned to it, idle when
// online, cordoned when disabled; its labels are its user capabilities but
// the manager's marks.
func runner(a taskagent.TaskAgent) forge.Runner {
	r := forge.Runner{ID: int64(*a.Id), Name: *a.Name, Status: forge.StatusOffline}
	switch {
	case a.AssignedRequest != nil:
		r.Status = forge.StatusBusy
	case a.Status != nil && *a.Status == taskagent.TaskAgentStatusValues.Online:
		r.Status = forge.StatusIdle
	}
	r.Cordoned = a.Enabled != nil && !*a.Enabled
	if a.UserCapabilities != nil {
		for k, v := range *a.UserCapabilities {
			if k == CapManager || k == CapPool || k == CapPlaceholder {
				continue
			}
			r.Labels = append(r.Labels, label(k, v))
		}
		slices.Sort(r.Labels)
	}
	return r
}

// forget drops a deleted agent.
func (d *Forge) forget(id int64) {
	d.kept.Forget(id)
	d.mu.Lock()
	delete(d.cordoned, id)
	delete(d.idle, id)
	d.mu.Unlock()
}

// ImplicitLabels are the capabilities every agent reports of itself that
// pipelines demand most: its operating system and architecture, and its
// version (the server adds an Agent.Version demand to every job).
func (d *Forge) ImplicitLabels() []string {
	return []string{"Agent.OS=Linux", "Agent.OSArchitecture=" + d.cfg.Architecture, "Agent.Version=" + d.cfg.AgentVersion}
}

// Meets matches a job's demands to a pool's labels as capabilities
// (forge.DemandMatcher).
func (d *Forge) Meets(labels, demands []string) bool { return meets(capabilities(labels), demands) }

// Refresh drops the kept listing of runners (forge.Refresher).
func (d *Forge) Refresh() { d.kept.Drop() }

// JobLimit is a job's timeoutInMinutes when its pipeline sets none: 60
// (learn.microsoft.com, Azure Pipelines, "Specify jobs in your pipeline",
// timeouts).
func (*Forge) JobLimit() time.Duration { return time.Hour }
