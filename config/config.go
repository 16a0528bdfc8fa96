// Package config loads and validates runfleet's YAML configuration.
//
// Every error names the field and the value that was wrong, so that a bad
// config is fixed in one go and starts nothing.
package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// Config is the whole configuration of one manager.
type Config struct {
	// ID names this manager. Everything it creates carries the id, so
	// that two managers never touch each other's runners.
	ID string `json:"id"`
	// StateDir holds the manager's records (runner processes, logs).
	StateDir string `json:"state_dir"`
	// Resync is how often the manager re-reads the forge and the provider
	// even when no event arrived.
	Resync Duration `json:"resync"`
	// DrainTimeout is how long shutdown waits for busy runners.
	DrainTimeout Duration `json:"drain_timeout"`

	// GPU says how this host's GPUs are found.
	GPU GPUDetection `json:"gpu"`
	// Listen is the address of `serve`'s HTTP server: webhooks
	// (/webhook/<forge>), /metrics, /healthz and the status page (/).
	// "" turns it off.
	Listen string `json:"listen"`

	Forges []Forge `json:"forges"`
	Pools  []Pool  `json:"pools"`
}

// GPUDetection says how the host's GPUs are found.
type GPUDetection struct {
	// NvidiaSMI is the nvidia-smi to run. When set, runfleet reads the
	// GPUs from it rather than through NVML.
	NvidiaSMI string `json:"nvidia_smi"`
}

// Forge is one forge connection.
type Forge struct {
	Name string `json:"name"`
	Type string `json:"type"` // gitea or github
	// URL is the forge's address. For github it is the repository
	// (https://github.com/owner/repo) or organisation
	// (https://github.com/org) itself, on github.com or an Enterprise
	// Server, and the scope is inferred from it.
	URL string `json:"url"`
	// Token is the forge API token. It may be "${ENV_VAR}"; TokenFile
	// names a file holding it instead.
	Token     Secret `json:"token"`
	TokenFile string `json:"token_file"`
	// Scope is where runners are registered: repo, org or instance.
	Scope string `json:"scope"`
	Repo  string `json:"repo"` // owner/name, with scope repo
	Org   string `json:"org"`  // with scope org
	// RunnerURL is the forge's address as runners see it, when it differs
	// from URL: a container reaches a forge on the host through the
	// bridge, not through 127.0.0.1. It defaults to URL.
	RunnerURL string `json:"runner_url"`

	// GitHub only. APIURL overrides the REST base derived from URL.
	APIURL string `json:"api_url"`
	// A GitHub App instead of a token: its id, the installation's id
	// and the App's private key (PEM), in a file.
	AppID          int64  `json:"app_id"`
	InstallationID int64  `json:"installation_id"`
	PrivateKeyFile string `json:"private_key_file"`
	PrivateKey     Secret `json:"-"`
	// RunnerGroupID is the runner group JIT runners join (1, Default).
	RunnerGroupID int64 `json:"runner_group_id"`
	// CacheTTL is how long a listing of runners is reused; the driver
	// keeps it current in between from what it does itself.
	CacheTTL Duration `json:"cache_ttl"`

	// WebhookSecret turns on /webhook/<name>: workflow_job deliveries
	// signed with it report queued jobs at once. It may be "${ENV_VAR}".
	WebhookSecret Secret `json:"webhook_secret"`
	// PollInterval is how often the forge's job queue is read, so that a
	// lost webhook never strands a job; "0s" turns polling off.
	PollInterval Duration `json:"poll_interval"`
	// PollOff is set when poll_interval is written as zero.
	PollOff bool `json:"-"`
}

