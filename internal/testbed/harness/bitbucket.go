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
	// Bitbucket's runner checks for its step every 30 s; at that pace
	// each wave of a test's steps would wait up to 30 s for nothing, so
	// the tests' runners check every second unless a test asks for the
	// real pace (TestBitbucketDefaultCheck does).
	if opt.Sim.RunnerCheck == 0 {
		opt.Sim.RunnerCheck = time.Second
	}
	// A quarter of the runner's default setup: harsher on the manager,
	// which must disable a runner before its step ends.
	if opt.Sim.StepSetup == 0 {
		opt.Sim.StepSetup = 500 * time.Millisecond
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
// while it ran a step (but the killed ones the test killed), none that
// fetched a second step, and none given one unless a manager crashed.
func checkBitbucketLeftNothing(t testing.TB, sim *bbsim.Server, killed int, crashed bool) {
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
		// A runner whose step ended while no manager was up to disable it
		// is given the next step (Bitbucket assigns on its side), but
		// stops before it fetches it: one run, two given.
		if r.Ran > 1 || r.Steps > 1 && !crashed {
			t.Errorf("runner %s was given %d steps and fetched %d", r.Name, r.Steps, r.Ran)
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
			lost := 0
			defer func() {
				if lost > 0 {
					f.T.Logf("%d steps given to a runner as it stopped (a manager down when their runner's step ended) failed unrun and ran again in their pipeline's re-run", lost)
				}
			}()
			return waitEnded(f.T, n, timeout, func() (ended []EndedJob, open []string) {
				runners := map[string]int64{} // a number per runner uuid
				steps := sim.Steps()
				last := map[string]int64{} // the latest pipeline of each commit
				for _, s := range steps {
					last[s.Commit] = max(last[s.Commit], s.Build)
				}
				lost = 0
				for _, s := range steps {
					if s.Result == "ERROR" && s.Started.IsZero() && last[s.Commit] > s.Build {
						// Bitbucket gave the step to an enabled runner the
						// moment its step ended, with no manager up to have
						// disabled it: the runner stopped, the step failed
						// unrun, and its pipeline was run again (Lost).
						lost++
						continue
					}
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

// BBHostileScript is a step that reads everything its runner can read:
// it finds its runner's OAuth client in the processes' environments, takes
// an access token with it, asks five times over five seconds for a step
// for its runner, and tries the token on the manager's calls (create a
// runner, read the pipelines of repo). It prints what each answered, as
// "hostile: ..." lines, in the step's log.
func BBHostileScript(repo string) string {
	return `envs=$(for p in /proc/[0-9]*; do tr '\0' '\n' < $p/environ; echo; done 2>/dev/null)
pick() { echo "$envs" | sed -n "s/^$1=//p" | sort -u | head -n 1; }
api=$BITBUCKET_RUNNER_API_URL id=$(pick OAUTH_CLIENT_ID) secret=$(pick OAUTH_CLIENT_SECRET) uuid=$(pick RUNNER_UUID)
tok=$(wget -q -O - --post-data "grant_type=client_credentials&client_id=$id&client_secret=$secret" "$api/oauth/token" | sed -n 's/.*"access_token":"\([^"]*\)".*/\1/p')
echo "hostile: runner $uuid, token ${tok:+granted}"
status() { grep -o 'HTTP/1.[01] [0-9]*' | tail -n 1; }
for i in 1 2 3 4 5; do
  st=$(wget -S -O /tmp/hostile-step --header "Authorization: Bearer $tok" "$api/runner-api/runners/$uuid/step" 2>&1 | status)
  echo "hostile: step request $i: $st step=$(sed -n 's/.*"uuid":"\([^"]*\)".*/\1/p' /tmp/hostile-step 2>/dev/null)"
  rm -f /tmp/hostile-step
  sleep 1
done
st=$(wget -S -O /dev/null --header "Authorization: Bearer $tok" --header 'Content-Type: application/json' --post-data '{"name":"stolen","labels":[]}' "$api/internal/repositories/acme/` + repo + `/pipelines-config/runners" 2>&1 | status)
echo "hostile: create runner: $st"
st=$(wget -S -O /dev/null --header "Authorization: Bearer $tok" "$api/2.0/repositories/acme/` + repo + `/pipelines" 2>&1 | status)
echo "hostile: read pipelines: $st"`
}
