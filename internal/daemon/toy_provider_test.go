package daemon_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// toyProvider keeps machines in memory. Its pool section says which
// flavour of machine to make; it reports exits as they happen.
func init() { provider.Register("toy", toyProviderDriver{}) }

type toyProviderDriver struct{}

type toyFlavour struct {
	Flavour string `json:"flavour"`
}

func (toyProviderDriver) decode(c provider.PoolConfig) (toyFlavour, error) {
	var s toyFlavour
	if err := config.DecodeSection(c.Section, &s); err != nil {
		return s, fmt.Errorf("toy.%w", err)
	}
	if s.Flavour != "small" && s.Flavour != "large" && s.Flavour != "handoff" {
		return s, fmt.Errorf("toy.flavour: %q is not small, large or handoff", s.Flavour)
	}
	return s, nil
}

func (d toyProviderDriver) Check(c provider.PoolConfig) error {
	_, err := d.decode(c)
	return err
}

var toyProviders sync.Map // pool name -> *toyProvider, for the test to drive

func (d toyProviderDriver) Open(_ context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := d.decode(c)
	if err != nil {
		return nil, err
	}
	p := &toyProvider{flavour: s.Flavour, machines: map[string]*toyMachine{}}
	toyProviders.Store(c.Pool, p)
	return p, nil
}

// HandoffHandler: a handoff toy's machines claim their assignment from
// the manager (provider.Handoffer).
func (p *toyProvider) HandoffHandler() http.Handler {
	if p.flavour != "handoff" {
		return nil
	}
	return toyDesk{}
}

// toyDesk answers every claim with a teapot, and has refused one, as
// vm.Desk tells it.
type toyDesk struct{}

func (toyDesk) ServeHTTP(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) }

func (toyDesk) Refusals(time.Time) []string {
	return []string{"1 machine claims refused at http://m/handoff/toys: the proof does not verify"}
}

type toyMachine struct {
	inst provider.Instance
	spec provider.Spec
}

type toyProvider struct {
	flavour  string
	mu       sync.Mutex
	n        int
	machines map[string]*toyMachine
	deleted  []string
	watchers []func(string)
	priced   int // price list calls
}

func (p *toyProvider) Create(_ context.Context, s provider.Spec) (provider.Instance, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if m, ok := p.machines[s.Name]; ok {
		return m.inst, nil
	}
	p.n++
	if s.Record != nil {
		s.Record.Machine.InstanceType, s.Record.Machine.Zone = "toy."+p.flavour, "toyland-1a"
	}
	m := &toyMachine{spec: s, inst: provider.Instance{
		Name: s.Name, Manager: s.Manager, Pool: s.Pool, State: provider.StateRunning,
		Created: time.Now(), ID: fmt.Sprintf("%s-%s-%d", p.flavour, s.Name, p.n),
	}}
	p.machines[s.Name] = m
	return m.inst, nil
}

func (p *toyProvider) Delete(_ context.Context, name string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.machines[name]; ok {
		p.deleted = append(p.deleted, name)
	}
	delete(p.machines, name)
	return nil
}

func (p *toyProvider) List(_ context.Context, manager string) ([]provider.Instance, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []provider.Instance
	for _, m := range p.machines {
		if m.inst.Manager == manager {
			out = append(out, m.inst)
		}
	}
	return out, nil
}

func (p *toyProvider) Watch(_ context.Context, changed func(string)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.watchers = append(p.watchers, changed)
}

// exit ends a machine's agent and tells the watchers.
func (p *toyProvider) exit(name string) {
	p.mu.Lock()
	if m, ok := p.machines[name]; ok {
		m.inst.State = provider.StateExited
	}
	ws := slices.Clone(p.watchers)
	p.mu.Unlock()
	for _, w := range ws {
		w(name)
	}
}

// running returns the running machines: name -> machine id, spec.
func (p *toyProvider) running() map[string]toyMachine {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]toyMachine{}
	for name, m := range p.machines {
		if m.inst.State == provider.StateRunning {
			out[name] = *m
		}
	}
	return out
}

// toyPricePerHour is what a small toy costs by the hour, as its price
// list says (provider.Pricer); a large one has no price listed.
const toyPricePerHour = 1.25

func (p *toyProvider) Price(_ context.Context, m record.Machine, _ time.Time) (record.Price, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.priced++
	if m.InstanceType != "toy.small" {
		return record.Price{}, fmt.Errorf("%s: %w", m.InstanceType, provider.ErrNotPriced)
	}
	return record.Price{PerHour: toyPricePerHour, Currency: "USD", Source: "toy price list"}, nil
}
