package provider

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/gpu"
)

// Driver makes providers of one kind (process, docker). A driver package
// registers one with Register in its init function.
type Driver interface {
	// Check decodes and checks a pool's section for this provider (the
	// pool's `docker:` for docker), without side effects. It returns
	// every problem found, each naming its field relative to the pool
	// ("docker.memory: \"12q\" is not a size"), joined with
	// errors.Join.
	Check(c PoolConfig) error
	// Open returns the provider of one pool's machines. It may create
	// the directories it needs, but starts no machine. ctx bounds the
	// opening (a cloud's credentials read), not the provider.
	Open(ctx context.Context, c PoolConfig) (Provider, error)
}

// PoolConfig is what a driver is told of the pool whose machines it runs.
type PoolConfig struct {
	Manager string // the manager id
	Pool    string
	// StateDir is the manager's state directory: records, and copies of
	// the agents' output.
	StateDir string
	// Workdir is the parent of the runners' working directories on this
	// host.
	Workdir string
	// ReadOnly opens the pool to be read only (status, gc): Open makes no
	// directory and List repairs no record, so that reading changes
	// nothing on disk.
	ReadOnly bool
	// GPUsPerRunner is how many of the host's GPUs each runner gets for
	// itself: -1 all, 0 none.
	GPUsPerRunner int
	// MaxLifetime is the pool's max_lifetime, for a provider that can
	// enforce it on the machine itself as a last resort, also when the
	// manager is gone (a pod's activeDeadlineSeconds).
	MaxLifetime time.Duration
	// JobTimeout is the longest a job of the pool runs (its job_timeout,
	// or the forge's own limit; 0 when neither says), for a provider
	// whose machines have a time limit of their own (a Slurm job's
	// --time), to make room for one.
	JobTimeout time.Duration
	// IdleTimeout is the pool's idle_timeout, for a machine that powers
	// itself off when no job came within it (a cloud instance).
	IdleTimeout time.Duration
	// Section is the pool's section named after the provider, as
	// written, for the driver to decode; nil when the pool has none.
	Section json.RawMessage
	// GPUs returns the host's GPU inventory, read once on first use, for
	// a driver that chooses by it (an image by CUDA version). Set for
	// Open only.
	GPUs   func() gpu.Inventory
	Logger *slog.Logger
}

// CMLDriver is implemented by drivers that `runfleet runner`, the drop-in
// for `cml runner launch`, can start runners with.
type CMLDriver interface {
	// CMLSection says whether CML's options ask for this provider
	// (--docker IMAGE, --cloud NAME), and returns the pool's section for
	// them.
	CMLSection(o CMLOptions) (section json.RawMessage, ok bool, err error)
}

// CMLOptions are the options of `cml runner launch` that choose and
// configure where runners run.
type CMLOptions struct {
	Docker        string   // --docker: an image
	DockerVolumes []string // --docker-volumes
	// Cloud holds the scalar --cloud* options given, by flag name
	// without the dashes ("cloud", "cloud-type", "cloud-spot"), as CML
	// reads them (--cloud-gpu nogpu is absent, tesla is v100).
	Cloud map[string]string
	// Metadata (--cloud-metadata) and NodeSelector
	// (--cloud-kubernetes-node-selector) are CML's key=value lists, each
	// split at its first "=".
	Metadata, NodeSelector map[string]string
	Getenv                 func(string) (string, bool)
	// Stock is what a cloud machine booted from a stock image installs
	// (no --cloud-image): runfleet and the forge's agent, each a file and
	// its SHA-256 (a pod installs the agent only); nil where none can be
	// installed.
	Stock *Stock
	// AgentImage is the forge's own published runner image, for a
	// container or pod without --cloud-image; "" where it publishes none.
	AgentImage string
}

// Stock is what the boot script of a stock image fetches.
type Stock struct {
	RunfleetURL, RunfleetSHA256 string
	AgentURL, AgentSHA256       string
	// Docker is set where the agent runs as a container image through
	// the machine's engine (forge.DockerAgent): Docker is installed.
	Docker bool
}

// Starter is implemented by drivers that `runfleet init` writes a starter
// config for (every driver should: a test holds each to it).
type Starter interface {
	// Starter returns a pool's keys for this provider in a starter
	// config: `provider:` and the provider's section, each line indented
	// by four spaces (a pool's keys), with comments, filled from o where
	// it gives a value and otherwise with placeholders that pass Check.
	Starter(o StarterOptions) string
}

// StarterOptions are what `runfleet init` was told of the pool.
type StarterOptions struct {
	Forge string // the forge's type
	// Image is the runner image or machine image the user named, if any.
	Image string
	// AgentImage is the container image holding the forge's agent, as
	// the repository's images/ build it: the default of container and
	// pod pools.
	AgentImage string
	// Agent is the forge's agent on a host (gitea-runner, run.sh, ...).
	Agent string
}

// RunnerURLStarter is implemented by drivers whose machines may reach the
// forge by another address than the manager does (a container, through
// the host's gateway): `runfleet init` then names forges[].runner_url,
// with this host in place of the forge's own.
type RunnerURLStarter interface {
	StarterRunnerHost() string
}

var (
	mu      sync.RWMutex
	drivers = map[string]Driver{}
	absent  = map[string]string{}
)

// Register makes a driver available under a provider name, the pool's
// `provider:`. It panics when the name is taken or the driver is nil: both
// are mistakes in the program, as with database/sql.Register.
func Register(name string, d Driver) {
	mu.Lock()
	defer mu.Unlock()
	if d == nil {
		panic("provider: Register driver is nil")
	}
	if _, dup := drivers[name]; dup {
		panic("provider: Register called twice for " + name)
	}
	drivers[name] = d
}

// Lookup returns the driver registered under a name.
func Lookup(name string) (Driver, bool) {
	mu.RLock()
	defer mu.RUnlock()
	d, ok := drivers[name]
	return d, ok
}

// Names returns the registered provider names, sorted.
func Names() []string {
	mu.RLock()
	defer mu.RUnlock()
	return slices.Sorted(maps.Keys(drivers))
}

// LeaveOut records a driver that runfleet has but this binary was built
// without (its build tag left out), with how to get it: a config that
// names it is told so rather than that no such driver exists.
func LeaveOut(name, howToGet string) {
	mu.Lock()
	defer mu.Unlock()
	absent[name] = howToGet
}

// LeftOut says how to get a driver this binary was built without, and
// whether name names one.
func LeftOut(name string) (howToGet string, ok bool) {
	mu.RLock()
	defer mu.RUnlock()
	howToGet, ok = absent[name]
	return howToGet, ok
}
