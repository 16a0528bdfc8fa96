package bitbucket

import (
	"cmp"
	"fmt"
	"maps"
	"os/exec"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// DefaultAgentPath is the entrypoint of Atlassian's runner image
// (docker-public.packages.atlassian.com/sox/atlassian/bitbucket-pipelines-runner),
// which reads the runner's identity and OAuth client from its environment.
const DefaultAgentPath = "/opt/atlassian/pipelines/runner/entrypoint.sh"

// RunnerImage is Atlassian's Linux Docker runner image, by the tag
// Atlassian's runner installation dialog and CML (src/drivers/
// bitbucket_cloud.js) run: Bitbucket refuses runners much older than its
// latest, so a digest pinned here would stop working within months.
const RunnerImage = "docker-public.packages.atlassian.com/sox/atlassian/bitbucket-pipelines-runner:1"

// ImagePrefix, before an image reference in agent.path, runs the runner
// as that image through the machine's Docker engine.
const ImagePrefix = "docker://"

// Agent makes Bitbucket's runner the agent of a pool: the program at the
// pool's agent.path, DefaultAgentPath unless it names another. On this
// host it is found in PATH when it is not a path. An agent.path of
// ImagePrefix and an image runs the runner as that image through the
// machine's engine, as Atlassian's instructions run it: for a machine with
// Docker and no runner (a stock cloud image).
func (d *Forge) Agent(cfg agent.Config) (agent.Agent, error) {
	if image, ok := strings.CutPrefix(cfg.Path, ImagePrefix); ok {
		if image == "" || strings.ContainsAny(image, " \t\n'\"$`\\") {
			return nil, fmt.Errorf("agent.path: %q names no image (%s<image>, such as %s%s)", cfg.Path, ImagePrefix, ImagePrefix, RunnerImage)
		}
		if cfg.Local && !cfg.Inspect {
			if _, err := exec.LookPath("docker"); err != nil {
				return nil, fmt.Errorf("agent.path: %s runs the runner with Docker's CLI: %w", cfg.Path, err)
			}
		}
		return Agent{Image: image, Local: cfg.Local}, nil
	}
	p, err := agent.Locate(cfg, cmp.Or(cfg.Path, DefaultAgentPath))
	if err != nil {
		return nil, fmt.Errorf("%w (a program that starts Bitbucket's runner from the variables of its environment)", err)
	}
	return Agent{Path: p, Local: cfg.Local}, nil
}

// DockerAgentPath runs Atlassian's runner image on a stock cloud machine
// (forge.DockerAgent).
func (driver) DockerAgentPath() string { return ImagePrefix + RunnerImage }

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
	Path string
	// Image, where set, is the runner's image, run through the machine's
	// engine instead of Path.
	Image string
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

// imageScript is script for a runner run as an image ($1, the rest of its
// arguments docker run's): as Atlassian's instructions run it, with the
// engine's socket (the runner starts each step as a container of it) and
// the containers' logs, and its working directory at the same path on
// the machine and in the container, under /tmp as theirs: the runner's
// own, emptied before and removed after, so that nothing of a job stays
// for the next runner of the same name. Its variables go by name only
// (-e NAME), so no secret is in an argument; the container is stopped by
// its ID, which docker run writes to a file.
const imageScript = `own=
if [ -z "$WORKING_DIRECTORY" ]; then
  WORKING_DIRECTORY="/tmp/runfleet-$RUNFLEET_RUNNER"; own=1
  rm -rf "$WORKING_DIRECTORY"
fi
export WORKING_DIRECTORY
mkdir -p "$WORKING_DIRECTORY" || exit 2
cidfile="$PWD/.runner.cid"
rm -f "$cidfile"
image=$1; shift
stop() { cid=$(cat "$cidfile" 2>/dev/null) && docker stop --time 10 "$cid" >/dev/null 2>&1; }
clean() { [ -z "$own" ] || rm -rf "$WORKING_DIRECTORY"; }
trap 'stop; clean; exit 143' TERM INT
{ docker run --rm --pull missing --cidfile "$cidfile" \
    -v /var/run/docker.sock:/var/run/docker.sock \
    -v /var/lib/docker/containers:/var/lib/docker/containers:ro \
    -v "$WORKING_DIRECTORY:$WORKING_DIRECTORY" -e WORKING_DIRECTORY "$@" "$image" 2>&1
  echo "runfleet: the runner exited ($?)"; } |
while IFS= read -r line; do
  printf '%s\n' "$line"
  case $line in *"Waiting for next step"*) stop ;; esac
done
clean
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
	args := []string{"-c", script, "bitbucket-runner", a.Path}
	if a.Image != "" {
		env["RUNFLEET_RUNNER"] = r.Name
		args = []string{"-c", imageScript, "bitbucket-runner", a.Image, "--label", "runfleet.runner=" + r.Name}
		// The pool's variables and the credential's reach the runner,
		// not the machine's (PATH, HOME).
		for _, k := range slices.Sorted(maps.Keys(env)) {
			if _, ok := r.Env[k]; (ok || cred.Env[k] != "") && k != "WORKING_DIRECTORY" {
				args = append(args, "-e", k)
			}
		}
	}
	return provider.Spec{
		Name:       r.Name,
		Manager:    r.Manager,
		Pool:       r.Pool,
		Command:    "/bin/sh",
		Args:       args,
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
