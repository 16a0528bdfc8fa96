// Package config loads and validates runfleet's YAML configuration.
//
// It holds the fields every forge and every pool has. What a forge type or
// a provider adds (a Gitea forge's repo, a pool's docker section) is kept
// as written and checked by the driver registered for it, through
// forge.Lookup and provider.Lookup, so that Parse reports every problem of
// a config at once. Every error names the field and the value that was
// wrong, so that a bad config is fixed in one go and starts nothing.
package config

import (
	"encoding/json"
	"time"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/secret"
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
	// Listen is the address of the webhook listener, which the forges
	// reach: /webhook/<forge> and nothing else. "" turns it off.
	Listen string `json:"listen"`
	// StatusListen is the address of the status page (/), /metrics and
	// /healthz, which show repository, job and runner names: loopback
	// (DefaultStatusListen) unless said otherwise; "off" or "" written
	// for none. It may be Listen itself only with a StatusToken.
	StatusListen string `json:"status_listen"`
	// StatusListenGiven is set when the config names the status
	// listener's address: a default address another program holds is
	// not a reason to start nothing.
	StatusListenGiven bool `json:"-"`
	// StatusToken, when set, is the bearer token the status page and
	// /metrics need. It may be "${ENV_VAR}".
	StatusToken secret.String `json:"status_token"`

	// History is where the manager keeps the record of each runner and
	// its job (`runfleet jobs`, the status page).
	History History `json:"history"`
	// Currency is what the pools' prices are in (an ISO 4217 code);
	// DefaultCurrency when unset.
	Currency string `json:"currency"`

	// LeaderElection, when set, lets several managers with this id share
	// the fleet: only the holder of a Kubernetes Lease acts.
	LeaderElection *LeaderElection `json:"leader_election"`

	Forges []Forge `json:"forges"`
	Pools  []Pool  `json:"pools"`
}

// GPUDetection says how the host's GPUs are found.
type GPUDetection struct {
	// NvidiaSMI is the nvidia-smi to run. When set, runfleet reads the
	// GPUs from it rather than through NVML.
	NvidiaSMI string `json:"nvidia_smi"`
	// AllowHostVGPU hands out GPUs that a hypervisor shares with its
	// virtual machines (Host VGPU mode), which are skipped otherwise.
	AllowHostVGPU bool `json:"allow_host_vgpu"`
}

// History bounds the manager's history of jobs.
type History struct {
	// Path is its file: <state_dir>/history.db by default. With leader
	// election, a volume every candidate mounts keeps it over a
	// failover; the leader alone opens it.
	Path string `json:"path"`
	// MaxJobs is how many records are kept (100000 by default), Keep how
	// long (2160h, 90 days, by default); the oldest go first.
	MaxJobs int      `json:"max_jobs"`
	Keep    Duration `json:"keep"`
}

// DefaultCurrency is what prices are in when the config does not say.
const DefaultCurrency = "USD"

// History's defaults.
const (
	DefaultHistoryMaxJobs = 100_000
	DefaultHistoryKeep    = 90 * 24 * time.Hour
)

// LeaderElection names the Lease the managers of one id take turns on,
// and the cluster that holds it.
type LeaderElection struct {
	// Kubeconfig, Context and InCluster name the cluster as a pool's
	// kubernetes section does; the default loading rules when empty.
	Kubeconfig string `json:"kubeconfig"`
	Context    string `json:"context"`
	InCluster  bool   `json:"in_cluster"`
	// Namespace holds the Lease: the context's or the pod's namespace
	// when empty.
	Namespace string `json:"namespace"`
	// Lease is the Lease's name, runfleet-<id> by default.
	Lease string `json:"lease"`
	// Identity is this manager's name in the election, unique among the
	// candidates ("${POD_NAME}"); the host name and process id when
	// empty.
	Identity string `json:"identity"`
	// LeaseDuration is how long a leader's lease holds without renewal:
	// a successor takes over this long after a leader dies.
	// RenewDeadline is how long a leader tries to renew before it stands
	// down, RetryPeriod the pace of tries.
	LeaseDuration Duration `json:"lease_duration"`
	RenewDeadline Duration `json:"renew_deadline"`
	RetryPeriod   Duration `json:"retry_period"`
	// Advertise is where the other candidates reach this manager's
	// webhook listener while it leads ("http://${POD_IP}:8080"): a
	// standby that receives a webhook (a Service's endpoints lag a
	// failover) forwards it there rather than act on it. Without it,
	// a standby answers a webhook 503.
	Advertise string `json:"advertise"`
}

// Leader election defaults: a leader killed with -9 is taken over within
// about 10 s (the lease's 6 s from its last renewal, the successor's next
// try a second or so later, its start). client-go's users often take
// 15 s / 10 s / 2 s, for a minute-long outage of a controller that no one
// waits on; here a job waits. A renewal each second is one small write a
// second to the apiserver, and a leader that cannot renew for 4 s stands
// down rather than risk two acting at once.
const (
	DefaultLeaseDuration = 6 * time.Second
	DefaultRenewDeadline = 4 * time.Second
	DefaultRetryPeriod   = time.Second
)

