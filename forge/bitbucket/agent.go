package bitbucket

import (
	"cmp"
	"fmt"
	"maps"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// DefaultAgentPath is the entrypoint of Atlassian's runner image
// (docker-public.packages.atlassian.com/sox/atlassian/bitbucket-pipelines-runner),
// which reads the runner's identity and OAuth client from its environment.
const DefaultAgentPath = "/opt/atlassian/pipelines/runner/entrypoint.sh"

// Agent makes Bitbucket's runner the agent of a pool: the program at the
// pool's agent.path, DefaultAgentPath unless it names another. On this
// host it is found in PATH when it is not a path.
func (d *Driver) Agent(cfg agent.Config) (agent.Agent, error) {
	p, err := agent.Locate(cfg, cmp.Or(cfg.Path, DefaultAgentPath))
	if err != nil {
		return nil, fmt.Errorf("%w (a program that starts Bitbucket's runner from the variables of its environment)", err)
	}
	return Agent{Path: p, Local: cfg.Local}, nil
}

// Agent starts Bitbucket's runner with its identity and OAuth client in
// its environment (ACCOUNT_UUID, REPOSITORY_UUID, RUNNER_UUID,
// OAUTH_CLIENT_ID, OAUTH_CLIENT_SECRET), never as arguments: the Linux
// Shell runner's start.sh takes them as arguments, where any process on
// the host could read the secret, so a pool of such runners names a
// program that passes them on from the environment. WORKING_DIRECTORY is
// a directory of the runner's own, below where it starts.
//
// The runner has no single-step mode. Two things keep it to one step: the
// pool disables it as soon as it takes one (forge.Cordoner), and the
// script it runs in stops it as soon as it says it waits for the next
// (its line "Waiting for next step", after the step's result is sent),
// before it asks for one; the runner then exits, and the pool deletes it.
type Agent struct {
	Path  string
	Local bool
}

// script makes the working directory and runs the runner, $1, from its
// own directory (the runner image's entrypoint expects it), with its
// output read line by line: each line passed on, the runner stopped at
// the first "Waiting for next step". It holds no secret.
const script = `export WORKING_DIRECTORY="${WORKING_DIRECTORY:-$PWD/work}"
mkdir -p "$WORKING_DIRECTORY" || exit 2
pidfile="$PWD/.runner.pid"
stop() { kill -TERM "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null; }
trap 'stop; exit 143' TERM INT
{ sh -c 'echo $$ > "$0" && cd "$(dirname "$1")" && exec "$1"' "$pidfile" "$1" 2>&1; echo "runfleet: the runner exited ($?)"; } |
while IFS= read -r line; do
  printf '%s\n' "$line"
  case $line in *"Waiting for next step"*) stop ;; esac
done
`

// Spec runs the script with sh; the runner's environment is the pool's
// and its credential's.
func (a Agent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	for _, k := range []string{EnvAccount, EnvRunner, EnvClientID, EnvClientSecret} {
		if cred.Env[k] == "" {
			return provider.Spec{}, fmt.Errorf("bitbucket runner %s: credential has no %s", r.Name, k)
		}
	}
	env := map[string]string{}
	if a.Local {
		env = agent.BaseEnv(r.Env)
	} else {
		maps.Copy(env, r.Env)
	}
	maps.Copy(env, cred.Env)
	return provider.Spec{
		Name:       r.Name,
		Manager:    r.Manager,
		Pool:       r.Pool,
		Command:    "/bin/sh",
		Args:       []string{"-c", script, "bitbucket-runner", a.Path},
		Env:        env,
		BusyMarker: string(phaseMarkers[agent.PhaseBusy]),
	}, nil
}

// phaseMarkers are the runner's log lines: `Updating runner status to
// "ONLINE"` once it is connected, "Getting step StepId{" when it takes a
// step, "Completing step with result" when the step ends. The runner goes
// on after that, waiting for the next step: the pool retires it then.
var phaseMarkers = map[agent.Phase][]byte{
	agent.PhaseReady: []byte(`Updating runner status to "ONLINE"`),
	agent.PhaseBusy:  []byte("Getting step StepId{"),
	agent.PhaseDone:  []byte("Completing step with result"),
}

// Phase reads the runner's output.
func (Agent) Phase(output []byte) agent.Phase { return agent.LastPhase(output, phaseMarkers) }
