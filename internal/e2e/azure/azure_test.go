package azure

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/azsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// managerCalls counts the REST calls the manager made (the agents' own
// are left out).
func managerCalls(sim *azsim.Server) (n int, by map[string]int) {
	by = map[string]int{}
	for _, c := range sim.Calls() {
		if !c.Agent {
			n++
			by[c.Method+" "+c.Route]++
		}
	}
	return n, by
}

// TestAzurePool runs 10 jobs through a pool of 2 agents, as host processes
// and as containers: each job on a fresh agent (its own key, deleted once
// its job is done), agent names within <pool>-1 … <pool>-N, the PAT in no
// job's environment, arguments, files or log, nor in any agent's reported
// environment or anything the manager wrote; steady-state calls per job
// are counted; after SIGTERM no agent, process or container is left.
func TestAzurePool(t *testing.T) {
	for _, mode := range []string{"process", "docker"} {
		t.Run(mode, func(t *testing.T) {
			name := "az" + mode[:4]
			f := harness.NewAzureFleet(t, name, harness.AzureOptions{Size: 2, Docker: mode == "docker", Forge: "    poll_interval: 5s\n"})
			sim := f.AZ
			f.Start()
			harness.Eventually(t, time.Minute, "2 idle agents online", func() bool { return harness.IdleAzure(sim) == 2 })
			before, _ := managerCalls(sim)
			start := time.Now()
			if _, err := sim.QueueRun(name, harness.AZJobs(10, harness.AZJobScript, name)...); err != nil {
				t.Fatal(err)
			}
			harness.Eventually(t, 2*time.Minute, "10 jobs done", func() bool { done, _ := harness.AZCompleted(sim); return done == 10 })
			took := time.Since(start)
			harness.Eventually(t, time.Minute, "the pool refilled", func() bool { return harness.IdleAzure(sim) == 2 && len(harness.AZRunners(sim)) == 2 })
			after, by := managerCalls(sim)
			t.Logf("%s: 10 jobs in %s; Azure DevOps calls per job in steady state: %.2f (%d calls; all the manager's calls by route: %v)",
				mode, took.Round(time.Millisecond), float64(after-before)/10, after-before, by)
			agents := map[int]bool{}
			for _, r := range sim.Requests() {
				if r.Result != "succeeded" {
					t.Errorf("job %s: %s on %s\n%s", r.Name, r.Result, r.AgentName, harness.TailString(string(r.Log), 2000))
				}
				agents[r.AgentID] = true
			}
			if len(agents) != 10 {
				t.Errorf("10 jobs ran on %d distinct agents, want 10", len(agents))
			}
			for _, a := range harness.AZAdded(sim) {
				if a.Jobs > 1 {
					t.Errorf("agent %d (%s) took %d jobs", a.ID, a.Name, a.Jobs)
				}
			}
			harness.AgentNamesWithin(t, sim, name, 2)
			harness.CheckAzureSecrets(t, sim)
			f.CheckNoSecretOnDisk()
			f.StopLeavesNothing()
		})
	}
}

// TestAzureSecondJobNeverTaken: agents whose run --once goes on listening
// after their job (azure-pipelines-agent issue 2332) still take one job
// each: the manager disables each agent as it takes its job and deletes
// it as soon as the job ends.
func TestAzureSecondJobNeverTaken(t *testing.T) {
	f := harness.NewAzureFleet(t, "azonce", harness.AzureOptions{Size: 2, Max: 2, Forge: "    poll_interval: 2s\n",
		Env: "      AZP_STANDIN_IGNORE_ONCE: \"1\"\n"})
	sim := f.AZ
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle agents online", func() bool { return harness.IdleAzure(sim) == 2 })
	// Each job runs longer than a pass of the manager (resync 2s), as
	// every real job does (the agent fetches its tasks, checks out):
	// the cordon lands while it runs.
	if _, err := sim.QueueRun("azonce", harness.AZJobs(8, "sleep 5", "azonce")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 2*time.Minute, "8 jobs done", func() bool { done, _ := harness.AZCompleted(sim); return done == 8 })
	most := 0
	for _, a := range harness.AZAdded(sim) {
		most = max(most, a.Jobs)
		if a.Jobs > 1 {
			t.Errorf("agent %d (%s) took %d jobs", a.ID, a.Name, a.Jobs)
		}
	}
	_, ok := harness.AZCompleted(sim)
	if ok != 8 {
		t.Errorf("%d of 8 jobs succeeded", ok)
	}
	t.Logf("8 jobs on agents that ignore --once: %d agents added in all, at most %d job per agent; %d succeeded", len(harness.AZAdded(sim)), most, ok)
	f.StopLeavesNothing()
}

