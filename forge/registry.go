package forge

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"net/url"
	"slices"
	"sync"

	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/fetch"
	"github.com/runfleet/runfleet/secret"
)

// Driver makes connections to forges of one type (gitea, github). A driver
// package registers one with Register in its init function.
type Driver interface {
	// Check decodes and checks one forge's configuration, the driver's
	// own keys included, without reading the network. It returns every
	// problem found, each naming its field relative to the forge's entry
	// ("repo: \"models\" is not owner/name"), joined with errors.Join.
	Check(c Config) error
	// Open returns a connection to the forge. It makes no network call:
	// an unreachable forge shows up on the first call, which the caller
	// retries. ctx bounds the opening, not the connection: background
	// work a connection starts ends at its Drain (Drainer).
	Open(ctx context.Context, c Config, env Env) (Forge, error)
}

// Config is one forge connection's configuration as its driver gets it:
// the fields every forge has, and the driver's own keys as written.
type Config struct {
	Name string // the config's name for the connection
	URL  string
	// RunnerURL is the forge's address as runners reach it (from inside
	// a container, say); it is URL unless the config says otherwise.
	RunnerURL string
	Token     secret.String // empty when the driver takes another credential
	// Section holds the keys of the forge's entry that are not common to
	// every forge (repo, org, app_id, ...), as a JSON object, for the
	// driver to decode; a key it does not know is an error. Nil when
	// there are none.
	Section json.RawMessage
}

// Env is what a connection gets from the manager that opens it.
type Env struct {
	Version string // runfleet's version, for user agents
	// Manager is the id of the manager that opens the connection, for
	// forges that mark the runners they register with it, so that a
	// manager lists only its own.
	Manager string
	Logger  *slog.Logger
	// Budget paces the connection's API calls (see Budgeted); nil is
	// no budget.
	Budget *rate.Limiter
	// Owed keeps the re-runs of lost runners' jobs the connection owes
	// (Following.Ledger), for the next manager where this one stops
	// first; nil keeps none.
	Owed Ledger
}

// LabelChecker is implemented by drivers whose forge limits the labels a
// runner may have (GitHub takes 1 to 100), so that a pool whose labels the
// forge would refuse is a config error, not a registration refused at
// every attempt.
type LabelChecker interface {
	// CheckLabels returns every problem with a pool's labels, each
	// naming its field ("labels: ...", "labels[3]: ..."), joined with
	// errors.Join.
	CheckLabels(labels []string) error
}

// Budgeter is implemented by drivers whose forge calls for another default
// budget of API calls than config.DefaultCallsPerHour, which is set under
// GitHub's 5,000 an hour. A self-hosted forge with no rate limit lets a
// busy fleet call it more often.
type Budgeter interface {
	// DefaultBudget is the calls an hour and the burst a connection
	// gets when its config does not say.
	DefaultBudget() (perHour, burst int)
}

// RepoDriver is implemented by drivers that `runfleet runner` (the drop-in
// for `cml runner launch`) can configure from a repository URL and a token
// alone.
type RepoDriver interface {
	// Recognize reports whether a repository URL is probably this
	// forge's, by its host name.
	Recognize(repo *url.URL) bool
	// InCI reports whether the environment is one of this forge's CI
	// jobs, for when no repository URL tells.
	InCI(getenv func(string) (string, bool)) bool
	// RepoConfig returns the forge's URL and the driver's section for a
	// repository or organisation URL.
	RepoConfig(repo string) (forgeURL string, section json.RawMessage, err error)
}

// AgentReleaser is implemented by drivers whose runner agent runfleet can
// fetch for a host that lacks it, as CML fetches the agent itself: the
// forge's own published release, pinned by version and checksum
// (`runfleet runner` on this host, without --agent).
type AgentReleaser interface {
	AgentRelease() fetch.Release
}

// AgentImager is implemented by drivers whose forge publishes a runner
// image holding its agent where the driver's Agent looks for it in a
// container: the image `runfleet runner --cloud=kubernetes` runs without
// --cloud-image, pinned to the version AgentRelease pins.
type AgentImager interface {
	AgentImage() string
}

// DockerAgent is implemented by drivers whose forge publishes its runner
// agent only as a container image that runs each job in containers of
// the machine's engine (Bitbucket's Linux Docker runner): a cloud machine
// booted from a stock image gets Docker installed and a pool with this
// agent path, which runs that image through the engine, as CML runs it.
type DockerAgent interface {
	DockerAgentPath() string
}

// Starter is implemented by drivers that `runfleet init` writes a starter
// config for (every driver should: a test holds each to it).
type Starter interface {
	// Starter returns the forge's entry in a starter config, filled from
	// o where it gives a value and otherwise with placeholders that pass
	// Check, so that the config is taken as written.
	Starter(o StarterOptions) StarterEntry
}

// StarterOptions are what `runfleet init` was told of the forge.
type StarterOptions struct {
	URL       string // the forge's address
	RunnerURL string // the forge's address as runners reach it, when it differs
	// Scope is what the runners serve, in the forge's own terms: a
	// repository (owner/name), a GitLab project, an Azure Pipelines
	// agent pool, a Bitbucket workspace/repository.
	Scope string
}

// StarterEntry is a forge's entry in a starter config.
type StarterEntry struct {
	// Keys are the entry's YAML keys after its name and type, each line
	// indented by four spaces, with comments saying what each is and
	// what the token needs.
	Keys string
	// TokenEnv is the environment variable the entry reads its token
	// from: the one thing to set before `runfleet serve`.
	TokenEnv string
	// Image is the runner image holding the forge's agent, as built from
	// the repository's images/ (for container and pod pools).
	Image string
	// Agent is the forge's agent on a host: a program in PATH or a path
	// (for pools of host processes and Slurm jobs).
	Agent string
}

var (
	mu      sync.RWMutex
	drivers = map[string]Driver{}
	absent  = map[string]string{}
)

// Register makes a driver available under a forge type name, the config's
// `type:`. It panics when the name is taken or the driver is nil: both are
// mistakes in the program, as with database/sql.Register.
func Register(typ string, d Driver) {
	mu.Lock()
	defer mu.Unlock()
	if d == nil {
		panic("forge: Register driver is nil")
	}
	if _, dup := drivers[typ]; dup {
		panic("forge: Register called twice for type " + typ)
	}
	drivers[typ] = d
}

// Lookup returns the driver registered under a type name.
func Lookup(typ string) (Driver, bool) {
	mu.RLock()
	defer mu.RUnlock()
	d, ok := drivers[typ]
	return d, ok
}

// Types returns the registered type names, sorted.
func Types() []string {
	mu.RLock()
	defer mu.RUnlock()
	return slices.Sorted(maps.Keys(drivers))
}

// LeaveOut records a driver that runfleet has but this binary was built
// without (its build tag left out), with how to get it: a config that
// names it is told so rather than that no such driver exists.
func LeaveOut(typ, howToGet string) {
	mu.Lock()
	defer mu.Unlock()
	absent[typ] = howToGet
}

// LeftOut says how to get a driver this binary was built without, and
// whether typ names one.
func LeftOut(typ string) (howToGet string, ok bool) {
	mu.RLock()
	defer mu.RUnlock()
	howToGet, ok = absent[typ]
	return howToGet, ok
}
