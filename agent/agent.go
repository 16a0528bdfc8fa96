// Package agent knows how each forge's own runner agent is started: its
// command, arguments, environment and files.
package agent

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

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

// DefaultPath is the search path agents get when the manager has none.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// baseEnv is the environment every agent starts from. It is built, not
// inherited: the manager's own environment may hold forge tokens.
func baseEnv(extra map[string]string) map[string]string {
	path := os.Getenv("PATH")
	if path == "" {
		path = DefaultPath
	}
	env := map[string]string{"PATH": path, "LANG": "C.UTF-8"}
	maps.Copy(env, extra)
	return env
}

// GiteaRunner starts gitea-runner (formerly act_runner) in host mode: job
// steps run as processes on the runner's machine.
type GiteaRunner struct {
	// Path is the gitea-runner binary.
	Path string
	// FetchInterval is how often the idle runner asks Gitea for a job.
	FetchInterval time.Duration
	// InContainer is set when the agent runs in a container image, whose
	// own PATH and locale apply: the manager's PATH means nothing there.
	InContainer bool
}

// ConfigFile is the config file written next to the registration.
const ConfigFile = "runner.yaml"

// Spec writes gitea-runner's config next to its .runner registration and
// runs `gitea-runner daemon`: an ephemeral registration makes it take one
// job and exit.
func (g GiteaRunner) Spec(r Runner, cred forge.Credential) (provider.Spec, error) {
	if _, ok := cred.Files[".runner"]; !ok {
		return provider.Spec{}, fmt.Errorf("gitea-runner %s: credential has no .runner registration", r.Name)
	}
	labels := make([]string, len(r.Labels))
	for i, l := range r.Labels {
		labels[i] = l + ":host"
	}
	fetch := g.FetchInterval
	if fetch <= 0 {
		fetch = 2 * time.Second
	}
	cfg := map[string]any{
		"log": map[string]any{"level": "info"},
		"runner": map[string]any{
			"file":     ".runner",
			"capacity": 1,
			// No backoff: an idle runner of a warm pool should pick a
			// job up within one interval.
			"fetch_interval":     fetch.String(),
			"fetch_interval_max": fetch.String(),
			"labels":             labels,
			"timeout":            "24h",
		},
		// The built-in cache server would listen on a port of the host
		// shared by every runner; off until a pool asks for it.
		"cache": map[string]any{"enabled": false},
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return provider.Spec{}, fmt.Errorf("gitea-runner config: %w", err)
	}
	env := map[string]string{}
	if g.InContainer {
		maps.Copy(env, r.Env)
	} else {
		env = baseEnv(r.Env)
	}
	files := maps.Clone(cred.Files)
	files[ConfigFile] = data
	return provider.Spec{
		Name:    r.Name,
		Manager: r.Manager,
		Pool:    r.Pool,
		Command: g.Path,
		Args:    []string{"daemon", "--config", ConfigFile},
		Env:     env,
		Files:   files,
	}, nil
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

// GitHubRunner starts GitHub's runner (actions/runner) with the
// just-in-time config it was registered with.
type GitHubRunner struct {
	// Path is the runner's run.sh.
	Path string
	// InContainer is set when the agent runs in a container image.
	InContainer bool
}

// Spec runs run.sh with the JIT config in ACTIONS_RUNNER_INPUT_JITCONFIG:
// the runner reads it from there as it would --jitconfig, and clears it
// before any job step runs, so that it is in no process listing and no
// job's environment. Without JIT (a registration token, where GitHub
// offers no JIT runners) config.sh registers an ephemeral runner first,
// reading the token from ACTIONS_RUNNER_INPUT_TOKEN.
func (g GitHubRunner) Spec(r Runner, cred forge.Credential) (provider.Spec, error) {
	env := map[string]string{}
	if g.InContainer {
		maps.Copy(env, r.Env)
		// Runner images may run as root; the runner refuses that unless told.
		env["RUNNER_ALLOW_RUNASROOT"] = "1"
	} else {
		env = baseEnv(r.Env)
		if os.Geteuid() == 0 {
			env["RUNNER_ALLOW_RUNASROOT"] = "1"
		}
	}
	maps.Copy(env, cred.Env)
	spec := provider.Spec{Name: r.Name, Manager: r.Manager, Pool: r.Pool, Env: env, Files: maps.Clone(cred.Files)}
	switch {
	case cred.Env["ACTIONS_RUNNER_INPUT_JITCONFIG"] != "":
		spec.Command = g.Path
	case cred.Env["ACTIONS_RUNNER_INPUT_TOKEN"] != "":
		env["RUNNER_DIR"] = filepath.Dir(g.Path)
		env["RUNNER_NAME"] = r.Name
		env["RUNNER_LABELS"] = strings.Join(r.Labels, ",")
		spec.Command = "/bin/sh"
		spec.Args = []string{"-c", `cd "$RUNNER_DIR" && ./config.sh --unattended --ephemeral --disableupdate --replace --name "$RUNNER_NAME" --labels "$RUNNER_LABELS" && unset ACTIONS_RUNNER_INPUT_TOKEN && exec ./run.sh`}
	default:
		return provider.Spec{}, fmt.Errorf("github runner %s: credential has neither a JIT config nor a registration token", r.Name)
	}
	return spec, nil
}

// Phase reads Runner.Listener's lines: "Listening for Jobs", "Running job:
// <name>", "Job <name> completed with result: <result>". The last one
// printed tells.
func (GitHubRunner) Phase(output []byte) Phase {
	ph := PhaseUnknown
	for line := range bytes.Lines(output) {
		switch {
		case bytes.Contains(line, []byte("completed with result:")):
			ph = PhaseDone
		case bytes.Contains(line, []byte("Running job:")):
			ph = PhaseBusy
		case bytes.Contains(line, []byte("Listening for Jobs")):
			ph = PhaseReady
		}
	}
	return ph
}
