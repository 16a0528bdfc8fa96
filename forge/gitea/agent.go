package gitea

import (
	"bytes"
	"fmt"
	"maps"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// Agent makes gitea-runner the agent of a pool: "gitea-runner" in PATH
// unless the pool names another.
func (d *Forge) Agent(cfg agent.Config) (agent.Agent, error) {
	path := cfg.Path
	if path == "" {
		path = "gitea-runner"
	}
	path, err := agent.Locate(cfg, path)
	if err != nil {
		return nil, err
	}
	return Agent{Path: path, FetchInterval: cfg.FetchInterval, InContainer: !cfg.Local}, nil
}

// Agent starts gitea-runner (formerly act_runner) in host mode: job steps
// run as processes on the runner's machine.
type Agent struct {
	// Path is the gitea-runner binary.
	Path string
	// FetchInterval is how often the idle runner asks Gitea for a job.
	FetchInterval time.Duration
	// InContainer is set when the agent runs in a machine's image, whose
	// own PATH and locale apply: the manager's PATH means nothing there.
	InContainer bool
}

// FetchTimeout bounds each task fetch of the runner. A fetch that Gitea
// has not answered by then is abandoned by the runner, so a task that
// Gitea assigns later is lost whatever the manager does; one assigned
// sooner shows within this time, which is what RemoveRunner waits for.
const FetchTimeout = 5 * time.Second

// ReportCloseTimeout bounds each attempt of the runner's last reports of a
// job (its log, then its result), each retried for three times as long.
// A job that ends while Gitea is away is failed if neither lands before
// Gitea's return: at gitea-runner's 10 s that is a 30-s outage, at a
// minute three minutes, which a deploy or a database failover of the
// forge fits in.
const ReportCloseTimeout = time.Minute

// ConfigFile is the config file written next to the registration.
const ConfigFile = "runner.yaml"

// Spec writes gitea-runner's config next to its .runner registration and
// runs `gitea-runner daemon`: an ephemeral registration makes it take one
// job and exit.
func (g Agent) Spec(r agent.Runner, cred forge.Credential) (provider.Spec, error) {
	if _, ok := cred.Files[RegistrationFile]; !ok {
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
			"file":     RegistrationFile,
			"capacity": 1,
			// No backoff: an idle runner of a warm pool should pick a
			// job up within one interval.
			"fetch_interval":     fetch.String(),
			"fetch_interval_max": fetch.String(),
			// RemoveRunner's settle time is derived from it.
			"fetch_timeout":        FetchTimeout.String(),
			"report_close_timeout": ReportCloseTimeout.String(),
			"labels":               labels,
			"timeout":              "24h",
			// On SIGTERM the runner cancels its job at once, which act
			// then reports as a success. A runner signalled with its
			// whole job (Slurm's scancel, a process group stopped)
			// keeps it a while instead: the job's steps, dead, fail
			// it, and the forge re-runs it. Short, so that a runner
			// signalled alone (a cloud's notice before any step ran)
			// still stops well within its killer's grace (30 s).
			"shutdown_timeout": "10s",
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
		env = agent.BaseEnv(r.Env)
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
		// The line that says it took a task.
		BusyMarker: string(phaseMarkers[agent.PhaseBusy]),
	}, nil
}

// phaseMarkers are gitea-runner's log lines: "runner: <name>, with version:
// ..., declare successfully", "task <id> repo is <repo> ...", and, once
// its one job is done, "runner: <name> shutdown initiated".
var phaseMarkers = map[agent.Phase][]byte{
	agent.PhaseReady: []byte("declare successfully"),
	agent.PhaseBusy:  []byte(" repo is "),
	agent.PhaseDone:  []byte("shutdown initiated"),
}

// cancelled is what gitea-runner prints when it is stopped with its job
// still running: the job died with it.
var cancelled = []byte("cancelled in progress jobs")

// Phase reads the runner's output: the last telling line tells, except
// that a job cancelled by a shutdown did not end, it died.
func (Agent) Phase(output []byte) agent.Phase {
	ph := agent.LastPhase(output, phaseMarkers)
	if ph == agent.PhaseDone && bytes.Contains(output, cancelled) && bytes.Contains(output, phaseMarkers[agent.PhaseBusy]) {
		return agent.PhaseBusy
	}
	return ph
}