// Pool is a set of identical single-job runners.
type Pool struct {
	Name     string   `json:"name"`
	Forge    string   `json:"forge"`
	Labels   []string `json:"labels"`
	Provider string   `json:"provider"` // process or docker
	// Size is the number of idle runners kept ready.
	Size int `json:"size"`
	// Max caps the number of runners, busy ones included. It defaults to
	// Size.
	Max int `json:"max"`
	// IdleTimeout removes idle runners above Size after this long.
	IdleTimeout Duration `json:"idle_timeout"`
	// MaxLifetime recycles an idle runner this old.
	MaxLifetime Duration `json:"max_lifetime"`
	// BootstrapTimeout replaces a runner that has not come online at the
	// forge this long after it was created.
	BootstrapTimeout Duration `json:"bootstrap_timeout"`
	// Workdir is the parent of the runners' fresh working directories.
	Workdir string `json:"workdir"`
	// Env is added to the agent's environment. Never put secrets here:
	// jobs can read it.
	Env   map[string]string `json:"env"`
	Agent Agent             `json:"agent"`
	// Docker configures the runner containers of a pool whose provider is
	// docker.
	Docker *Docker `json:"docker,omitempty"`
	// RetryLost re-runs a job whose runner's machine went away mid-job
	// (GitHub: the run's failed jobs, once). Default true.
	RetryLost *bool `json:"retry_lost,omitempty"`
	// Single fills the pool's slots once: a one-shot runner
	// (`runfleet runner --single`). Not settable from YAML.
	Single bool `json:"-"`

	// GPUsPerRunner gives each runner GPUs of its own (or MIG devices): a
	// number, or "all". A GPU is never given to two live runners.
	GPUsPerRunner GPUCount `json:"gpus_per_runner"`
	// HardwareLabels adds labels that describe each runner's GPUs (gpu,
	// gpu-h200, gpus-1, cuda-12.4), so that jobs can ask for hardware in
	// runs-on. Default true.
	HardwareLabels *bool `json:"hardware_labels,omitempty"`
	// SizeFromGPUs is set when gpus_per_runner is and size is not: the
	// size is then what the host's GPUs allow, known once they are found.
	SizeFromGPUs bool `json:"-"`
}

// GPUCount is a number of GPUs, or "all" (-1).
type GPUCount int

// AllGPUs is gpus_per_runner: all.
const AllGPUs GPUCount = -1

func (g GPUCount) MarshalJSON() ([]byte, error) {
	if g == AllGPUs {
		return json.Marshal("all")
	}
	return json.Marshal(int(g))
}

// badGPUCount marks a value that did not parse, for Validate to name.
const badGPUCount GPUCount = -2

func (g *GPUCount) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*g = badGPUCount
		if s == "all" {
			*g = AllGPUs
		}
		return nil
	}
	var n int
	if err := json.Unmarshal(b, &n); err != nil || n < 0 {
		*g = badGPUCount
		return nil
	}
	*g = GPUCount(n)
	return nil
}

// HasHardwareLabels reports whether runners get hardware labels.
func (p Pool) HasHardwareLabels() bool { return p.HardwareLabels == nil || *p.HardwareLabels }

// Agent configures the forge's runner agent.
type Agent struct {
	// Path is the agent: gitea-runner, or GitHub's run.sh. Found in PATH
	// when not a path; in a container, the image's path
	// (/home/runner/run.sh for GitHub's runner).
	Path string `json:"path"`
	// FetchInterval is how often an idle agent asks the forge for a job.
	FetchInterval Duration `json:"fetch_interval"`
}

// Defaults.
const (
	DefaultID               = "runfleet"
	DefaultResync           = 5 * time.Second
	DefaultDrainTimeout     = 30 * time.Minute
	DefaultIdleTimeout      = 10 * time.Minute
	DefaultMaxLifetime      = 12 * time.Hour
	DefaultBootstrapTimeout = 2 * time.Minute
	DefaultFetchInterval    = 2 * time.Second
	DefaultPollInterval     = 30 * time.Second
)

// Forge types and providers known to this build.
var (
	ForgeTypes = []string{"gitea", "github"}
	Providers  = []string{"process", "docker"}
	Scopes     = []string{"repo", "org", "instance"}
)

