package pool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// fakeForge is an in-memory forge with the semantics the pool relies on:
// RemoveRunner refuses a busy runner.
type fakeForge struct {
	mu        sync.Mutex
	nextID    int64
	runners   map[int64]*forge.Runner
	failList  error
	failReg   error // every Register fails with it
	removed   []string
	calls     int
	removals  int // RemoveRunner calls
	refreshed int // Refresh calls
	requests  []forge.RunnerRequest
	// selfRegister makes Register hand out a registration token, as
	// GitHub's does where just-in-time runners are not offered: no
	// registration until the agent makes its own (enrol).
	selfRegister bool
	// keep makes Runners answer from a kept listing, read afresh only
	// after Refresh, as the drivers keep theirs for a while (GitLab's
	// CacheTTL); a registration is added to it, as the drivers add one.
	keep bool
	kept []forge.Runner
	// hooks, called without the lock
	beforeRegister func()
	afterRunners   func()
}

func newFakeForge() *fakeForge { return &fakeForge{runners: map[int64]*forge.Runner{}} }

func (f *fakeForge) Register(_ context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	if f.beforeRegister != nil {
		f.beforeRegister()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.requests = append(f.requests, req)
	if f.failReg != nil {
		return forge.Credential{}, f.failReg
	}
	if f.selfRegister {
		return forge.Credential{Files: map[string][]byte{".token": []byte("registration token")}}, nil
	}
	f.nextID++
	f.runners[f.nextID] = &forge.Runner{ID: f.nextID, Name: req.Name, Status: forge.StatusOffline, Labels: req.Labels}
	if f.kept != nil {
		f.kept = append(f.kept, *f.runners[f.nextID])
	}
	return forge.Credential{RunnerID: f.nextID, Files: map[string][]byte{".runner": []byte(fmt.Sprint(f.nextID))}}, nil
}

func (f *fakeForge) Runners(context.Context) ([]forge.Runner, error) {
	f.mu.Lock()
	f.calls++
	if f.failList != nil {
		f.mu.Unlock()
		return nil, f.failList
	}
	var out []forge.Runner
	for _, r := range f.runners {
		out = append(out, *r)
	}
	switch {
	case f.keep && f.kept != nil:
		out = slices.Clone(f.kept)
	case f.keep:
		f.kept = slices.Clone(out)
	}
	hook := f.afterRunners
	f.mu.Unlock()
	if hook != nil {
		hook()
	}
	return out, nil
}

func (f *fakeForge) RemoveRunner(_ context.Context, id int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.removals++
	r, ok := f.runners[id]
	if !ok {
		return forge.ErrNotFound
	}
	if r.Status == forge.StatusBusy {
		return forge.ErrBusy
	}
	delete(f.runners, id)
	f.kept = slices.DeleteFunc(f.kept, func(k forge.Runner) bool { return k.ID == id })
	f.removed = append(f.removed, r.Name)
	return nil
}

// enrol registers a runner as its agent does with a registration token.
func (f *fakeForge) enrol(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextID++
	f.runners[f.nextID] = &forge.Runner{ID: f.nextID, Name: name, Status: forge.StatusIdle}
}

func (f *fakeForge) byName(name string) *forge.Runner {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.runners {
		if r.Name == name {
			return r
		}
	}
	return nil
}

func (f *fakeForge) set(name string, st forge.Status) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.runners {
		if r.Name == name {
			r.Status = st
		}
	}
}

// finish completes a runner's job the way an ephemeral runner does: the
// forge deletes the registration and the agent exits.
func (f *fakeForge) finish(name string, p *fakeProvider) {
	f.mu.Lock()
	for id, r := range f.runners {
		if r.Name == name {
			delete(f.runners, id)
		}
	}
	f.mu.Unlock()
	p.exit(name)
}

func (f *fakeForge) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.runners)
}

// fakeProvider is an in-memory provider.
type fakeProvider struct {
	mu        sync.Mutex
	now       func() time.Time
	insts     map[string]*provider.Instance
	specs     map[string]provider.Spec
	failNext  error
	refuse    func(provider.Spec) error // each Create, where set: a backend that cannot make what a spec asks
	deleted   []string
	created   int
	onChanged func(string)
	// queued makes machines that wait in their backend's queue (a
	// batch job pending for a node) until started.
	queued bool
}

func newFakeProvider(now func() time.Time) *fakeProvider {
	return &fakeProvider{now: now, insts: map[string]*provider.Instance{}, specs: map[string]provider.Spec{}}
}

func (p *fakeProvider) Create(_ context.Context, s provider.Spec) (provider.Instance, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.failNext != nil {
		err := p.failNext
		p.failNext = nil
		return provider.Instance{}, err
	}
	if p.refuse != nil {
		if err := p.refuse(s); err != nil {
			return provider.Instance{}, err
		}
	}
	if in, ok := p.insts[s.Name]; ok {
		return *in, nil
	}
	p.created++
	// A machine that replaces another of the same name has a new id.
	in := &provider.Instance{Name: s.Name, Manager: s.Manager, Pool: s.Pool, State: provider.StateRunning, Created: p.now(), ID: fmt.Sprintf("%s#%d", s.Name, p.created), GPUs: slices.Clone(s.GPUs)}
	if p.queued {
		in.State, in.Reason = provider.StateCreated, "pending: Resources"
	}
	p.insts[s.Name] = in
	p.specs[s.Name] = s
	if s.Record != nil {
		// What a provider fills in: its machines' host (provider.Spec.Record).
		s.Record.System = &record.System{OS: "Fake OS 1", Kernel: "6.1.0-fake"}
	}
	return *in, nil
}

func (p *fakeProvider) Delete(_ context.Context, name string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.insts[name]; ok {
		p.deleted = append(p.deleted, name)
	}
	delete(p.insts, name)
	return nil
}

func (p *fakeProvider) List(_ context.Context, manager string) ([]provider.Instance, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []provider.Instance
	for _, in := range p.insts {
		if in.Manager == manager {
			out = append(out, *in)
		}
	}
	return out, nil
}

func (p *fakeProvider) Watch(_ context.Context, changed func(string)) {
	p.mu.Lock()
	p.onChanged = changed
	p.mu.Unlock()
}

func (p *fakeProvider) exit(name string) {
	p.mu.Lock()
	if in, ok := p.insts[name]; ok {
		in.State = provider.StateExited
	}
	fn := p.onChanged
	p.mu.Unlock()
	if fn != nil {
		fn(name)
	}
}

func (p *fakeProvider) running() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for n, in := range p.insts {
		if in.State == provider.StateRunning {
			out = append(out, n)
		}
	}
	return out
}

func (p *fakeProvider) add(in provider.Instance) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.insts[in.Name] = &in
}

type fakeAgent struct{}

func (fakeAgent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	if len(cred.Files) == 0 {
		return provider.Spec{}, errors.New("no credential")
	}
	return provider.Spec{Name: r.Name, Manager: r.Manager, Pool: r.Pool, Command: "agent", Files: cred.Files}, nil
}

// clock is a settable clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// labelsOf is the labels a runner registered with.
func (f *fakeForge) labelsOf(name string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.runners {
		if r.Name == name {
			return r.Labels
		}
	}
	return nil
}

func (f *fakeForge) Refresh() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refreshed++
	f.kept = nil
}