// TestAzureCrashAdopts kills the manager with -9 while 2 jobs run and
// starts it again: both jobs finish once, and after the drain no agent,
// process or record is left.
func TestAzureCrashAdopts(t *testing.T) {
	f := harness.NewAzureFleet(t, "azcrash", harness.AzureOptions{Size: 2, Max: 3, Forge: "    poll_interval: 2s\n"})
	sim := f.AZ
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle agents online", func() bool { return harness.IdleAzure(sim) == 2 })
	if _, err := sim.QueueRun("azcrash", harness.AZJobs(2, "echo started; sleep 10; echo finished", "azcrash")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, time.Minute, "2 jobs running", func() bool { return harness.AZRunning(sim) == 2 })
	f.Kill9()
	time.Sleep(2 * time.Second)
	f.Start()
	harness.Eventually(t, 2*time.Minute, "both jobs done", func() bool { done, _ := harness.AZCompleted(sim); return done == 2 })
	reqs := sim.Requests()
	for _, r := range reqs {
		if r.Result != "succeeded" || !strings.Contains(string(r.Log), "finished") {
			t.Errorf("job %d: %s\n%s", r.ID, r.Result, harness.TailString(string(r.Log), 1500))
		}
	}
	if len(reqs) != 2 {
		t.Errorf("%d job requests, want the 2 queued", len(reqs))
	}
	harness.Eventually(t, time.Minute, "the pool back at 2 idle agents", func() bool { return harness.IdleAzure(sim) == 2 && len(harness.AZRunners(sim)) == 2 })
	t.Logf("both jobs succeeded across the crash; %d agents added in all, %d now", len(harness.AZAdded(sim)), len(harness.AZRunners(sim)))
	f.StopLeavesNothing()
}

