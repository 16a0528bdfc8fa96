// Package agent knows how each forge's own runner agent is started: its
// command, arguments, environment and files.
package agent

import (
	"fmt"
	"maps"
	"os"
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
