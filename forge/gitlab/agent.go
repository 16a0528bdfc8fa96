package gitlab

import (
	"cmp"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// Agent makes gitlab-runner the agent of a pool: "gitlab-runner" in PATH
// unless the pool names another.
func (d *Forge) Agent(cfg agent.Config) (agent.Agent, error) {
	path, err := agent.Locate(cfg, cmp.Or(cfg.Path, "gitlab-runner"))
	if err != nil {
		return nil, err
	}
	return Agent{Path: path, InContainer: !cfg.Local, WaitTimeout: cfg.IdleTimeout}, nil
}

// Agent runs `gitlab-runner run-single` for one job: the shell executor
// unless the pool's env sets RUNNER_EXECUTOR (docker, where the pool
// mounts the engine on purpose), --max-builds 1, and --wait-timeout from
// the pool's idle timeout so that a runner nobody removes still exits.
//
// The runner's glrt- token reaches gitlab-runner in a config file
// (--config, --runner: commands/single.go loads the named runner from it
// once, at start), never in its environment, which the shell executor
// hands to every job (executors/shell/shell.go: Env: os.Environ()). A job
// runs as gitlab-runner's user, so it could still read that file or the
// process: the file's hooks (tokenGuard) hold the job's first command
// until the token is dead, which the pool sees to the moment the runner
// takes its job (Forge.Cordon resets it).
type Agent struct {
	Path string
	// InContainer is set when the agent runs in a machine's image, whose
	// own PATH applies.
	InContainer bool
	// WaitTimeout is how long the runner waits for its job before it
	// exits by itself; 0 waits for ever.
	WaitTimeout time.Duration
}

// ConfigFile is the runner's config.toml, written in its working
// directory: the only place its token is.
const ConfigFile = "gitlab-runner.toml"

// Spec gives gitlab-runner its URL and token in ConfigFile, never in its
// environment or arguments.
func (g Agent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	url, token := cred.Env[EnvURL], cred.Env[EnvToken]
	if token == "" || url == "" {
		return provider.Spec{}, fmt.Errorf("gitlab-runner %s: credential has no runner token or URL", r.Name)
	}
	env := map[string]string{}
	if g.InContainer {
		maps.Copy(env, r.Env)
	} else {
		env = agent.BaseEnv(r.Env)
	}
	maps.Copy(env, cred.Env)
	executor := cmp.Or(env["RUNNER_EXECUTOR"], "shell")
	delete(env, "RUNNER_EXECUTOR")
	// The credential's URL and token go in the config file only: the
	// shell executor hands the environment to the job.
	delete(env, EnvToken)
	delete(env, EnvURL)
	cfg, err := runnerConfig(r.Name, url, token, executor)
	if err != nil {
		return provider.Spec{}, fmt.Errorf("gitlab-runner %s: %w", r.Name, err)
	}
	args := []string{"run-single", "--config", ConfigFile, "--runner", r.Name, "--max-builds", "1"}
	if g.WaitTimeout > 0 {
		args = append(args, "--wait-timeout", strconv.Itoa(int(max(g.WaitTimeout.Seconds(), 1))))
	}
	return provider.Spec{
		Name:       r.Name,
		Manager:    r.Manager,
		Pool:       r.Pool,
		Command:    g.Path,
		Args:       args,
		Env:        env,
		Files:      map[string][]byte{ConfigFile: cfg},
		BusyMarker: string(phaseMarkers[agent.PhaseBusy]),
	}, nil
}

// phaseMarkers are run-single's log lines: "Checking for jobs...
// received" when it took a job, and, as it exits, "This runner has
// processed its build limit, so now exiting" or "This runner has not
// received a job in N seconds, so now exiting". It prints nothing when it
// is ready: GitLab's contacted_at tells.
var phaseMarkers = map[agent.Phase][]byte{
	agent.PhaseBusy: []byte("Checking for jobs... received"),
	agent.PhaseDone: []byte(", so now exiting"),
}

// Phase reads the runner's output.
func (Agent) Phase(output []byte) agent.Phase { return agent.LastPhase(output, phaseMarkers) }
