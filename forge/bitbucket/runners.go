package bitbucket

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/forge"
)

// The labels Bitbucket gives every Linux runner, which steps name in
// runs-on.
const (
	LabelSelfHosted = "self.hosted"
	LabelLinux      = "linux"
)

// The variables a runner reads its identity and OAuth client from, as
// Bitbucket's runner installation dialog gives them.
const (
	EnvAccount      = "ACCOUNT_UUID"
	EnvRepository   = "REPOSITORY_UUID"
	EnvRunner       = "RUNNER_UUID"
	EnvClientID     = "OAUTH_CLIENT_ID"
	EnvClientSecret = "OAUTH_CLIENT_SECRET"
	// EnvAPI names the API for a runner of a Bitbucket other than
	// Bitbucket Cloud (the test bed's): set only then.
	EnvAPI = "BITBUCKET_RUNNER_API_URL"
)

// maxKeptSteps bounds the steps kept for re-runs.
const maxKeptSteps = 4096

// runner is a runner as the API answers it.
type runner struct {
	UUID   string   `json:"uuid"`
	Name   string   `json:"name"`
	Labels []string `json:"labels"`
	State  struct {
		Status string `json:"status"`
		Step   *struct {
			UUID string `json:"uuid"`
		} `json:"step"`
	} `json:"state"`
	OAuthClient struct {
		ID     string `json:"id"`
		Secret string `json:"secret"`
	} `json:"oauth_client"`
}

// The states a runner's state.status takes.
const (
	stateUnregistered = "UNREGISTERED"
	stateOnline       = "ONLINE"
	stateOffline      = "OFFLINE"
	stateDisabled     = "DISABLED"
	stateEnabled      = "ENABLED"
)

// prefix is what a runner's name starts with when it is this manager's.
func (d *Forge) prefix() string { return d.cfg.Manager + "." }

// Labels maps a pool's labels to Bitbucket's form (lowercase letters,
// digits and dots: "gpu=a100" becomes "gpu.a100"), without duplicates,
// with self.hosted and linux.
func Labels(in []string) []string {
	out := []string{LabelSelfHosted, LabelLinux}
	for _, l := range in {
		l = strings.Map(func(r rune) rune {
			switch {
			case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '.':
				return r
			case r >= 'A' && r <= 'Z':
				return r + 'a' - 'A'
			}
			return '.'
		}, l)
		if l != "" && !slices.Contains(out, l) {
			out = append(out, l)
		}
	}
	return out
}

// Register creates a runner in the scope, named <manager>.<runner>, with
// the pool's labels. Its credential is its identity and its own OAuth
// client, in the agent's environment as Bitbucket's runner reads them.
func (d *Forge) Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	path, err := d.runnersPath(ctx)
	if err != nil {
		return forge.Credential{}, err
	}
	var r runner
	body := map[string]any{"name": d.prefix() + req.Name, "labels": Labels(req.Labels)}
	err = d.call(ctx, "create runner "+req.Name, http.MethodPost, path, body, &r)
	switch {
	case atRunnerLimit(err):
		// Bitbucket takes at most 100 runners in a scope: a condition
		// that ends as runners go, not a request to refuse for good.
		return forge.Credential{}, err
	case status(err) == http.StatusBadRequest || status(err) == http.StatusUnauthorized || status(err) == http.StatusForbidden:
		return forge.Credential{}, rejectDefinitive(err)
	case err != nil:
		// Sent but unanswered: Bitbucket may have made it; the next
		// listing shows it, and the pool removes it.
		d.kept.Drop()
		return forge.Credential{}, err
	case r.UUID == "" || r.OAuthClient.ID == "" || r.OAuthClient.Secret == "":
		d.kept.Drop()
		return forge.Credential{}, fmt.Errorf("bitbucket create runner %s (%s): the answer lacks the runner's uuid or OAuth client", req.Name, d.where())
	}
	id := idOf(r.UUID)
	d.mu.Lock()
	d.uuids[id] = r.UUID
	ws, repo := d.ws, d.repo
	d.mu.Unlock()
	d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
		if i < 0 {
			list = append(list, forge.Runner{ID: id, Name: req.Name, Status: forge.StatusOffline, Labels: Labels(req.Labels)})
		}
		return list
	})
	env := map[string]string{
		EnvAccount: ws, EnvRunner: r.UUID,
		EnvClientID: r.OAuthClient.ID, EnvClientSecret: r.OAuthClient.Secret,
	}
	if repo != "" {
		env[EnvRepository] = repo
	}
	if d.cfg.RunnerURL != DefaultURL {
		env[EnvAPI] = d.cfg.RunnerURL
	}
	return forge.Credential{RunnerID: id, Env: env}, nil
}