// Load reads, expands, defaults and validates the config file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	c, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// Parse parses, expands, defaults and validates a config document.
func Parse(data []byte) (*Config, error) {
	var c Config
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, errors.New("config is empty")
	}
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		return nil, parseError(err)
	}
	// A pool of GPU runners without a size is sized by its GPUs; a forge
	// with poll_interval written as zero is not polled.
	var given struct {
		Forges []map[string]json.RawMessage `json:"forges"`
		Pools  []map[string]json.RawMessage `json:"pools"`
	}
	if err := yaml.Unmarshal(data, &given); err == nil {
		for i := range min(len(given.Forges), len(c.Forges)) {
			if _, ok := given.Forges[i]["poll_interval"]; ok && c.Forges[i].PollInterval.Duration == 0 && c.Forges[i].PollInterval.invalid == "" {
				c.Forges[i].PollOff = true
			}
		}
		for i := range min(len(given.Pools), len(c.Pools)) {
			if _, ok := given.Pools[i]["size"]; !ok && c.Pools[i].GPUsPerRunner != 0 {
				c.Pools[i].SizeFromGPUs = true
			}
		}
	}
	if err := c.resolve(); err != nil {
		return nil, err
	}
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// parseError words a YAML or type error for the user: the field and what
// was wrong, without the library's nesting.
func parseError(err error) error {
	if te, ok := errors.AsType[*json.UnmarshalTypeError](err); ok && te.Field != "" {
		return fmt.Errorf("%s: must be %s, got %s", te.Field, typeName(te.Type.Kind().String()), te.Value)
	}
	s := err.Error()
	for _, p := range []string{"error converting YAML to JSON: ", "error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		s = strings.ReplaceAll(s, p, "")
	}
	return fmt.Errorf("parse: %s", s)
}

func typeName(kind string) string {
	switch kind {
	case "int", "int64":
		return "a whole number"
	case "slice":
		return "a list"
	case "map", "struct":
		return "a mapping"
	}
	return "a " + kind
}

// resolve expands ${ENV} references and reads token files.
func (c *Config) resolve() error {
	var errs []error
	for i := range c.Forges {
		f := &c.Forges[i]
		field := fmt.Sprintf("forges[%d]", i)
		var err error
		if f.URL, err = expand(f.URL); err != nil {
			errs = append(errs, fmt.Errorf("%s.url: %w", field, err))
		}
		if f.RunnerURL, err = expand(f.RunnerURL); err != nil {
			errs = append(errs, fmt.Errorf("%s.runner_url: %w", field, err))
		}
		tok, err := expand(string(f.Token))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s.token: %w", field, err))
		}
		f.Token = Secret(tok)
		hook, err := expand(string(f.WebhookSecret))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s.webhook_secret: %w", field, err))
		}
		f.WebhookSecret = Secret(hook)
		if f.TokenFile != "" {
			if f.Token != "" {
				errs = append(errs, fmt.Errorf("%s: set token or token_file, not both", field))
				continue
			}
			b, err := os.ReadFile(f.TokenFile)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.token_file: %w", field, err))
				continue
			}
			f.Token = Secret(strings.TrimSpace(string(b)))
		}
		if f.PrivateKeyFile != "" {
			b, err := os.ReadFile(f.PrivateKeyFile)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.private_key_file: %w", field, err))
				continue
			}
			f.PrivateKey = Secret(b)
		}
	}
	for i := range c.Pools {
		for k, v := range c.Pools[i].Env {
			x, err := expand(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("pools[%d].env.%s: %w", i, k, err))
			}
			c.Pools[i].Env[k] = x
		}
	}
	return errors.Join(errs...)
}

var envRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)

