// Package agent defines how a forge's own runner agent becomes a machine
// spec: its command, arguments, environment and files, and how its output
// tells what it is doing. Each forge driver makes its agent (gitea-runner
// for Gitea, GitHub's runner for GitHub), so that the credential a driver
// issues and the code that hands it to the agent sit together.
package agent

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// Runner is a pool's view of one new runner: who it is and what it may
// put in the agent's environment.
type Runner struct {
	Name    string
	Manager string
	Pool    string
	Labels  []string
	// Env is added to the agent's environment. It must hold no forge
	// credential: a job can read it.
	Env map[string]string
}

// Agent turns a runner and its single-use credential into a machine spec.
type Agent interface {
	Spec(r Runner, cred forge.Credential) (provider.Spec, error)
}

// Config is a pool's agent settings.
type Config struct {
	// Path is the agent; empty for the forge's default. On a Local
	// machine it is found in this host's PATH when it is not a path;
	// otherwise it is the path in the machine's image.
	Path string
	// FetchInterval is how often an idle agent asks the forge for a job,
	// for agents that poll.
	FetchInterval time.Duration
	// Local is set when the agent runs on this host rather than from a
	// machine's image (provider.Traits.Local).
	Local bool
	// IdleTimeout is the pool's idle timeout, for agents that can exit
	// by themselves when no job comes (gitlab-runner's --wait-timeout),
	// so that a runner nobody removes does not wait for ever.
	IdleTimeout time.Duration
	// Inspect is set when the pool is only read (status, gc): no agent
	// starts, so none is looked for on this host.
	Inspect bool
}

// Locate finds a pool's agent on this host: path as given when it holds
// a slash, else in this host's PATH. Where the agent runs from a machine's
// image, or with Inspect, it looks for nothing and returns path.
func Locate(cfg Config, path string) (string, error) {
	if !cfg.Local || cfg.Inspect {
		return path, nil
	}
	abs, err := exec.LookPath(path)
	if err != nil {
		return "", fmt.Errorf("agent.path: %q: %w", path, err)
	}
	return abs, nil
}

// Maker is implemented by every forge connection: it makes the forge's
// runner agent for a pool. It is declared here, not in package forge,
// because an Agent takes the forge's Credential.
type Maker interface {
	Agent(cfg Config) (Agent, error)
}

// DefaultPath is the search path agents get when the manager has none.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// BaseEnv is the environment an agent on this host starts from: this
// host's PATH, a UTF-8 locale, and extra. It is built, not inherited: the
// manager's own environment may hold forge tokens.
func BaseEnv(extra map[string]string) map[string]string {
	path := os.Getenv("PATH")
	if path == "" {
		path = DefaultPath
	}
	env := map[string]string{"PATH": path, "LANG": "C.UTF-8"}
	maps.Copy(env, extra)
	return env
}

// Phase is what an agent's own output says about it.
type Phase int

const (
	PhaseUnknown Phase = iota // nothing telling yet
	PhaseReady                // connected, waiting for a job
	PhaseBusy                 // running a job
	PhaseDone                 // its job finished; it is about to exit
)

func (p Phase) String() string {
	return [...]string{"unknown", "ready", "busy", "done"}[p]
}

// Reporter is implemented by agents whose output tells whether they wait
// for a job, run one, or have finished it. The pool reads that instead of
// asking the forge, which saves API calls and is never stale.
type Reporter interface {
	Phase(output []byte) Phase
}

// LastPhase reads output line by line with the markers of each phase and
// returns the phase of the last line that has one: a helper for Reporters
// whose agents print one telling line per change.
func LastPhase(output []byte, markers map[Phase][]byte) Phase {
	ph := PhaseUnknown
	for line := range bytes.Lines(output) {
		for _, p := range []Phase{PhaseDone, PhaseBusy, PhaseReady} {
			if m, ok := markers[p]; ok && bytes.Contains(line, m) {
				ph = p
				break
			}
		}
	}
	return ph
}
