package harness

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/moby/client"
	"github.com/runfleet/runfleet/forge/bitbucket"
	"github.com/runfleet/runfleet/internal/testbed/bbsim"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// BBToken is the simulated Bitbucket's access token: the secret that must
// reach no runner.
const BBToken = "e2e-simulated-bitbucket-access-token-must-not-leak"

var bbStandIn = &StandIn{pkg: "github.com/runfleet/runfleet/internal/testbed/bbsim/runner", file: "bitbucket-runner", name: "bitbucket-runner"}

// NeedBitbucketRunner builds the stand-in runner and returns its path.
func NeedBitbucketRunner(t testing.TB) string {
	t.Helper()
	return bbStandIn.bin(t)
}

type BitbucketOptions struct {
	Size, Max int
	Docker    bool
	Sim       bbsim.Options
	Forge     string // appended to the forge
	Pool      string // appended to the pool
	Top       string // added at the top of the config
	// Labels are the pool's labels ([<name>] when nil).
	Labels []string
}

// NewBitbucketFleet makes a manager config for a pool of repository
// runners of acme/<name> on the simulated Bitbucket. Its budget of calls
// is above Bitbucket Cloud's default (900 an hour, for its 1,000), which
// would pace a test's bursts at one call every four seconds: the
// simulator has no hourly limit.
func NewBitbucketFleet(t testing.TB, name string, opt BitbucketOptions) *Fleet {
	t.Helper()
	bin := NeedBitbucketRunner(t)
	agentPath := bin
	if opt.Docker {
		agentPath = "/bin/" + bbStandIn.name
		opt.Sim.RunnerHost = "host.docker.internal"
	}
	opt.Sim.Token = BBToken
	opt.Sim.Repos = append(opt.Sim.Repos, name)
	sim := bbsim.New(opt.Sim)
	t.Cleanup(sim.Close)
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	if opt.Labels == nil {
		opt.Labels = []string{name}
	}
	dir := t.TempDir()
	f := &Fleet{T: t, Repo: name, Dir: dir, State: filepath.Join(dir, "state"), Work: filepath.Join(dir, "work"), BB: sim, docker: opt.Docker,
		Env: []string{"E2E_BITBUCKET_TOKEN=" + BBToken}}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: 2m
forges:
  - name: bb
    type: bitbucket
    url: %[3]s
    runner_url: %[4]s
    token: ${E2E_BITBUCKET_TOKEN}
    workspace: acme
    repository: %[1]s
    calls_per_hour: 36000
%[7]spools:
  - name: %[1]s
    labels: [%[9]s]
    size: %[5]d
    max: %[6]d
    workdir: %[8]s
    bootstrap_timeout: 1m
    agent:
      path: %[10]s
`, name, f.State, sim.URL, sim.RunnerURL(), opt.Size, opt.Max, opt.Forge, f.Work, strings.Join(opt.Labels, ", "), agentPath)
	if opt.Docker {
		cfg += "    docker:\n      image: " + bbStandIn.image(t) + "\n      pull: never\n"
	}
	cfg += opt.Pool
	f.Config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.Config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Cleanup)
	return f
}

// IdleBitbucket counts the runners online, enabled and without a step.
func IdleBitbucket(sim *bbsim.Server) int {
	n := 0
	for _, r := range sim.Runners() {
		if sim.Status(r) == "ONLINE" && r.Step == "" {
			n++
		}
	}
	return n
}

// BBCompleted counts the completed steps, and those that succeeded.
func BBCompleted(sim *bbsim.Server) (done, ok int) {
	for _, s := range sim.Steps() {
		if s.State == "COMPLETED" {
			done++
			if s.Result == "SUCCESSFUL" {
				ok++
			}
		}
	}
	return done, ok
}

// BBRunning counts the steps a runner runs.
func BBRunning(sim *bbsim.Server) int {
	n := 0
	for _, s := range sim.Steps() {
		if s.State == "IN_PROGRESS" {
			n++
		}
	}
	return n
}

// BBSteps makes n step specs running script on runners with labels.
func BBSteps(n int, script string, labels ...string) []bbsim.StepSpec {
	specs := make([]bbsim.StepSpec, n)
	for i := range specs {
		specs[i] = bbsim.StepSpec{Name: fmt.Sprintf("test %d/%d", i+1, n), RunsOn: append([]string{"self.hosted"}, labels...), Script: script}
	}
	return specs
}

// CheckBitbucketSecrets reads every step's log (its environment, every
// process's command line on its machine) and everything the manager wrote:
// neither the access token nor any runner's OAuth secret shows in a step's
// log, and no OAuth secret in the manager's logs, records or working
// directories. A runner's secret is in its own runner's environment only.
func CheckBitbucketSecrets(t testing.TB, f *Fleet) {
	t.Helper()
	runners := f.BB.AllRunners()
	steps := f.BB.Steps()
	for _, s := range steps {
		if bytes.Contains(s.Log, []byte(BBToken)) {
			t.Errorf("step %s (%s) saw the access token", s.UUID, s.Name)
		}
		for _, r := range runners {
			if bytes.Contains(s.Log, []byte(r.Secret)) {
				t.Errorf("step %s (%s) on runner %s saw the OAuth secret of runner %s", s.UUID, s.Name, s.Runner, r.Name)
			}
		}
	}
	files := 0
	_ = filepath.Walk(f.Dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() || path == f.Config {
			return nil
		}
		files++
		b, _ := os.ReadFile(path)
		if bytes.Contains(b, []byte(BBToken)) {
			t.Errorf("the access token is in %s", path)
		}
		for _, r := range runners {
			if bytes.Contains(b, []byte(r.Secret)) {
				t.Errorf("runner %s's OAuth secret is in %s", r.Name, path)
			}
		}
		return nil
	})
	t.Logf("%d step logs (each step's environment, every process's arguments) and %d files the manager and its runners wrote: no access token, no runner's OAuth secret (%d runners)", len(steps), files, len(runners))
}

// checkBitbucketLeftNothing: no runner left at Bitbucket, none deleted
// while it ran a step (but the killed ones the test killed), none given a
// second step.
func checkBitbucketLeftNothing(t testing.TB, sim *bbsim.Server, killed int) {
	t.Helper()
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("%d runners left at Bitbucket after shutdown: %+v", len(r), r)
	}
	busy := 0
	for _, r := range sim.AllRunners() {
		if r.DeletedBusy {
			busy++
		}
		if r.DeletedBusy && busy > killed {
			t.Errorf("runner %s was deleted while it ran a step", r.Name)
		}
		if r.Steps > 1 {
			t.Errorf("runner %s took %d steps", r.Name, r.Steps)
		}
	}
}

// RunnerNamesWithin checks that every runner ever created is named
// <manager>.<pool>-1 … <manager>.<pool>-n.
func RunnerNamesWithin(t testing.TB, sim *bbsim.Server, manager, pool string, n int) {
	t.Helper()
	names := map[string]bool{}
	for _, r := range sim.AllRunners() {
		names[r.Name] = true
		ok := false
		for i := 1; i <= n; i++ {
			ok = ok || r.Name == fmt.Sprintf("%s.%s-%d", manager, pool, i)
		}
		if !ok {
			t.Errorf("runner %q is not one of %s.%s-1 … %s-%d", r.Name, manager, pool, pool, n)
		}
	}
	t.Logf("%d runners created in all, under %d names, within %s.%s-1 … %s-%d", len(sim.AllRunners()), len(names), manager, pool, pool, n)
}

// bitbucketChaos is ChaosForge for a fleet on the Bitbucket simulator.
func (f *Fleet) bitbucketChaos() ChaosForge {
	sim := f.BB
	return ChaosForge{
		push: func(n, b, sleep int) {
			if _, err := sim.RunPipeline(f.Repo, BBSteps(n, fmt.Sprintf("echo burst %d; sleep %d", b, sleep), f.Repo)...); err != nil {
				f.T.Fatal(err)
			}
		},
		wait: func(n int, timeout time.Duration) []EndedJob {
			return waitEnded(f.T, n, timeout, func() (ended []EndedJob, open []string) {
				runners := map[string]int64{} // a number per runner uuid
				for _, s := range sim.Steps() {
					if s.State != "COMPLETED" {
						open = append(open, fmt.Sprintf("%s %s (%s on %q)", s.UUID, s.Name, s.State, s.Runner))
						continue
					}
					c := map[string]string{"SUCCESSFUL": "success", "FAILED": "failure"}[s.Result]
					if c == "" {
						c = strings.ToLower(s.Result)
					}
					if runners[s.Runner] == 0 {
						runners[s.Runner] = int64(len(runners) + 1)
					}
					ended = append(ended, EndedJob{ID: int64(len(ended) + 1), Run: s.Build, RunnerID: runners[s.Runner], Name: s.UUID, Runner: s.Runner, Conclusion: c})
				}
				return ended, open
			})
		},
		ready: func() int { return IdleBitbucket(sim) },
		names: func() ([]string, error) {
			var names []string
			for _, r := range sim.Runners() {
				names = append(names, strings.TrimPrefix(r.Name, "e2e-"+f.Repo+"."))
			}
			return names, nil
		},
	}
}

// NeedAtlassianRunnerImage builds the stand-in runner as an image tagged
// with Atlassian's runner image's name (bitbucket.RunnerImage), whose
// entrypoint (bitbucket.DefaultAgentPath, as in Atlassian's image) starts
// the runner with no arguments, as CML's `docker container run` and
// Atlassian's instructions start theirs; so a machine that runs that
// image by name runs the stand-in, with no registry. The tag is removed
// when the test ends.
func NeedAtlassianRunnerImage(t testing.TB) {
	t.Helper()
	base := bbStandIn.image(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	entry := "#!/bin/sh\n# As Atlassian's entrypoint: the runner, from its environment.\nexec /bin/" + bbStandIn.name + "\n"
	_, err := peers.DeriveImage(ctx, DockerCli, base, bitbucket.RunnerImage,
		"ENTRYPOINT [\""+bitbucket.DefaultAgentPath+"\"]\nCMD []\n",
		peers.ImageFile{Path: strings.TrimPrefix(bitbucket.DefaultAgentPath, "/"), Data: []byte(entry), Mode: 0o755})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = DockerCli.ImageRemove(context.Background(), bitbucket.RunnerImage, client.ImageRemoveOptions{})
	})
}