// Forge is one forge connection: the fields every forge has, and the keys
// its type adds (a Gitea forge's repo, a GitHub App's app_id), kept as
// written for the driver registered under Type to decode.
type Forge struct {
	Name string `json:"name"`
	// Type names the forge's driver: gitea, github (forge.Types).
	Type string `json:"type"`
	// URL is the forge's address. Drivers may read more into it (a
	// GitHub repository or organisation URL gives the scope).
	URL string `json:"url"`
	// Token is the forge API token. It may be "${ENV_VAR}"; TokenFile
	// names a file holding it instead.
	Token     secret.String `json:"token"`
	TokenFile string        `json:"token_file"`
	// RunnerURL is the forge's address as runners see it, when it differs
	// from URL: a container reaches a forge on the host through the
	// bridge, not through 127.0.0.1. It defaults to URL.
	RunnerURL string `json:"runner_url"`

	// WebhookSecret turns on /webhook/<name>: deliveries signed with it
	// report queued jobs at once. It may be "${ENV_VAR}".
	WebhookSecret secret.String `json:"webhook_secret"`
	// PollInterval is how often the forge's job queue is read, so that a
	// lost webhook never strands a job; "0s" turns polling off.
	PollInterval Duration `json:"poll_interval"`
	// PollOff is set when poll_interval is written as zero.
	PollOff bool `json:"-"`

	// CallsPerHour is the connection's budget of API calls, shared by
	// its pools and polls: a token bucket refilled at this rate, holding
	// CallBurst calls, that no pool can exceed however its runners fail.
	CallsPerHour int `json:"calls_per_hour"`
	CallBurst    int `json:"call_burst"`

	// Section holds the entry's other keys, as a JSON object, for the
	// forge's driver; nil when there are none.
	Section json.RawMessage `json:"-"`
}

// Pool is a set of identical single-job runners.
type Pool struct {
	Name   string   `json:"name"`
	Forge  string   `json:"forge"`
	Labels []string `json:"labels"`
	// Provider names where runners run: process, docker
	// (provider.Names). It defaults to the provider whose section the
	// pool has, or DefaultProvider.
	Provider string `json:"provider"`
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
	// JobTimeout is the longest a job of the pool runs: a machine with a
	// time limit of its own (a Slurm job's --time) is given room for a
	// job this long, and an idle one leaves before a job it took could
	// outrun it. Unset: the forge's own limit (forge.JobLimiter).
	JobTimeout Duration `json:"job_timeout"`
	// Workdir is the parent of the runners' fresh working directories on
	// this host.
	Workdir string `json:"workdir"`
	// Env is added to the agent's environment. Never put secrets here:
	// jobs can read it.
	Env   map[string]string `json:"env"`
	Agent Agent             `json:"agent"`
	// RetryLost re-runs a job whose runner's machine went away mid-job
	// (GitHub: the run's failed jobs, once). Default true.
	RetryLost *bool `json:"retry_lost,omitempty"`
	// RerunOnTimeout re-runs a job that the forge cancelled for hitting
	// its time limit (GitHub's timed_out), up to this many times: for
	// training that resumes from its checkpoints. 0: never.
	RerunOnTimeout int `json:"rerun_on_timeout,omitempty"`
	// PricePerHour is what one runner's machine costs by the hour, in the
	// config's currency: a host's or a node's share, a pod's, a Slurm
	// job's, or a cloud machine's where its price list is not read. Each
	// record carries it, and its cost (`runfleet jobs --by pool`).
	PricePerHour *float64 `json:"price_per_hour,omitempty"`
	// Prices is the price per hour by machine type (an instance type, a
	// machine type, a VM size), over PricePerHour: a dynamic pool's
	// types cost each their own.
	Prices map[string]float64 `json:"prices,omitempty"`
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
	// Dynamic lets the pool's jobs choose their machine in their labels
	// (gpus=2, cpu=8, mem=64g, image=cuda12.4), within these limits: each
	// such job gets a runner of its own with what it asked for.
	Dynamic *dynamic.Limits `json:"dynamic,omitempty"`
	// SizeFromGPUs is set when gpus_per_runner is and size is not: the
	// size is then what the host's GPUs allow, known once they are found.
	SizeFromGPUs bool `json:"-"`

	// Section is the pool's section named after its provider (docker:
	// {...}), as written, for the provider's driver; nil when the pool
	// has none.
	Section json.RawMessage `json:"-"`
}

// HasHardwareLabels reports whether runners get hardware labels.
func (p Pool) HasHardwareLabels() bool { return p.HardwareLabels == nil || *p.HardwareLabels }

// Agent configures the forge's runner agent.
type Agent struct {
	// Path is the agent: the forge's default (gitea-runner, GitHub's
	// run.sh) when empty. Found in PATH when not a path, for a provider
	// whose machine is this host; otherwise the path in the image.
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
	// DefaultStatusListen serves the status page and /metrics to this
	// host only.
	DefaultStatusListen = "127.0.0.1:9180"
	// The default budget of a forge connection: a call a second on
	// average, well inside github.com's 5,000 an hour, and bursts of 100
	// (a burst of jobs registers its runners at once).
	DefaultCallsPerHour = 3600
	DefaultCallBurst    = 100
	// DefaultProvider runs the runners of a pool that names no provider
	// and has no provider's section.
	DefaultProvider = "process"
)

// DefaultStatus returns the status listener's address as written: "off"
// is none, and none written is DefaultStatusListen.
func (c *Config) DefaultStatus(written string) string {
	switch written {
	case "off", "false": // YAML reads a bare off as false
		return ""
	case "":
		return DefaultStatusListen
	}
	return written
}

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