// TestAzureScaleFromZero scales a pool of size 0 (max 2) on the pool's job
// requests: three jobs run, and the pool shrinks back to zero. The strict
// azsim fails at once, as Azure DevOps does, a job that no agent
// registered in the pool meets: the pool's placeholder agent, registered
// with its capabilities and never run, is what keeps its jobs queued
// (before it, the pool never saw one). A job whose demands the pool does
// not meet fails at the service and starts nothing.
func TestAzureScaleFromZero(t *testing.T) {
	top, _, status := harness.Listeners(t)
	f := harness.NewAzureFleet(t, "azzero", harness.AzureOptions{Size: 0, Max: 2, Top: top,
		Labels: []string{"azzero", "gpu=a100"}, Forge: "    poll_interval: 2s\n", Pool: "    idle_timeout: 5s\n"})
	sim := f.AZ
	f.Start()
	harness.Eventually(t, 30*time.Second, "the server", func() bool { code, _ := harness.Get(t, status+"/healthz"); return code == 200 })
	harness.Eventually(t, 30*time.Second, "the pool's placeholder", func() bool { return len(sim.Agents()) == 1 })
	if a := sim.Agents()[0]; a.Name != "azzero-placeholder" || a.Enabled || a.UserCaps["gpu"] != "a100" {
		t.Fatalf("placeholder %+v, want azzero-placeholder, disabled, with the pool's capabilities", a)
	}
	h100, err := sim.QueueRun("azzero", azsim.JobSpec{Name: "needs an h100", Demands: []string{"gpu -equals h100"}, Script: "true"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // a poll
	if n := len(sim.AllAgents()); n != 1 {
		t.Fatalf("%d agents for a job no pool meets, want the placeholder alone", n)
	}
	for _, r := range sim.Requests() {
		if r.ID == h100[0] && (r.Result != "failed" || !strings.Contains(string(r.Log), "No agent found")) {
			t.Fatalf("the h100 job: %q %q, want failed by the service", r.Result, r.Log)
		}
	}
	start := time.Now()
	if _, err := sim.QueueRun("azzero", harness.AZJobs(3, "sleep 1", "gpu -equals A100", "azzero")...); err != nil {
		t.Fatal(err)
	}
	most := 0
	harness.Eventually(t, 2*time.Minute, "3 jobs done", func() bool {
		most = max(most, len(harness.AZRunners(sim)))
		done, _ := harness.AZCompleted(sim)
		return done == 4 // and the h100 job that failed
	})
	_, ok := harness.AZCompleted(sim)
	t.Logf("3 jobs from zero: %d succeeded in %s, at most %d agents at once", ok, time.Since(start).Round(time.Millisecond), most)
	if ok != 3 || most > 2 {
		t.Errorf("%d of 3 succeeded, %d agents at once (max 2)", ok, most)
	}
	harness.Eventually(t, 45*time.Second, "no agent after idle_timeout but the placeholder", func() bool {
		return len(sim.Agents()) == 1 && sim.Agents()[0].Name == "azzero-placeholder"
	})
	f.StopLeavesNothing()
}

// TestChaosAzure is the chaos test for a pool of Azure Pipelines agents: a
// manager killed between adding an agent and starting it, or while agents
// are disabled and deleted after their jobs, leaves nothing the next one
// does not adopt or delete.
func TestChaosAzure(t *testing.T) {
	f := harness.NewAzureFleet(t, "chaosaz", harness.AzureOptions{Size: 4, Max: 8,
		Forge: "    poll_interval: 2s\n", Pool: "    idle_timeout: 3s\n    max_lifetime: 10s\n"})
	harness.RunChaos(t, f)
}

// TestRunnerAzureSingle: `runfleet runner --driver azure-pipelines
// --single`, with the PAT in REPO_TOKEN and the pool in the project URL,
// runs one job and leaves no agent registered, not even a placeholder.
// The job is queued once the runner's agent is registered: Azure DevOps
// fails at once a job that no registered agent meets, and a one-shot
// runner keeps no placeholder.
func TestRunnerAzureSingle(t *testing.T) {
	run := harness.NeedAzureAgent(t)
	sim := azsim.New(azsim.Options{Token: harness.AZToken, Pools: []string{"ml"}})
	t.Cleanup(sim.Close)
	state := t.TempDir()
	cmd, out := harness.StartRunner(t, []string{"REPO_TOKEN=" + harness.AZToken, "AGENT_ALLOW_RUNASROOT=1", "XDG_STATE_HOME=" + state},
		"runner", "--driver", "azure-pipelines", "--repo", sim.URL+"/models?pool=ml", "--single", "--labels", "cml", "--agent", run, "--log", "debug")
	t.Cleanup(func() {
		if t.Failed() {
			logs, _ := filepath.Glob(filepath.Join(state, "*", "*", "logs", "*.log"))
			for _, l := range logs {
				b, _ := os.ReadFile(l)
				t.Logf("agent log %s:\n%s", filepath.Base(l), b)
			}
		}
	})
	harness.Eventually(t, time.Minute, "the runner's agent registered", func() bool { return len(sim.Agents()) == 1 })
	if _, err := sim.QueueRun("ml", azsim.JobSpec{Name: "train", Demands: []string{"cml"}, Script: "echo trained on $(hostname)"}); err != nil {
		t.Fatal(err)
	}
	took := harness.WaitExit(t, cmd, 2*time.Minute)
	reqs := sim.Requests()
	if len(reqs) != 1 || reqs[0].Result != "succeeded" {
		t.Fatalf("requests %+v", reqs)
	}
	if a := sim.Agents(); len(a) != 0 {
		t.Errorf("%d agents left: %+v", len(a), a)
	}
	if strings.Contains(out.String(), harness.AZToken) {
		t.Error("runfleet runner's output shows the PAT")
	}
	t.Logf("one job (%s) on agent %q, exited after %s, no agent left", reqs[0].Result, reqs[0].AgentName, took.Round(time.Millisecond))
}

// TestAzureSeedSetup is the setup runfleet descends from, on the GPU test
// engine: a pool of agent containers, one GPU each, sized by the host's
// GPUs, fixed names, the image chosen by the driver's CUDA version, a
// read-only dataset, a high OOM score.
func TestAzureSeedSetup(t *testing.T) {
	eng := harness.NeedGPUEngine(t)
	smi := harness.FakeNvidiaSMI(t)
	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "labels.txt"), []byte("cat\ndog\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	images := harness.AzureCUDAImages(t, eng, "11.8", "12.4", "13.0")
	list := fmt.Sprintf("      images:\n        - {image: %s, min_cuda: \"11.8\"}\n        - {image: %s, min_cuda: \"12.4\"}\n        - {image: %s, min_cuda: \"13.0\"}\n",
		images[0], images[1], images[2])
	f := harness.NewAzureFleet(t, "seed", harness.AzureOptions{Size: -1, Engine: eng, Images: list,
		Top: "gpu:\n  nvidia_smi: " + smi + "\n", Pool: "    gpus_per_runner: 1\n", DockerExtra: "      volumes: [\"" + data + ":/data\"]\n"})
	cfg, _ := os.ReadFile(f.Config)
	t.Logf("the config:\n%s", cfg)
	sim := f.AZ
	f.Start()
	var held map[string][]string
	harness.Eventually(t, time.Minute, "4 idle agents, one per GPU", func() bool {
		held = f.GpusOf()
		return harness.IdleAzure(sim) == 4 && len(held) == 4
	})
	harness.SplitsFourGPUs(t, held, 4, 1)
	script := `echo "visible=$NVIDIA_VISIBLE_DEVICES"; echo "cuda=$(cat /etc/cuda-version)"; echo "oom=$(cat /proc/self/oom_score_adj)"
cat /data/labels.txt
if touch /data/written 2>/dev/null; then echo "dataset writable"; exit 1; fi
echo "dataset read-only"`
	if _, err := sim.QueueRun("seed", harness.AZJobs(4, script, "seed", "gpu", "gpu-h100", "cuda-12.4")...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 2*time.Minute, "4 jobs done", func() bool { done, _ := harness.AZCompleted(sim); return done == 4 })
	seen := map[string]bool{}
	for _, r := range sim.Requests() {
		log := string(r.Log)
		if r.Result != "succeeded" {
			t.Errorf("job %s: %s\n%s", r.Name, r.Result, log)
			continue
		}
		for _, want := range []string{"cuda=12.4", "oom=1000", "dog", "dataset read-only"} {
			if !strings.Contains(log, want) {
				t.Errorf("job %s's log lacks %q:\n%s", r.Name, want, log)
			}
		}
		for _, u := range harness.H100UUIDs {
			if strings.Contains(log, "visible="+u+"\n") {
				if seen[u] {
					t.Errorf("two jobs saw %s", u)
				}
				seen[u] = true
			}
		}
	}
	if len(seen) != 4 {
		t.Errorf("the 4 jobs saw %d distinct GPUs, want 4", len(seen))
	}
	if _, err := os.Stat(filepath.Join(data, "written")); err == nil {
		t.Error("a job wrote into the dataset")
	}
	harness.AgentNamesWithin(t, sim, "seed", 4)
	harness.Eventually(t, time.Minute, "4 idle agents again", func() bool { return harness.IdleAzure(sim) == 4 })
	t.Logf("4 jobs, each on its own GPU (%d distinct), the CUDA 12.4 image, OOM score 1000, the dataset read-only; %d agents added in all", len(seen), len(harness.AZAdded(sim)))
	f.StopLeavesNothing()
}
