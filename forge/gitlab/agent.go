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
func (d *Driver) Agent(cfg agent.Config) (agent.Agent, error) {
	path, err := agent.Locate(cfg, cmp.Or(cfg.Path, "gitlab-runner"))
	if err != nil {
		return nil, err
	}
	return Agent{Path: path, InContainer: !cfg.Local, WaitTimeout: cfg.IdleTimeout}, nil
}

// Agent runs `gitlab-runner run-single` for one job: --executor shell
// unless the pool's env sets RUNNER_EXECUTOR (docker, where the pool
// mounts the engine on purpose), --max-builds 1, and --wait-timeout from
// the pool's idle timeout so that a runner nobody removes still exits.
type Agent struct {
	Path string
	// InContainer is set when the agent runs in a machine's image, whose
	// own PATH applies.
	InContainer bool
	// WaitTimeout is how long the runner waits for its job before it
	// exits by itself; 0 waits for ever.
	WaitTimeout time.Duration
}

// Spec gives gitlab-runner its URL and glrt- token in its environment
// (CI_SERVER_URL, CI_SERVER_TOKEN), never as arguments.
func (g Agent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	if cred.Env[EnvToken] == "" || cred.Env[EnvURL] == "" {
		return provider.Spec{}, fmt.Errorf("gitlab-runner %s: credential has no runner token or URL", r.Name)
	}
	env := map[string]string{}
	if g.InContainer {
		maps.Copy(env, r.Env)
	} else {
		env = agent.BaseEnv(r.Env)
	}
	maps.Copy(env, cred.Env)
	env["RUNNER_NAME"] = r.Name
	executor := cmp.Or(env["RUNNER_EXECUTOR"], "shell")
	delete(env, "RUNNER_EXECUTOR")
	args := []string{"run-single", "--executor", executor, "--max-builds", "1"}
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
