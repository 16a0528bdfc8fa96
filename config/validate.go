package config

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/placement"
	"github.com/runfleet/runfleet/provider"
)

// nameRE is what a manager, forge or pool name may be: it becomes part of
// runner names, process records and container and instance names, so it
// is held to DNS-label rules.
var nameRE = lazyregexp.New(`^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`)

var envName = lazyregexp.New(`^[A-Za-z_][A-Za-z0-9_]*$`)

// problems collects what is wrong with a config, each naming its field.
type problems []error

func (ps *problems) add(field string, format string, args ...any) {
	*ps = append(*ps, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
}

// addAll adds a driver's problems, whose fields are relative to prefix.
func (ps *problems) addAll(prefix string, err error) {
	*ps = append(*ps, flatten(Within(prefix, err))...)
}

// Within names each of a part's problems (joined with errors.Join), whose
// fields are relative to the part, by its path in the whole: "docker" and
// "memory: ..." give "docker.memory: ...".
func Within(path string, err error) error {
	var out []error
	for _, e := range flatten(err) {
		out = append(out, fmt.Errorf("%s.%w", path, e))
	}
	return errors.Join(out...)
}

// flatten unpacks joined errors.
func flatten(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, flatten(e)...)
		}
		return out
	}
	return []error{err}
}

// sortErrors orders joined errors for a stable message.
func sortErrors(err error) error {
	errs := flatten(err)
	slices.SortStableFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	return errors.Join(errs...)
}

// currencyRE is an ISO 4217 code's shape.
var currencyRE = lazyregexp.New(`^[A-Z]{3}$`)

// price reports whether v is a price per hour: not negative, not NaN, not
// infinite.
func price(v float64) bool { return v >= 0 && !math.IsInf(v, 1) }

// Validate checks a defaulted config, the drivers' sections included, and
// returns every problem found.
func (c *Config) Validate() error {
	var ps problems
	if !nameRE.MatchString(c.ID) {
		ps.add("id", "%q is not a valid name (lower-case letters, digits and '-', at most 40)", c.ID)
	}
	if err := c.Resync.Check(); err != nil {
		ps.add("resync", "%v", err)
	} else if c.Resync.Duration < 100*time.Millisecond {
		ps.add("resync", "%s is too short (at least 100ms)", c.Resync)
	}
	if err := c.DrainTimeout.Check(); err != nil {
		ps.add("drain_timeout", "%v", err)
	}
	c.validateListeners(&ps)
	if c.History.MaxJobs < 0 {
		ps.add("history.max_jobs", "%d is negative", c.History.MaxJobs)
	}
	if err := c.History.Keep.Check(); err != nil {
		ps.add("history.keep", "%v", err)
	} else if c.History.Keep.Duration < time.Hour {
		ps.add("history.keep", "%s is too short (at least 1h)", c.History.Keep)
	}
	if !currencyRE.MatchString(c.Currency) {
		ps.add("currency", "%q is not a currency code (three capital letters: USD, EUR)", c.Currency)
	}
	if le := c.LeaderElection; le != nil {
		le.validate(&ps)
	}
	if len(c.Forges) == 0 {
		ps.add("forges", "at least one forge is required")
	}
	if len(c.Pools) == 0 {
		ps.add("pools", "at least one pool is required")
	}
	forges := map[string]bool{}
	for i, f := range c.Forges {
		field := fmt.Sprintf("forges[%d]", i)
		validateName(&ps, field, f.Name, "forge", forges)
		f.validate(&ps, field)
	}
	types := map[string]string{}
	for _, f := range c.Forges {
		types[f.Name] = f.Type
	}
	pools := map[string]bool{}
	for i, p := range c.Pools {
		field := fmt.Sprintf("pools[%d]", i)
		validateName(&ps, field, p.Name, "pool", pools)
		if !forges[p.Forge] {
			ps.add(field+".forge", "%q is not a configured forge", p.Forge)
		}
		p.validate(&ps, field)
		// The forge's own limits on labels, where it has some.
		if d, ok := forge.Lookup(types[p.Forge]); ok {
			if lc, ok := d.(forge.LabelChecker); ok && len(p.Labels) > 0 {
				ps.addAll(field, lc.CheckLabels(p.Labels))
			}
		}
	}
	return sortErrors(errors.Join(ps...))
}

