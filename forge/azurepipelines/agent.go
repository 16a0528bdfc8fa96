package azurepipelines

import (
	"cmp"
	"fmt"
	"maps"
	"os"
	"path"
	"path/filepath"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// allowRoot is the variable by which run.sh lets the agent run as root.
const allowRoot = "AGENT_ALLOW_RUNASROOT"

// DefaultAgentPath is the agent's run.sh where the images of
// images/azure-pipelines-agent install it.
const DefaultAgentPath = "/azp/run.sh"

// Agent makes the Azure Pipelines agent the agent of a pool: its run.sh
// at the pool's agent.path, DefaultAgentPath unless the pool names another.
func (d *Forge) Agent(cfg agent.Config) (agent.Agent, error) {
	p := cmp.Or(cfg.Path, DefaultAgentPath)
	if path.Base(p) != "run.sh" {
		return nil, fmt.Errorf("agent.path: %q is not the agent's run.sh (its root directory holds bin/ and run.sh)", p)
	}
	if cfg.Local && !cfg.Inspect {
		abs, err := filepath.Abs(p)
		if err != nil {
			return nil, fmt.Errorf("agent.path: %q: %w", p, err)
		}
		if st, err := os.Stat(abs); err != nil || st.IsDir() {
			return nil, fmt.Errorf("agent.path: %q is not an agent's run.sh on this host (install the agent, unconfigured, and name its run.sh)", p)
		}
		if _, err := os.Stat(filepath.Join(filepath.Dir(abs), FileAgent)); err == nil {
			return nil, fmt.Errorf("agent.path: the agent at %s is configured (it has %s): runfleet registers each runner itself and needs an installation that is not", filepath.Dir(abs), FileAgent)
		}
		p = abs
	}
	return Agent{Root: path.Dir(p), Local: cfg.Local}, nil
}

// Agent starts the Azure Pipelines agent with run.sh --once, configured
// by the three files of its credential. The agent reads them from its root
// directory (where bin/ and run.sh are), not from where it runs, so:
//
//   - on this host (Local), each runner's fresh directory becomes an agent
//     root of its own, the installation linked into it file by file (hard
//     links; a copy across file systems), beside the files;
//   - in a machine of its own (a container, a pod, an instance), the files
//     are moved into the image's agent root, which no other runner shares.
type Agent struct {
	Root  string
	Local bool
}

// script prepares the agent root and runs the agent; $1 is the
// installation's root. It holds no secret: the credential is in the files.
const script = `set -e
root=$1
for f in .agent .credentials .credentials_rsaparams; do
  [ -s "$f" ] || { echo "runfleet: the agent's $f is missing" >&2; exit 2; }
done
if [ "$2" = local ]; then
  for f in "$root"/*; do
    case "${f##*/}" in _work|_diag) continue ;; esac
    cp -Rl "$f" . 2>/dev/null || cp -R "$f" .
  done
  exec ./run.sh --once
fi
if [ "$(cd "$root" && pwd -P)" != "$(pwd -P)" ]; then
  for f in .agent .credentials .credentials_rsaparams; do
    cp "$f" "$root/$f" && chmod 600 "$root/$f" && rm -f "$f"
  done
fi
cd "$root"
exec ./run.sh --once
`

// Spec runs the script with sh: the agent's environment is the pool's,
// and its credential is in its files only.
func (a Agent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	for _, f := range []string{FileAgent, FileCredentials, FileRSAParams} {
		if len(cred.Files[f]) == 0 {
			return provider.Spec{}, fmt.Errorf("azure-pipelines agent %s: credential has no %s", r.Name, f)
		}
	}
	env := map[string]string{}
	if a.Local {
		env = agent.BaseEnv(r.Env)
		// The agent's own switch for running as root: a manager run as
		// root on purpose passes it on to the agents it starts.
		if v := os.Getenv(allowRoot); v != "" && env[allowRoot] == "" {
			env[allowRoot] = v
		}
	} else {
		maps.Copy(env, r.Env)
	}
	mode := "image"
	if a.Local {
		mode = "local"
	}
	return provider.Spec{
		Name:       r.Name,
		Manager:    r.Manager,
		Pool:       r.Pool,
		Command:    "/bin/sh",
		Args:       []string{"-c", script, "azp-once", a.Root, mode},
		Env:        env,
		Files:      cred.Files,
		BusyMarker: string(phaseMarkers[agent.PhaseBusy]),
	}, nil
}

// phaseMarkers are the agent's console lines (its strings.json):
// "Listening for Jobs" once its session is open, "Running job: <name>"
// when it takes one, "Job <name> completed with result: <result>" when it
// ends.
var phaseMarkers = map[agent.Phase][]byte{
	agent.PhaseReady: []byte(": Listening for Jobs"),
	agent.PhaseBusy:  []byte(": Running job: "),
	agent.PhaseDone:  []byte(" completed with result: "),
}

// Phase reads the agent's output.
func (Agent) Phase(output []byte) agent.Phase { return agent.LastPhase(output, phaseMarkers) }