// atRunnerLimit reports a creation refused because the scope holds as
// many runners as Bitbucket allows (a 400 saying so).
func atRunnerLimit(err error) bool {
	e, ok := errors.AsType[*apiError](err)
	if !ok || e.Status != http.StatusBadRequest {
		return false
	}
	m := strings.ToLower(e.Message)
	return strings.Contains(m, "maximum") || strings.Contains(m, "limit")
}

// Runners lists the scope's runners that carry this manager's name, by
// their runner names: busy while they run a step, idle when online,
// cordoned when disabled. A listing is reused for CacheTTL, or for
// IdleCacheTTL while it is calm (idle.go).
func (d *Forge) Runners(ctx context.Context) ([]forge.Runner, error) {
	if list, ok := d.keptCalm(); ok {
		return list, nil
	}
	if list, ok, _ := d.kept.Get(d.cfg.IdleCacheTTL); ok && d.rl.nearLimit() {
		return list, nil // the hour's calls are nearly spent (limits.go)
	}
	list, ok, stamp := d.kept.Get(d.cfg.CacheTTL)
	if ok {
		return list, nil
	}
	path, err := d.runnersPath(ctx)
	if err != nil {
		return nil, err
	}
	all, err := listAll[runner](ctx, d, "list runners", path+"?pagelen=100")
	if err != nil {
		return nil, rejectDefinitive(err)
	}
	list = make([]forge.Runner, 0, len(all))
	d.mu.Lock()
	for _, r := range all {
		name, ok := strings.CutPrefix(r.Name, d.prefix())
		if !ok || r.UUID == "" {
			continue
		}
		fr := forge.Runner{ID: idOf(r.UUID), Name: name, Status: forge.StatusOffline}
		switch {
		case r.State.Step != nil:
			fr.Status = forge.StatusBusy
		case r.State.Status == stateOnline || r.State.Status == stateDisabled:
			fr.Status = forge.StatusIdle
		}
		fr.Cordoned = r.State.Status == stateDisabled
		fr.Connected = r.State.Status == stateOnline || r.State.Status == stateOffline || r.State.Step != nil
		if fr.Cordoned && r.State.Step == nil {
			d.ended[fr.ID] = true // disabled, no step: none can come
		}
		if r.State.Status == stateOffline && r.State.Step == nil {
			// Stopped while enabled: it may have been given a step as
			// it stopped, and failed it (rescueUnrun, once deleted).
			d.late[fr.ID] = true
		}
		for _, l := range r.Labels {
			if l != LabelSelfHosted && l != LabelLinux {
				fr.Labels = append(fr.Labels, l)
			}
		}
		d.uuids[fr.ID] = r.UUID
		d.keepStep(fr.ID, r)
		list = append(list, fr)
	}
	d.mu.Unlock()
	d.kept.Keep(list, stamp, d.cfg.Clock(), d.cfg.CacheTTL > 0)
	return list, nil
}