func (le *LeaderElection) validate(ps *problems) {
	const f = "leader_election"
	if how, out := provider.LeftOut("kubernetes"); out {
		// The election runs on client-go, which comes with the
		// kubernetes driver.
		ps.add(f, "needs the Kubernetes client, which is not in this build of runfleet: %s", how)
	}
	d := map[string]Duration{"lease_duration": le.LeaseDuration, "renew_deadline": le.RenewDeadline, "retry_period": le.RetryPeriod}
	bad := false
	for _, k := range slices.Sorted(maps.Keys(d)) {
		if err := d[k].Check(); err != nil {
			ps.add(f+"."+k, "%v", err)
			bad = true
		}
	}
	if le.InCluster && (le.Kubeconfig != "" || le.Context != "") {
		ps.add(f+".in_cluster", "is set with kubeconfig or context; keep one")
	}
	if le.Advertise != "" {
		if u, err := url.Parse(le.Advertise); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
			ps.add(f+".advertise", "%q is not this manager's webhook listener as a URL (http://<address>:<port>)", le.Advertise)
		}
	}
	if le.Lease != "" && !leaseRE.MatchString(le.Lease) {
		ps.add(f+".lease", "%q is not a valid Lease name", le.Lease)
	}
	if bad {
		return
	}
	// client-go's own conditions: a leader stands down before its lease
	// can be taken, and tries to renew more than once before that.
	switch {
	case le.LeaseDuration.Duration <= le.RenewDeadline.Duration:
		ps.add(f+".renew_deadline", "%s must be shorter than lease_duration %s", le.RenewDeadline, le.LeaseDuration)
	case float64(le.RenewDeadline.Duration) <= 1.2*float64(le.RetryPeriod.Duration):
		ps.add(f+".retry_period", "%s must be shorter than renew_deadline %s / 1.2", le.RetryPeriod, le.RenewDeadline)
	}
}

// leaseRE is a DNS subdomain: what a Lease may be called.
var leaseRE = lazyregexp.New(`^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$`)

// validateListeners keeps the status page and /metrics off the listener
// the forges reach, unless a token guards them.
func (c *Config) validateListeners(ps *problems) {
	for field, addr := range map[string]string{"listen": c.Listen, "status_listen": c.StatusListen} {
		if addr == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			ps.add(field, "%q is not host:port", addr)
		}
	}
	if c.StatusToken != "" && len(c.StatusToken) < 16 {
		ps.add("status_token", "is too short (at least 16 characters)")
	}
	if c.StatusListen != "" && c.StatusListen == c.Listen && c.StatusToken == "" {
		ps.add("status_listen", "%q is listen, which the forges reach: the status page and /metrics would be public; set status_token, or another address", c.StatusListen)
	}
}

func validateName(ps *problems, field, name, what string, seen map[string]bool) {
	switch {
	case name == "":
		ps.add(field+".name", "is required")
	case !nameRE.MatchString(name):
		ps.add(field+".name", "%q is not a valid name (lower-case letters, digits and '-', at most 40)", name)
	case seen[name]:
		ps.add(field+".name", "%q is used by another %s", name, what)
	}
	seen[name] = true
}

// validate checks a forge's common fields, then hands it to its driver.
func (f Forge) validate(ps *problems, field string) {
	if err := checkURL(f.URL); err != nil {
		ps.add(field+".url", "%v", err)
	}
	if f.RunnerURL != "" {
		if err := checkURL(f.RunnerURL); err != nil {
			ps.add(field+".runner_url", "%v", err)
		}
	}
	if err := f.PollInterval.Check(); err != nil {
		ps.add(field+".poll_interval", "%v", err)
	} else if !f.PollOff && f.PollInterval.Duration < time.Second {
		ps.add(field+".poll_interval", "%s is too short (at least 1s, or 0s for no polling)", f.PollInterval.Duration)
	}
	if f.CallsPerHour < 0 {
		ps.add(field+".calls_per_hour", "must be positive, got %d", f.CallsPerHour)
	}
	if f.CallBurst < 0 {
		ps.add(field+".call_burst", "must be positive, got %d", f.CallBurst)
	}
	if f.WebhookSecret != "" && len(f.WebhookSecret) < 16 {
		ps.add(field+".webhook_secret", "is too short (at least 16 characters)")
	}
	d, ok := forge.Lookup(f.Type)
	if how, out := forge.LeftOut(f.Type); !ok && out {
		ps.add(field+".type", "forge type %q is not in this build of runfleet: %s", f.Type, how)
		return
	}
	if !ok {
		ps.add(field+".type", "unknown forge type %q (known: %s)", f.Type, strings.Join(forge.Types(), ", "))
		return
	}
	ps.addAll(field, d.Check(f.Driver()))
}

// Driver is the forge's configuration as its driver gets it.
func (f Forge) Driver() forge.Config {
	return forge.Config{Name: f.Name, URL: f.URL, RunnerURL: f.RunnerURL, Token: f.Token, Section: f.Section}
}

// Budget is the connection's budget of API calls.
func (f Forge) Budget() *rate.Limiter {
	return rate.NewLimiter(rate.Limit(float64(f.CallsPerHour)/3600), f.CallBurst)
}

