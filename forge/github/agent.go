package github

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/fetch"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// ImageRunScript is where images/github-runner keeps the runner's run.sh.
const ImageRunScript = "/home/runner/run.sh"

// AgentRelease is GitHub's runner (actions/runner) that `runfleet runner`
// fetches for a host without one: v2.337.0 (2026-08-26), its files'
// SHA-256 as the release publishes them. A runner older than GitHub's
// minimum updates itself before it takes a job.
var AgentRelease = fetch.Release{
	Name: "actions-runner", Version: "2.337.0",
	URL:  "https://github.com/actions/runner/releases/download/v{version}",
	File: "actions-runner-linux-{arch}-{version}.tar.gz",
	Arch: map[string]string{"amd64": "x64", "arm64": "arm64"},
	SHA256: map[string]string{
		"amd64": "70920811a4f8ad4328818682bca5c6469c1c942fab52448868071d0063816613",
		"arm64": "9b1dc70626422526e3c94767cf024896beb15da5342a3f4819bf2feac13e0393",
	},
	Program: "run.sh",
}

// AgentRelease makes GitHub's runner fetchable (forge.AgentReleaser).
func (driver) AgentRelease() fetch.Release { return AgentRelease }

// AgentImage is GitHub's own runner image (actions/runner's images/
// Dockerfile, published to ghcr.io with each release): run.sh at
// ImageRunScript, run as the user runner (uid 1001) (forge.AgentImager).
func (driver) AgentImage() string { return "ghcr.io/actions/actions-runner:" + AgentRelease.Version }

// Agent makes GitHub's runner the agent of a pool: run.sh in PATH on this
// host, or in the image at ImageRunScript, unless the pool names another.
func (d *Forge) Agent(cfg agent.Config) (agent.Agent, error) {
	path := cfg.Path
	switch {
	case path == "" && cfg.Local:
		path = "run.sh"
	case path == "":
		path = ImageRunScript
	}
	path, err := agent.Locate(cfg, path)
	if err != nil {
		return nil, err
	}
	return Agent{Path: path, InContainer: !cfg.Local}, nil
}

// Agent starts GitHub's runner (actions/runner) with the just-in-time
// config it was registered with.
type Agent struct {
	// Path is the runner's run.sh.
	Path string
	// InContainer is set when the agent runs in a machine's image.
	InContainer bool
}

// Spec runs run.sh with the JIT config in ACTIONS_RUNNER_INPUT_JITCONFIG:
// the runner reads it from there as it would --jitconfig, and clears it
// before any job step runs, so that it is in no process listing and no
// job's environment. Without JIT (a registration token, where GitHub
// offers no JIT runners) config.sh registers an ephemeral runner first,
// reading the token from ACTIONS_RUNNER_INPUT_TOKEN.
func (g Agent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	env := map[string]string{}
	if g.InContainer {
		maps.Copy(env, r.Env)
		// Runner images may run as root; the runner refuses that unless told.
		env["RUNNER_ALLOW_RUNASROOT"] = "1"
	} else {
		env = agent.BaseEnv(r.Env)
		if os.Geteuid() == 0 {
			env["RUNNER_ALLOW_RUNASROOT"] = "1"
		}
	}
	maps.Copy(env, cred.Env)
	spec := provider.Spec{Name: r.Name, Manager: r.Manager, Pool: r.Pool, Env: env, Files: maps.Clone(cred.Files),
		BusyMarker: string(phaseMarkers[agent.PhaseBusy])}
	switch {
	case cred.Env[EnvJITConfig] != "":
		spec.Command = g.Path
	case cred.Env[EnvToken] != "":
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

// phaseMarkers are Runner.Listener's lines: "Listening for Jobs",
// "Running job: <name>", "Job <name> completed with result: <result>".
var phaseMarkers = map[agent.Phase][]byte{
	agent.PhaseReady: []byte("Listening for Jobs"),
	agent.PhaseBusy:  []byte("Running job:"),
	agent.PhaseDone:  []byte("completed with result:"),
}

// Phase reads the runner's output: the last telling line printed tells.
func (Agent) Phase(output []byte) agent.Phase { return agent.LastPhase(output, phaseMarkers) }