// uuid returns a runner's uuid, listing the runners when the driver has
// not seen it yet (a manager started again).
func (d *Forge) uuid(ctx context.Context, id int64) (string, error) {
	d.mu.Lock()
	u, ok := d.uuids[id]
	d.mu.Unlock()
	if ok {
		return u, nil
	}
	d.kept.Drop()
	if _, err := d.Runners(ctx); err != nil {
		return "", err
	}
	d.mu.Lock()
	u, ok = d.uuids[id]
	d.mu.Unlock()
	if !ok {
		return "", fmt.Errorf("bitbucket runner %d (%s): %w", id, d.where(), forge.ErrNotFound)
	}
	return u, nil
}

// Cordon disables a runner: Bitbucket gives it no step, and the step it
// runs goes on. The pool cordons a runner once its agent took a step; one
// that Bitbucket says runs none then had its step end first, and may have
// been given the next as it stopped (rescueUnrun, once it is deleted).
func (d *Forge) Cordon(ctx context.Context, id int64) error {
	r, err := d.disable(ctx, id)
	if err == nil && r.State.Step == nil {
		d.mu.Lock()
		d.late[id] = true
		d.mu.Unlock()
	}
	return err
}

// disable disables a runner and returns it as Bitbucket answered.
func (d *Forge) disable(ctx context.Context, id int64) (runner, error) {
	var r runner
	u, err := d.uuid(ctx, id)
	if err != nil {
		return r, err
	}
	path, err := d.runnersPath(ctx)
	if err != nil {
		return r, err
	}
	err = d.call(ctx, "disable runner "+u, http.MethodPut, path+"/"+url.PathEscape(u)+"/state", map[string]string{"status": stateDisabled}, &r)
	if status(err) == http.StatusNotFound {
		d.forget(id)
		return r, fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	}
	if err != nil {
		return r, err
	}
	// Cordoned because it took a step: the kept listing counts it busy
	// until a listing shows its step over.
	d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
		if i >= 0 {
			list[i].Cordoned, list[i].Status = true, forge.StatusBusy
		}
		return list
	})
	d.mu.Lock()
	d.cordoned[id] = true
	d.mu.Unlock()
	d.noteStep(id, r)
	return r, nil
}

// noteStep keeps the step a runner runs, as an answer about it says, for
// the re-run of a lost one.
func (d *Forge) noteStep(id int64, r runner) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.keepStep(id, r)
}

// keepStep is noteStep with d.mu held.
func (d *Forge) keepStep(id int64, r runner) {
	if r.State.Step == nil || r.State.Step.UUID == "" {
		return
	}
	if len(d.steps) >= maxKeptSteps {
		clear(d.steps)
	}
	d.steps[id] = r.State.Step.UUID
}

// RemoveRunner deletes a runner unless it runs a step. One that a listing
// showed disabled and without a step is deleted at once: no step can come
// to it. Any other is disabled first (unless the driver did already), so
// that no step is given to it while it is read, then deleted if it runs
// none; one that runs a step stays disabled, and goes once it ends. One
// that may have failed a step unrun as it stopped (late) has the latest
// pipelines looked at once it is deleted (rescueUnrun).
func (d *Forge) RemoveRunner(ctx context.Context, id int64) error {
	d.mu.Lock()
	ended, cordoned, late := d.ended[id], d.cordoned[id], d.late[id]
	d.mu.Unlock()
	if !ended {
		if !cordoned {
			if _, err := d.disable(ctx, id); err != nil {
				return err
			}
		}
		r, err := d.read(ctx, id)
		if err != nil {
			return err
		}
		if r.State.Step != nil {
			d.kept.Set(id, forge.StatusBusy)
			return fmt.Errorf("bitbucket runner %s runs step %s: %w", r.UUID, r.State.Step.UUID, forge.ErrBusy)
		}
	}
	return d.deleteRescuing(ctx, id, late)
}