// validate checks a pool's common fields, then its provider's section.
func (p Pool) validate(ps *problems, field string) {
	if len(p.Labels) == 0 {
		ps.add(field+".labels", "at least one label is required")
	}
	seen := map[string]bool{}
	for j, l := range p.Labels {
		lf := fmt.Sprintf("%s.labels[%d]", field, j)
		switch {
		case l == "":
			ps.add(lf, "is empty")
		case strings.ContainsAny(l, ":, \t\n"):
			ps.add(lf, "%q must not contain ':', ',' or spaces", l)
		case seen[l]:
			ps.add(lf, "%q is repeated", l)
		}
		seen[l] = true
	}
	if p.Size < 0 {
		ps.add(field+".size", "must not be negative, got %d", p.Size)
	}
	if p.Max < 0 {
		ps.add(field+".max", "must not be negative, got %d", p.Max)
	} else if p.Max < p.Size && !p.SizeFromGPUs {
		ps.add(field+".max", "%d is less than size %d", p.Max, p.Size)
	}
	if p.Max > 10000 {
		ps.add(field+".max", "%d is more than 10000", p.Max)
	}
	if v := p.PricePerHour; v != nil && !price(*v) {
		ps.add(field+".price_per_hour", "%v is not a price (a number, 0 or more)", *v)
	}
	for _, t := range slices.Sorted(maps.Keys(p.Prices)) {
		if !price(p.Prices[t]) {
			ps.add(field+".prices."+t, "%v is not a price (a number, 0 or more)", p.Prices[t])
		}
	}
	if p.RerunOnTimeout < 0 || p.RerunOnTimeout > 100 {
		ps.add(field+".rerun_on_timeout", "%d is not a number of re-runs between 0 and 100", p.RerunOnTimeout)
	}
	for name, d := range map[string]Duration{"idle_timeout": p.IdleTimeout, "max_lifetime": p.MaxLifetime, "bootstrap_timeout": p.BootstrapTimeout, "agent.fetch_interval": p.Agent.FetchInterval} {
		if err := d.Check(); err != nil {
			ps.add(field+"."+name, "%v", err)
		}
	}
	if err := p.JobTimeout.Check(); err == nil && p.JobTimeout.Given() && p.JobTimeout.Duration < time.Minute {
		ps.add(field+".job_timeout", "%s is under a minute", p.JobTimeout.Duration)
	} else if err != nil {
		ps.add(field+".job_timeout", "%v", err)
	}
	if p.GPUsPerRunner == badGPUCount {
		ps.add(field+".gpus_per_runner", "must be a whole number of GPUs or \"all\"")
	}
	if d := p.Dynamic; d != nil {
		ps.addAll(field+".dynamic", d.Check())
		if len(d.Keys()) == 0 {
			ps.add(field+".dynamic", "allows nothing: give at least one of gpus, gpu, cpu, mem, image, spot")
		}
		if p.Max < 1 {
			ps.add(field+".max", "a pool whose jobs choose their machine needs max: how many runners its jobs may have at once")
		}
	}
	if p.Workdir != "" && !filepath.IsAbs(p.Workdir) {
		ps.add(field+".workdir", "%q must be an absolute path", p.Workdir)
	}
	for k := range p.Env {
		if !envName.MatchString(k) {
			ps.add(field+".env", "%q is not a valid environment variable name", k)
		}
	}
	d, ok := provider.Lookup(p.Provider)
	if how, out := provider.LeftOut(p.Provider); !ok && out {
		ps.add(field+".provider", "provider %q is not in this build of runfleet: %s", p.Provider, how)
		return
	}
	if !ok {
		ps.add(field+".provider", "unknown provider %q (known: %s)", p.Provider, strings.Join(provider.Names(), ", "))
		return
	}
	ps.addAll(field, d.Check(p.Driver("", "")))
}

// Driver is the pool's configuration as its provider's driver gets it;
// the caller adds the host's GPUs and a logger.
func (p Pool) Driver(manager, stateDir string) provider.PoolConfig {
	return provider.PoolConfig{Manager: manager, Pool: p.Name, StateDir: stateDir, Workdir: p.Workdir, GPUsPerRunner: p.gpusPerRunner(), MaxLifetime: p.MaxLifetime.Duration, IdleTimeout: p.IdleTimeout.Duration, JobTimeout: p.JobTimeout.Duration, Section: p.Section}
}

// Want is what the pool asks of its placement, as written: the size
// placement fits to the GPUs is its own, never written back here.
func (p Pool) Want() placement.Want {
	return placement.Want{
		Pool: p.Name, Provider: p.Provider, Labels: p.Labels,
		GPUsPerRunner: p.gpusPerRunner(), SizeFromGPUs: p.SizeFromGPUs,
		Size: p.Size, Max: p.Max, HardwareLabels: p.HasHardwareLabels(), Dynamic: p.Dynamic,
	}
}

// gpusPerRunner is gpus_per_runner as a number (-1 all), 0 where it is
// not one (an error Check reports).
func (p Pool) gpusPerRunner() int {
	if p.GPUsPerRunner == badGPUCount {
		return 0
	}
	return int(p.GPUsPerRunner)
}

func checkURL(s string) error {
	if s == "" {
		return errors.New("is required")
	}
	if !strings.HasPrefix(s, "http://") && !strings.HasPrefix(s, "https://") {
		return fmt.Errorf("%q must start with http:// or https://", s)
	}
	if strings.TrimPrefix(strings.TrimPrefix(s, "https://"), "http://") == "" {
		return fmt.Errorf("%q has no host", s)
	}
	return nil
}
