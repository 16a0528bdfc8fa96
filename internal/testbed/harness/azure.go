package harness

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/azsim"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// AZToken is the simulated Azure DevOps' personal access token: the secret
// that must reach no agent.
const AZToken = "e2e-simulated-azure-devops-pat-must-not-leak"

var azStandIn = &StandIn{pkg: "github.com/runfleet/runfleet/internal/testbed/azsim/agent", file: "Agent.Listener", name: "azure-pipelines-agent"}

var (
	azInstallOnce sync.Once
	azInstall     string
	azInstallErr  error
)

// NeedAzureAgent lays out an agent installation (the stand-in's run.sh and
// bin/Agent.Listener), unconfigured, and returns its run.sh.
func NeedAzureAgent(t testing.TB) string {
	t.Helper()
	bin := azStandIn.bin(t)
	azInstallOnce.Do(func() {
		dir, err := os.MkdirTemp("", "runfleet-azp-")
		if err == nil {
			err = azsim.Install(dir, bin)
		}
		azInstall, azInstallErr = filepath.Join(dir, "run.sh"), err
	})
	if azInstallErr != nil {
		t.Fatal(azInstallErr)
	}
	return azInstall
}

// azureImage builds, on an engine, an image with the stand-in agent
// installed at /azp, as images/azure-pipelines-agent installs the real
// one, and extra files. BuildImage tags it by its content: one built
// already is reused.
func azureImage(t testing.TB, cli *client.Client, repo string, extra ...peers.ImageFile) string {
	t.Helper()
	bin := azStandIn.bin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	files := append([]peers.ImageFile{
		{Path: "azp/bin/Agent.Listener", From: bin, Mode: 0o755},
		{Path: "azp/run.sh", Data: []byte(azsim.RunScript), Mode: 0o755},
	}, extra...)
	img, err := peers.BuildImage(ctx, cli, repo, files...)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

type AzureOptions struct {
	Size, Max int
	Docker    bool
	Sim       azsim.Options
	Forge     string // appended to the forge
	Pool      string // appended to the pool
	Top       string // added at the top of the config
	// Labels are the pool's labels ([<name>] when nil).
	Labels []string
	// Engine runs the containers instead of the default engine, with
	// host networking.
	Engine *GPUEngine
	// DockerExtra is appended to the pool's docker section.
	DockerExtra string
	// Images, when set, takes the place of the docker section's image
	// (an images: list, indented by six spaces).
	Images string
	// Env is added to the pool's env ("      KEY: value" lines).
	Env string
}

// NewAzureFleet makes a manager config for a pool of agents on the
// simulated Azure DevOps, in an agent pool named after the test's pool.
func NewAzureFleet(t testing.TB, name string, opt AzureOptions) *Fleet {
	t.Helper()
	run := NeedAzureAgent(t)
	image := ""
	switch {
	case opt.Engine != nil:
		image = azureImage(t, opt.Engine.cli, "runfleet-test/azure-pipelines-agent")
		opt.Sim.RunnerHost = "127.0.0.1" // host networking
		opt.Docker = true
	case opt.Docker:
		NeedDocker(t)
		image = azureImage(t, DockerCli, "runfleet-test/azure-pipelines-agent")
		opt.Sim.RunnerHost = "host.docker.internal"
	}
	opt.Sim.Token = AZToken
	opt.Sim.Pools = append(opt.Sim.Pools, name)
	sim := azsim.New(opt.Sim)
	t.Cleanup(sim.Close)
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	if opt.Labels == nil {
		opt.Labels = []string{name}
	}
	dir := t.TempDir()
	f := &Fleet{T: t, Repo: name, Dir: dir, State: filepath.Join(dir, "state"), Work: filepath.Join(dir, "work"), AZ: sim, docker: opt.Docker,
		Env: []string{"E2E_AZURE_TOKEN=" + AZToken}}
	if opt.Engine != nil {
		f.engine = opt.Engine.cli
		f.Env = append(f.Env, "DOCKER_HOST="+opt.Engine.host)
	}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: 2m
forges:
  - name: ado
    type: azure-pipelines
    url: %[3]s
    runner_url: %[4]s
    token: ${E2E_AZURE_TOKEN}
    pool: %[1]s
%[7]spools:
  - name: %[1]s
    labels: [%[9]s]
    size: %[5]d
    max: %[6]d
    workdir: %[8]s
    bootstrap_timeout: 1m
    env:
      AGENT_ALLOW_RUNASROOT: "1"
`, name, f.State, sim.URL, sim.RunnerURL(), opt.Size, opt.Max, opt.Forge, f.Work, strings.Join(opt.Labels, ", ")) + opt.Env
	if opt.Size < 0 { // sized by the pool's GPUs
		cfg = strings.Replace(cfg, fmt.Sprintf("    size: %d\n    max: %d\n", opt.Size, opt.Max), "", 1)
	}
	if opt.Docker {
		img := "      image: " + image + "\n"
		if opt.Images != "" {
			img = opt.Images
		}
		cfg += "    agent:\n      path: /azp/run.sh\n    docker:\n" + img + "      pull: never\n" + opt.DockerExtra
		if opt.Engine != nil {
			cfg += "      network: host\n"
		}
	} else {
		cfg += "    agent:\n      path: " + run + "\n"
	}
	cfg += opt.Pool
	f.Config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.Config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Cleanup)
	return f
}

// IdleAzure counts the agents online, enabled and without a job.
func IdleAzure(sim *azsim.Server) int {
	n := 0
	for _, a := range AZRunners(sim) {
		if a.Online && a.Enabled && a.Request == 0 {
			n++
		}
	}
	return n
}

// AZRunners are the agents not deleted, but the pools' placeholders
// (registered with a pool's capabilities and never run).
func AZRunners(sim *azsim.Server) []azsim.Agent {
	return slices.DeleteFunc(sim.Agents(), placeholder)
}

// AZAdded are the agents ever added, deleted ones included, but the
// placeholders.
func AZAdded(sim *azsim.Server) []azsim.Agent {
	return slices.DeleteFunc(sim.AllAgents(), placeholder)
}

func placeholder(a azsim.Agent) bool { return a.UserCaps["runfleet.placeholder"] != "" }

// AZCompleted counts the finished job requests, and those that succeeded.
func AZCompleted(sim *azsim.Server) (done, ok int) {
	for _, r := range sim.Requests() {
		if r.Result != "" {
			done++
			if r.Result == "succeeded" {
				ok++
			}
		}
	}
	return done, ok
}

// AZRunning counts the job requests an agent runs.
func AZRunning(sim *azsim.Server) int {
	n := 0
	for _, r := range sim.Requests() {
		if r.AgentID != 0 && r.Result == "" {
			n++
		}
	}
	return n
}

// AZJobs makes n job specs running script.
func AZJobs(n int, script string, demands ...string) []azsim.JobSpec {
	specs := make([]azsim.JobSpec, n)
	for i := range specs {
		specs[i] = azsim.JobSpec{Name: fmt.Sprintf("test %d/%d", i+1, n), Demands: demands, Script: script}
	}
	return specs
}

// AZJobScript is JobScript, and the agent's own files, which a job can
// read: what a hostile job could take.
const AZJobScript = JobScript + `
cat "$AGENT_ROOTDIRECTORY"/.agent "$AGENT_ROOTDIRECTORY"/.credentials "$AGENT_ROOTDIRECTORY"/.credentials_rsaparams`

var clientIDRE = regexp.MustCompile(`"clientId": "([0-9a-f-]{36})"`)

// CheckAzureSecrets reads every job's log (its environment, every
// process's command line, its agent's files) and every agent's system
// capabilities (its environment, as it reports it): the PAT shows in none,
// and each job saw its own agent's OAuth client only.
func CheckAzureSecrets(t testing.TB, sim *azsim.Server) {
	t.Helper()
	clients := map[int]string{}
	for _, a := range sim.AllAgents() {
		clients[a.ID] = a.ClientID
		for k, v := range a.SystemCaps {
			if strings.Contains(k+"="+v, AZToken) {
				t.Errorf("agent %s reports the PAT in its environment (%s)", a.Name, k)
			}
		}
	}
	reqs := sim.Requests()
	for _, r := range reqs {
		if r.Result == "" {
			continue
		}
		if bytes.Contains(r.Log, []byte(AZToken)) {
			t.Errorf("job %d (%s) saw the PAT", r.ID, r.Name)
		}
		if m := clientIDRE.FindAllSubmatch(r.Log, -1); len(m) != 1 || string(m[0][1]) != clients[r.AgentID] {
			t.Errorf("job %d: its agent's .credentials name client %q, want its own agent's %s once", r.ID, m, clients[r.AgentID])
		}
	}
	t.Logf("%d job logs (each job's environment, every process's arguments, its agent's three files) and %d agents' reported environments: no PAT; each job saw its own agent's client only", len(reqs), len(clients))
}

// AgentNamesWithin checks that every agent ever added is named
// <pool>-1 … <pool>-n.
func AgentNamesWithin(t testing.TB, sim *azsim.Server, pool string, n int) {
	t.Helper()
	names := map[string]bool{}
	for _, a := range AZAdded(sim) {
		names[a.Name] = true
		ok := false
		for i := 1; i <= n; i++ {
			ok = ok || a.Name == fmt.Sprintf("%s-%d", pool, i)
		}
		if !ok {
			t.Errorf("agent %q is not one of %s-1 … %s-%d", a.Name, pool, pool, n)
		}
	}
	t.Logf("%d agents added in all, under %d names, within %s-1 … %s-%d", len(sim.AllAgents()), len(names), pool, pool, n)
}

// azureChaos is ChaosForge for a fleet on the Azure DevOps simulator.
func (f *Fleet) azureChaos() ChaosForge {
	sim := f.AZ
	return ChaosForge{
		push: func(n, b, sleep int) {
			if _, err := sim.QueueRun(f.Repo, AZJobs(n, fmt.Sprintf("echo burst %d; sleep %d", b, sleep), f.Repo)...); err != nil {
				f.T.Fatal(err)
			}
		},
		wait: func(n int, timeout time.Duration) []EndedJob {
			return waitEnded(f.T, n, timeout, func() (ended []EndedJob, open []string) {
				for _, r := range sim.Requests() {
					if r.Result == "" {
						open = append(open, fmt.Sprintf("%d %s (on %q)", r.ID, r.Name, r.AgentName))
						continue
					}
					c := map[string]string{"succeeded": "success", "failed": "failure"}[r.Result]
					if c == "" {
						c = r.Result
					}
					ended = append(ended, EndedJob{ID: r.ID, Run: int64(r.BuildID), RunnerID: int64(r.AgentID), Name: r.Name, Runner: r.AgentName, Conclusion: c})
				}
				return ended, open
			})
		},
		ready: func() int { return IdleAzure(sim) },
		names: func() ([]string, error) {
			var names []string
			for _, a := range AZRunners(sim) {
				names = append(names, a.Name)
			}
			return names, nil
		},
	}
}

// AzureCUDAImages builds, on a private engine, one agent image per CUDA
// version, each saying its version in /etc/cuda-version, as images built
// FROM nvidia/cuda:<version> differ.
func AzureCUDAImages(t testing.TB, e *GPUEngine, versions ...string) []string {
	t.Helper()
	var out []string
	for _, v := range versions {
		out = append(out, azureImage(t, e.cli, "runfleet-test/azure-pipelines-agent-cuda",
			peers.ImageFile{Path: "etc/cuda-version", Data: []byte(v + "\n"), Mode: 0o644}))
	}
	return out
}