// expand replaces ${NAME} with the environment variable NAME. An unset
// variable is an error rather than an empty string: an empty token would
// only fail later, further from its cause.
func expand(s string) (string, error) {
	var missing []string
	out := envRef.ReplaceAllStringFunc(s, func(m string) string {
		name := m[2 : len(m)-1]
		v, ok := os.LookupEnv(name)
		if !ok {
			missing = append(missing, name)
		}
		return v
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("environment variable %s is not set", strings.Join(missing, ", "))
	}
	return out, nil
}

func (c *Config) setDefaults() {
	if c.ID == "" {
		c.ID = DefaultID
	}
	if c.StateDir == "" {
		c.StateDir = defaultStateDir(c.ID)
	}
	if c.Resync.Duration == 0 && c.Resync.invalid == "" {
		c.Resync = D(DefaultResync)
	}
	if c.DrainTimeout.Duration == 0 && c.DrainTimeout.invalid == "" {
		c.DrainTimeout = D(DefaultDrainTimeout)
	}
	for i := range c.Forges {
		f := &c.Forges[i]
		if f.PollInterval.Duration == 0 && f.PollInterval.invalid == "" && !f.PollOff {
			f.PollInterval = D(DefaultPollInterval)
		}
	}
	for i := range c.Forges {
		f := &c.Forges[i]
		f.URL = strings.TrimRight(f.URL, "/")
		f.RunnerURL = strings.TrimRight(f.RunnerURL, "/")
		if f.RunnerURL == "" {
			f.RunnerURL = f.URL
		}
		if f.Scope == "" {
			switch {
			case f.Repo != "":
				f.Scope = "repo"
			case f.Org != "":
				f.Scope = "org"
			}
		}
	}
	for i := range c.Pools {
		p := &c.Pools[i]
		if p.Forge == "" && len(c.Forges) == 1 {
			p.Forge = c.Forges[0].Name
		}
		if p.Provider == "" {
			p.Provider = "process"
			if p.Docker != nil {
				p.Provider = "docker"
			}
		}
		if p.Max == 0 && !p.SizeFromGPUs {
			p.Max = p.Size
		}
		if p.IdleTimeout.Duration == 0 && p.IdleTimeout.invalid == "" {
			p.IdleTimeout = D(DefaultIdleTimeout)
		}
		if p.MaxLifetime.Duration == 0 && p.MaxLifetime.invalid == "" {
			p.MaxLifetime = D(DefaultMaxLifetime)
		}
		if p.BootstrapTimeout.Duration == 0 && p.BootstrapTimeout.invalid == "" {
			p.BootstrapTimeout = D(DefaultBootstrapTimeout)
		}
		if p.Agent.FetchInterval.Duration == 0 && p.Agent.FetchInterval.invalid == "" {
			p.Agent.FetchInterval = D(DefaultFetchInterval)
		}
		if p.Workdir == "" {
			p.Workdir = filepath.Join(c.StateDir, "work")
		}
		if p.Provider == "docker" && p.Docker != nil {
			p.Docker.setDefaults()
		}
	}
}

func defaultStateDir(id string) string {
	base := os.Getenv("XDG_STATE_HOME")
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = os.TempDir()
		}
		base = filepath.Join(home, ".local", "state")
	}
	return filepath.Join(base, "runfleet", id)
}