// RemoveExited deletes a runner whose agent has exited (forge.
// ExitedRemover), unless Bitbucket holds a step for it: it gives an
// enabled runner its next step the moment its step ends, and the runner
// is stopped then, so such a step never runs on it. A runner with a step
// is not deleted (the autoscaler deletes only runners without one:
// runners-autoscaler autoscaler/strategy/pct_runners_idle.py); Bitbucket
// fails the step once the runner is offline, the driver then runs its
// pipeline again (Lost), and the runner goes at a later pass. One listed
// disabled without a step is deleted at once. One this driver never
// disabled may have failed such a step as it stopped (rescueUnrun).
func (d *Forge) RemoveExited(ctx context.Context, id int64) error {
	d.mu.Lock()
	ended, cordoned, late := d.ended[id], d.cordoned[id], d.late[id]
	d.mu.Unlock()
	if !ended {
		r, err := d.read(ctx, id)
		if err != nil {
			return err
		}
		if r.State.Step != nil {
			d.kept.Set(id, forge.StatusBusy)
			d.Lost(ctx, forge.Runner{ID: id, Name: r.Name})
			return fmt.Errorf("bitbucket runner %s, whose agent exited, holds step %s: %w", r.UUID, r.State.Step.UUID, forge.ErrBusy)
		}
	}
	// Its step ended with no disable from this manager before (one that
	// was down, or started since): it may have been given the next step
	// as it stopped, and failed it at once.
	return d.deleteRescuing(ctx, id, late || !ended && !cordoned)
}

// deleteRescuing deletes a runner and then, where it may have failed a
// step unrun as it stopped, looks for that step in the background
// (rescueUnrun).
func (d *Forge) deleteRescuing(ctx context.Context, id int64, mayHaveFailed bool) error {
	if err := d.delete(ctx, id); err != nil {
		return err
	}
	if mayHaveFailed {
		d.rescueUnrun(context.WithoutCancel(ctx))
	}
	return nil
}

// read reads one runner.
func (d *Forge) read(ctx context.Context, id int64) (runner, error) {
	var r runner
	u, err := d.uuid(ctx, id)
	if err != nil {
		return r, err
	}
	path, err := d.runnersPath(ctx)
	if err != nil {
		return r, err
	}
	err = d.call(ctx, "read runner "+u, http.MethodGet, path+"/"+url.PathEscape(u), nil, &r)
	if status(err) == http.StatusNotFound {
		d.forget(id)
		return r, fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	}
	d.noteStep(id, r)
	return r, err
}

func (d *Forge) delete(ctx context.Context, id int64) error {
	u, err := d.uuid(ctx, id)
	if err != nil {
		return err
	}
	path, err := d.runnersPath(ctx)
	if err != nil {
		return err
	}
	err = d.call(ctx, "delete runner "+u, http.MethodDelete, path+"/"+url.PathEscape(u), nil, nil)
	switch {
	case err == nil:
		d.forget(id)
		return nil
	case status(err) == http.StatusNotFound:
		d.forget(id)
		return fmt.Errorf("%w: %w", forge.ErrNotFound, err)
	}
	d.kept.Drop()
	return err
}

// forget drops a deleted runner.
func (d *Forge) forget(id int64) {
	d.kept.Forget(id)
	d.mu.Lock()
	delete(d.uuids, id)
	delete(d.cordoned, id)
	delete(d.late, id)
	delete(d.ended, id)
	d.mu.Unlock()
}

// ImplicitLabels are the labels Bitbucket gives every Linux runner.
func (d *Forge) ImplicitLabels() []string { return []string{LabelSelfHosted, LabelLinux} }

// Meets matches a step's runs-on to a pool's labels in the form its
// runners carry them (forge.DemandMatcher): a hardware label gpu-h100 is
// gpu.h100 on the runner, as a step names it.
func (d *Forge) Meets(labels, runsOn []string) bool {
	have := Labels(slices.Concat(labels, d.ImplicitLabels()))
	for _, l := range runsOn {
		if !slices.Contains(have, strings.ToLower(l)) {
			return false
		}
	}
	return true
}
