package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/server"
)

// Handler is all of the manager's HTTP side on one handler: webhooks,
// and the status page, /metrics and /healthz (behind the status token,
// when there is one).
func (f *Fleet) Handler() http.Handler { return server.New(f.serverConfig()) }

// WebhookHandler is the webhook listener's: /webhook/<forge> only.
func (f *Fleet) WebhookHandler() http.Handler { return server.Webhooks(f.serverConfig()) }

// StatusHandler is the status listener's: the status page, /metrics and
// /healthz.
func (f *Fleet) StatusHandler() http.Handler { return server.Status(f.serverConfig()) }

func (f *Fleet) serverConfig() server.Config {
	hooks := map[string]server.Hook{}
	for _, fc := range f.Config.Forges {
		if p, ok := f.conns[fc.Name].(forge.WebhookParser); ok {
			hooks[fc.Name] = server.Hook{Parser: p, Secret: []byte(fc.WebhookSecret.Reveal())}
		}
	}
	return server.Config{
		Hooks:   hooks,
		Report:  f.Demand.Observe,
		Metrics: f.Metrics,
		Page:    f.Page,
		Healthy: f.healthy,
		Ready:   f.ready,
		Token:   []byte(f.Config.StatusToken.Reveal()),
		Logger:  f.log.With("component", "server"),
		Jobs:    f,
		Handoff: f.handoff,
		Forward: f.forwardTo,
	}
}

// LeaderAt tells the fleet, a candidate of a leader election, how to find
// where the leader takes webhooks: a standby forwards what it receives
// there (server.Config.Forward).
func (f *Fleet) LeaderAt(find func(ctx context.Context) (string, error)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.findLeader = find
}

// leaderKeep is how long the leader's address, once read, is used: one
// Lease read a second at most, however many deliveries arrive.
const leaderKeep = time.Second

// forwardTo says whether the fleet is a standby, and where its leader
// takes webhooks.
func (f *Fleet) forwardTo(ctx context.Context) (string, bool) {
	f.mu.Lock()
	find := f.findLeader
	f.mu.Unlock()
	if find == nil || f.acting.Load() != actingNot {
		return "", false
	}
	f.leaderMu.Lock()
	defer f.leaderMu.Unlock()
	if time.Since(f.leaderRead) < leaderKeep {
		return f.leaderURL, true
	}
	url, err := find(ctx)
	if err != nil {
		f.log.Warn("leader election: where the leader takes webhooks could not be read", "err", err)
	}
	f.leaderURL, f.leaderRead = url, time.Now()
	return url, true
}

// handoff is the desk of the pool's provider, nil when it has none.
func (f *Fleet) handoff(pool string) http.Handler {
	f.mu.Lock()
	p := f.Providers[pool]
	f.mu.Unlock()
	if h, ok := p.(provider.Handoffer); ok {
		return h.HandoffHandler()
	}
	return nil
}

// refusalLister is a pool's handoff desk (vm.Desk) telling the claims it
// refused: the only sign, at the manager, of machines that powered off
// without their runner because their proof did not verify.
type refusalLister interface {
	Refusals(since time.Time) []string
}

// unhealthyAfter is how long every pool's passes must have failed before
// /healthz says so: a forge that blinks (a deploy, a 503 or two) is ridden
// out on what the manager already knows, and a probe that restarts a
// manager during such a blip would only make things worse.
const unhealthyAfter = time.Minute

// healthy fails when every pool's passes have failed for unhealthyAfter:
// the manager cannot reach its forge or its provider.
func (f *Fleet) healthy() error {
	ps := f.pools()
	checks := make([]passChecker, len(ps))
	for i, p := range ps {
		checks[i] = p
	}
	return health(checks, time.Now())
}

// ready is nil while the fleet acts: it runs, leads its election, and
// does not drain.
func (f *Fleet) ready() error {
	switch f.acting.Load() {
	case actingNot:
		return errors.New("not acting: a standby, waiting for the lease, or starting")
	case actingDrain:
		return errors.New("draining")
	}
	return nil
}

// passChecker is what /healthz reads of a pool.
type passChecker interface {
	LastError() error
	FailingSince() time.Time
}

// health is nil unless every pool's passes have failed since at least
// unhealthyAfter before now; then it names each pool's error.
func health(pools []passChecker, now time.Time) error {
	var errs []error
	for _, p := range pools {
		err, since := p.LastError(), p.FailingSince()
		if err == nil || since.IsZero() || now.Sub(since) < unhealthyAfter {
			return nil
		}
		errs = append(errs, fmt.Errorf("failing for %s: %w", now.Sub(since).Round(time.Second), err))
	}
	return errors.Join(errs...)
}