// nameRE is what a manager, forge or pool name may be: it becomes part of
// runner names, process records and (later) container and instance names,
// so it is held to DNS-label rules.
var nameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`)

// Complete defaults and validates a config built in code rather than
// parsed (the CML-compatible `runfleet runner`).
func (c *Config) Complete() error {
	c.setDefaults()
	return c.Validate()
}

// Validate checks a defaulted config and returns every problem found.
func (c *Config) Validate() error {
	var errs []error
	bad := func(field string, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if !nameRE.MatchString(c.ID) {
		bad("id", "%q is not a valid name (lower-case letters, digits and '-', at most 40)", c.ID)
	}
	if err := c.Resync.check(); err != nil {
		bad("resync", "%v", err)
	} else if c.Resync.Duration < 100*time.Millisecond {
		bad("resync", "%s is too short (at least 100ms)", c.Resync)
	}
	if err := c.DrainTimeout.check(); err != nil {
		bad("drain_timeout", "%v", err)
	}
	if len(c.Forges) == 0 {
		bad("forges", "at least one forge is required")
	}
	if len(c.Pools) == 0 {
		bad("pools", "at least one pool is required")
	}

	forges := map[string]bool{}
	for i, f := range c.Forges {
		field := fmt.Sprintf("forges[%d]", i)
		switch {
		case f.Name == "":
			bad(field+".name", "is required")
		case !nameRE.MatchString(f.Name):
			bad(field+".name", "%q is not a valid name (lower-case letters, digits and '-', at most 40)", f.Name)
		case forges[f.Name]:
			bad(field+".name", "%q is used by another forge", f.Name)
		}
		forges[f.Name] = true
		if !slices.Contains(ForgeTypes, f.Type) {
			bad(field+".type", "unknown forge type %q (known: %s)", f.Type, strings.Join(ForgeTypes, ", "))
		}
		if err := checkURL(f.URL); err != nil {
			bad(field+".url", "%v", err)
		}
		if f.RunnerURL != "" {
			if err := checkURL(f.RunnerURL); err != nil {
				bad(field+".runner_url", "%v", err)
			}
		}
		if err := f.PollInterval.check(); err != nil {
			bad(field+".poll_interval", "%v", err)
		} else if !f.PollOff && f.PollInterval.Duration < time.Second {
			bad(field+".poll_interval", "%s is too short (at least 1s, or 0s for no polling)", f.PollInterval.Duration)
		}
		if f.WebhookSecret != "" && len(f.WebhookSecret) < 16 {
			bad(field+".webhook_secret", "is too short (at least 16 characters)")
		}
		if f.Type == "github" {
			c.validateGitHub(field, f, bad)
			continue
		}
		if f.Token == "" {
			bad(field+".token", "is required (a token, \"${ENV_VAR}\", or token_file)")
		}
		switch f.Scope {
		case "repo":
			if o, r, ok := strings.Cut(f.Repo, "/"); !ok || o == "" || r == "" || strings.Contains(r, "/") {
				bad(field+".repo", "%q is not owner/name", f.Repo)
			}
		case "org":
			if f.Org == "" {
				bad(field+".org", "is required with scope org")
			}
		case "instance":
		case "":
			bad(field+".scope", "is required (repo, org or instance)")
		default:
			bad(field+".scope", "unknown scope %q (known: %s)", f.Scope, strings.Join(Scopes, ", "))
		}
	}

	pools := map[string]bool{}
	for i, p := range c.Pools {
		field := fmt.Sprintf("pools[%d]", i)
		switch {
		case p.Name == "":
			bad(field+".name", "is required")
		case !nameRE.MatchString(p.Name):
			bad(field+".name", "%q is not a valid name (lower-case letters, digits and '-', at most 40)", p.Name)
		case pools[p.Name]:
			bad(field+".name", "%q is used by another pool", p.Name)
		}
		pools[p.Name] = true
		if !forges[p.Forge] {
			bad(field+".forge", "%q is not a configured forge", p.Forge)
		}
		if !slices.Contains(Providers, p.Provider) {
			bad(field+".provider", "unknown provider %q (known: %s)", p.Provider, strings.Join(Providers, ", "))
		}
		if len(p.Labels) == 0 {
			bad(field+".labels", "at least one label is required")
		}
		seen := map[string]bool{}
		for j, l := range p.Labels {
			lf := fmt.Sprintf("%s.labels[%d]", field, j)
			switch {
			case l == "":
				bad(lf, "is empty")
			case strings.ContainsAny(l, ":, \t\n"):
				bad(lf, "%q must not contain ':', ',' or spaces", l)
			case seen[l]:
				bad(lf, "%q is repeated", l)
			}
			seen[l] = true
		}
		if p.Size < 0 {
			bad(field+".size", "must not be negative, got %d", p.Size)
		}
		if p.Max < 0 {
			bad(field+".max", "must not be negative, got %d", p.Max)
		} else if p.Max < p.Size && !p.SizeFromGPUs {
			bad(field+".max", "%d is less than size %d", p.Max, p.Size)
		}
		if p.Max > 10000 {
			bad(field+".max", "%d is more than 10000", p.Max)
		}
		for name, d := range map[string]Duration{"idle_timeout": p.IdleTimeout, "max_lifetime": p.MaxLifetime, "bootstrap_timeout": p.BootstrapTimeout, "agent.fetch_interval": p.Agent.FetchInterval} {
			if err := d.check(); err != nil {
				bad(field+"."+name, "%v", err)
			}
		}
		if p.GPUsPerRunner == badGPUCount {
			bad(field+".gpus_per_runner", "must be a whole number of GPUs or \"all\"")
		}
		if p.Workdir != "" && !filepath.IsAbs(p.Workdir) {
			bad(field+".workdir", "%q must be an absolute path", p.Workdir)
		}
		for k := range p.Env {
			if !envName.MatchString(k) {
				bad(field+".env", "%q is not a valid environment variable name", k)
			}
		}
		switch {
		case p.Provider == "docker" && p.Docker == nil:
			bad(field+".docker", "is required with provider docker (at least docker.image)")
		case p.Provider == "docker":
			for _, err := range p.Docker.validate() {
				errs = append(errs, fmt.Errorf("%s.docker.%w", field, err))
			}
			if p.GPUsPerRunner > 0 && p.Docker.GPUs.Any() || p.GPUsPerRunner == AllGPUs && p.Docker.GPUs.Any() {
				bad(field+".gpus_per_runner", "is set with docker.gpus, which gives every runner the same GPUs; keep one of them")
			}
		case p.Docker != nil:
			bad(field+".docker", "is set but provider is %q; set provider: docker", p.Provider)
		}
	}
	// Sort for a stable message: map iteration above may reorder them.
	slices.SortStableFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	return errors.Join(errs...)
}

// validateGitHub checks a github forge: the scope comes from the URL, and
// the credential is a token or a GitHub App, not both.
func (c *Config) validateGitHub(field string, f Forge, bad func(string, string, ...any)) {
	if f.URL != "" {
		u := strings.TrimPrefix(strings.TrimPrefix(f.URL, "https://"), "http://")
		_, path, _ := strings.Cut(u, "/")
		if n := len(strings.FieldsFunc(strings.TrimSuffix(path, ".git"), func(r rune) bool { return r == '/' })); n < 1 || n > 2 {
			bad(field+".url", "%q must name an organisation (https://github.com/<org>) or a repository (https://github.com/<owner>/<repo>)", f.URL)
		}
	}
	if f.Scope != "" || f.Repo != "" || f.Org != "" {
		bad(field+".scope", "github infers the scope from url; drop scope, repo and org")
	}
	if f.APIURL != "" {
		if err := checkURL(f.APIURL); err != nil {
			bad(field+".api_url", "%v", err)
		}
	}
	app := f.AppID != 0 || f.InstallationID != 0 || f.PrivateKeyFile != ""
	switch {
	case app && f.Token != "":
		bad(field+".token", "set a token or a GitHub App (app_id, installation_id, private_key_file), not both")
	case app:
		if f.AppID <= 0 {
			bad(field+".app_id", "is required with a GitHub App")
		}
		if f.InstallationID <= 0 {
			bad(field+".installation_id", "is required with a GitHub App")
		}
		if f.PrivateKeyFile == "" {
			bad(field+".private_key_file", "is required with a GitHub App")
		}
	case f.Token == "":
		bad(field+".token", "is required (a token, \"${ENV_VAR}\", token_file, or a GitHub App)")
	}
	if f.RunnerGroupID < 0 {
		bad(field+".runner_group_id", "must not be negative, got %d", f.RunnerGroupID)
	}
	if err := f.CacheTTL.check(); err != nil {
		bad(field+".cache_ttl", "%v", err)
	}
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

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

// Forge returns the forge with the given name.
// Pool returns the pool of that name.
func (c *Config) Pool(name string) (Pool, bool) {
	for _, p := range c.Pools {
		if p.Name == name {
			return p, true
		}
	}
	return Pool{}, false
}

// Forge returns the forge of that name.
func (c *Config) Forge(name string) (Forge, bool) {
	for _, f := range c.Forges {
		if f.Name == name {
			return f, true
		}
	}
	return Forge{}, false
}

// Duration is a time.Duration written as "30s", "5m" or "1h30m" in YAML.
// A value that does not parse is kept, so that Validate can name its field.
type Duration struct {
	time.Duration
	invalid string
}

// D makes a Duration.
func D(d time.Duration) Duration { return Duration{Duration: d} }

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		*d = Duration{invalid: string(b)}
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		*d = Duration{invalid: s}
		return nil
	}
	*d = Duration{Duration: v}
	return nil
}

// check reports an unparsable or negative duration.
func (d Duration) check() error {
	switch {
	case d.invalid != "":
		return fmt.Errorf("invalid duration %q (use a number with a unit: \"30s\", \"5m\", \"1h\")", d.invalid)
	case d.Duration < 0:
		return fmt.Errorf("must not be negative, got %s", d.Duration)
	}
	return nil
}

// Secret is a credential. It prints as [redacted] in logs, errors and
// JSON, so that it cannot leak by being formatted; Reveal returns it.
type Secret string

const redacted = "[redacted]"

func (s Secret) Reveal() string { return string(s) }
func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return redacted
}
func (s Secret) GoString() string             { return s.String() }
func (s Secret) LogValue() slog.Value         { return slog.StringValue(s.String()) }
func (s Secret) MarshalJSON() ([]byte, error) { return json.Marshal(s.String()) }
func (s *Secret) UnmarshalJSON(b []byte) error {
	var v string
	if err := json.Unmarshal(b, &v); err != nil {
		return errors.New("token must be a string")
	}
	*s = Secret(v)
	return nil
}
