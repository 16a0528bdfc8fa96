package daemon_test

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// toyForge is a forge kept in memory, with the semantics the pool relies
// on: single-use registrations, a busy runner cannot be removed, and an
// ephemeral runner's registration goes when its job ends. It exists to
// show that a forge is added in a package (here, files) of its own.
func init() { forge.Register("toy", toyForgeDriver{}) }

type toyForgeDriver struct{}

// toySection is what a toy forge adds to the common fields.
type toySection struct {
	Queue string `json:"queue"`
}

func (toyForgeDriver) decode(c forge.Config) (toySection, error) {
	var s toySection
	if err := config.DecodeSection(c.Section, &s); err != nil {
		return s, err
	}
	if s.Queue == "" {
		return s, fmt.Errorf("queue: is required")
	}
	return s, nil
}

func (d toyForgeDriver) Check(c forge.Config) error {
	_, err := d.decode(c)
	return err
}

var (
	toyMu     sync.Mutex
	toyForges = map[string]*toyForge{} // by queue, for the test to drive
)

func (d toyForgeDriver) Open(_ context.Context, c forge.Config, env forge.Env) (forge.Forge, error) {
	s, err := d.decode(c)
	if err != nil {
		return nil, err
	}
	f := &toyForge{token: c.Token.Reveal(), runners: map[int64]*forge.Runner{}}
	f.losing.Ledger = env.Owed
	toyMu.Lock()
	toyForges[s.Queue] = f
	toyMu.Unlock()
	return f, nil
}

type toyForge struct {
	token   string // the forge's own token: never handed to a runner
	losing  forge.Following
	mu      sync.Mutex
	rerun   []string // the lost runners whose job was re-run
	next    int64
	runners map[int64]*forge.Runner
	issued  int
}

func (f *toyForge) Register(_ context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	f.issued++
	f.runners[f.next] = &forge.Runner{ID: f.next, Name: req.Name, Status: forge.StatusOffline, Labels: req.Labels}
	return forge.Credential{RunnerID: f.next, Env: map[string]string{"TOY_RUNNER_TOKEN": fmt.Sprintf("single-use-%d", f.next)}}, nil
}

func (f *toyForge) Runners(context.Context) ([]forge.Runner, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []forge.Runner
	for _, r := range f.runners {
		out = append(out, *r)
	}
	return out, nil
}

func (f *toyForge) RemoveRunner(_ context.Context, id int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.runners[id]
	switch {
	case !ok:
		return forge.ErrNotFound
	case r.Status == forge.StatusBusy:
		return forge.ErrBusy
	}
	delete(f.runners, id)
	return nil
}

// set changes a registration's status, as the agent connecting or taking
// a job does; end deletes it, as the forge does after an ephemeral
// runner's job.
func (f *toyForge) set(name string, st forge.Status) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.runners {
		if r.Name == name {
			r.Status = st
		}
	}
}

func (f *toyForge) end(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, r := range f.runners {
		if r.Name == name {
			delete(f.runners, id)
		}
	}
}

func (f *toyForge) count() (registered, issued int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.runners), f.issued
}

// Agent: the toy forge's runner agent takes its credential from the
// environment.
func (f *toyForge) Agent(cfg agent.Config) (agent.Agent, error) { return toyAgent{path: cfg.Path}, nil }

type toyAgent struct{ path string }

func (a toyAgent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	env := map[string]string{}
	for k, v := range r.Env {
		env[k] = v
	}
	for k, v := range cred.Env {
		env[k] = v
	}
	return provider.Spec{Name: r.Name, Manager: r.Manager, Pool: r.Pool, Command: a.path, Env: env}, nil
}

// Lost re-runs the lost runner's job at once (forge.Rerunner).
func (f *toyForge) Lost(ctx context.Context, r forge.Runner) {
	f.losing.Go(ctx, r, func(context.Context) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.rerun = append(f.rerun, r.Name)
	})
}

func (f *toyForge) reruns() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.rerun)
}
