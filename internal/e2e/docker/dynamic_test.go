package docker

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// jobsOn is a workflow of one job per runs-on, each printing the GPUs the
// engine gave its container and its memory limit.
func jobsOn(runsOn map[string]string) string {
	var b strings.Builder
	b.WriteString("name: ci\non: [push]\njobs:\n")
	for _, name := range slices.Sorted(maps.Keys(runsOn)) {
		fmt.Fprintf(&b, "  %s:\n    runs-on: %s\n    steps:\n      - run: |\n          echo \"job=%s visible=$NVIDIA_VISIBLE_DEVICES runner=$RUNFLEET_RUNNER\"\n          sleep 2\n", name, runsOn[name], name)
	}
	return b.String()
}

// dynamicFleet is a pool of the GPU engine whose jobs choose 1 or 2 GPUs
// and a memory limit of at most 1g, fed by webhooks and polls.
func dynamicFleet(t *testing.T, name string) (*harness.Fleet, string) {
	eng := harness.NeedGPUEngine(t)
	img := eng.GiteaRunnerImage(t)
	top, hooks, status := harness.Listeners(t)
	f := harness.NewFleet(t, name, harness.FleetOptions{
		Size: 0, Max: 4, Engine: eng,
		Top:    top + "gpu:\n  nvidia_smi: " + harness.FakeNvidiaSMI(t) + "\n",
		Forge:  "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 2s\n",
		Docker: "      image: " + img + "\n      pull: never\n      network: host\n",
		Extra:  "    gpus_per_runner: 1\n    hardware_labels: false\n    idle_timeout: 20s\n    dynamic:\n      gpus: [1, 2]\n      mem: 1g\n",
	})
	f.Hooks = hooks
	f.AddWebhook()
	return f, status
}

// TestDynamicJobsGetWhatTheyAsk: in one workflow on the real Gitea, a job
// asking gpus=1 and one asking gpus=2 get runners with one and two GPUs of
// their own (the engine's device requests, which the jobs see); a job
// asking gpus=4, more than the pool allows, starts nothing, and the log,
// `runfleet status` and the status page say why.
func TestDynamicJobsGetWhatTheyAsk(t *testing.T) {
	f, status := dynamicFleet(t, "gdyn")
	f.Start()
	f.Push(jobsOn(map[string]string{"one": "[gdyn, gpus=1]", "two": "[gdyn, gpus=2]", "big": "[gdyn, gpus=4]"}))
	var done []*sdk.ActionWorkflowJob
	harness.Eventually(t, 3*time.Minute, "the jobs asking 1 and 2 GPUs to complete", func() bool {
		done = nil
		for _, j := range f.Jobs() {
			if j.Status == "completed" {
				done = append(done, j)
			}
		}
		return len(done) == 2
	})
	seen := map[string]int{}
	re := regexp.MustCompile(`job=(\w+) visible=(GPU-\S+) runner=([a-z0-9-]+)`)
	for _, j := range done {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
		logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		m := re.FindStringSubmatch(string(logs))
		if m == nil {
			t.Fatalf("job %s printed no GPUs:\n%s", j.Name, logs)
		}
		seen[m[1]] = len(strings.Split(m[2], ","))
		t.Logf("job %s ran on %s with NVIDIA_VISIBLE_DEVICES=%s", m[1], m[3], m[2])
	}
	if seen["one"] != 1 || seen["two"] != 2 {
		t.Errorf("GPUs seen by the jobs: %v, want one: 1, two: 2", seen)
	}
	for _, j := range f.Jobs() {
		if j.Name == "big" && j.Status == "completed" {
			t.Errorf("the job asking gpus=4 ran")
		}
	}
	const why = "gpus=4: the pool allows gpus=1|2"
	harness.Eventually(t, 30*time.Second, "the refusal in the log", func() bool { return f.LogHas(why) })
	code, page := harness.Get(t, status+"/")
	if code != 200 || !strings.Contains(page, why) {
		t.Errorf("the status page (%d) does not say why gpus=4 gets no runner", code)
	}
	doc := f.Status()
	if len(doc.Pools[0].Refused) != 1 || !strings.Contains(doc.Pools[0].Refused[0], why) {
		t.Errorf("runfleet status -o json: refused %v", doc.Pools[0].Refused)
	}
	t.Logf("runfleet status says: %s", strings.Join(doc.Pools[0].Refused, "; "))
	for id, gpus := range f.GpusOf() {
		if len(gpus) > 2 {
			t.Errorf("container %s has %d GPUs", id, len(gpus))
		}
	}
	f.StopLeavesNothing()
}

// TestSubsetJobNeverTakesAnothersRunner: a job asking [gsub, gpus=1] and
// one asking [gsub, gpus=1, mem=1g] queue together, three times (the
// manager killed with -9 and restarted in the second); the first's labels
// are a subset of the second's runner's, so that runner waits until the
// first is taken: each job runs on a runner made for it, nothing is left.
func TestSubsetJobNeverTakesAnothersRunner(t *testing.T) {
	f, _ := dynamicFleet(t, "gsub")
	f.Start()
	for round := range 3 {
		// small comes first in the workflow, so it is the older job: a
		// runner that can take both is given it first.
		f.Push(jobsOn(map[string]string{"a_small": "[gsub, gpus=1]", "b_big": fmt.Sprintf("[gsub, gpus=1, mem=1g] # round %d", round)}))
		if round == 1 {
			// A manager killed with -9 mid-round and restarted adopts
			// the runners, each with the shape its registration says.
			harness.Eventually(t, time.Minute, "a job of round 1 in progress", func() bool {
				return harness.CountJobs(f, "in_progress") > 0
			})
			f.Kill9()
			f.Start()
		}
		jobs := f.WaitJobs(2*(round+1), 3*time.Minute)
		recs := f.JobRecords()
		for _, j := range jobs {
			if j.RunID != jobs[len(jobs)-1].RunID && round > 0 {
				continue
			}
			if j.Conclusion != "success" {
				t.Errorf("round %d: job %s %s", round, j.Name, j.Conclusion)
			}
			r, ok := harness.RecordOfRegistration(recs, j.RunnerID)
			if !ok {
				t.Fatalf("round %d: job %s's runner %d has no record", round, j.Name, j.RunnerID)
			}
			mem := slices.Contains(r.Labels, "mem=1g")
			if j.Name == "a_small" && mem || j.Name == "b_big" && !mem {
				t.Errorf("round %d: job %s ran on %s, made with labels %v", round, j.Name, r.Runner, r.Labels)
			}
			t.Logf("round %d: job %s ran on %s (labels %v, %d GPUs)", round, j.Name, r.Runner, r.Labels, len(r.GPUs))
		}
	}
	n := f.LogCount("a runner waits: a queued job with fewer labels could take it")
	if n == 0 {
		t.Error("no runner waited for the smaller job: the two queued together each round")
	}
	t.Logf("the bigger job's runner waited %d times for the smaller job to be taken", n)
	f.StopLeavesNothing()
}

// TestDynamicGitHub: the same choice on the GitHub simulator, whose
// runners carry GitHub's implicit labels: a job asking gpus=1 and one
// asking gpus=2 get one and two GPUs; gpus=4 is refused.
func TestDynamicGitHub(t *testing.T) {
	eng := harness.NeedGPUEngine(t)
	f := harness.NewGitHubFleet(t, "ghdyn", harness.GitHubOptions{
		Size: 0, Max: 4, Docker: true, Engine: eng,
		Top:  "gpu:\n  nvidia_smi: " + harness.FakeNvidiaSMI(t) + "\n",
		Pool: "    gpus_per_runner: 1\n    hardware_labels: false\n    dynamic:\n      gpus: [1, 2]\n",
	})
	f.Start()
	script := `echo "visible=$NVIDIA_VISIBLE_DEVICES"; sleep 0.5`
	f.GH.Queue("acme/ghdyn",
		ghsim.JobSpec{Name: "one", Labels: []string{"self-hosted", "ghdyn", "gpus=1"}, Script: script},
		ghsim.JobSpec{Name: "two", Labels: []string{"self-hosted", "ghdyn", "gpus=2"}, Script: script},
		ghsim.JobSpec{Name: "big", Labels: []string{"self-hosted", "ghdyn", "gpus=4"}, Script: script})
	harness.Eventually(t, 2*time.Minute, "the jobs asking 1 and 2 GPUs done", func() bool { done, _ := harness.Completed(f.GH); return done == 2 })
	for _, j := range f.GH.Jobs() {
		m := regexp.MustCompile(`visible=(GPU-\S+)`).FindStringSubmatch(j.Output)
		switch {
		case j.Name == "big" && j.Status != "queued":
			t.Errorf("the job asking gpus=4 is %s", j.Status)
		case j.Name == "big":
		case j.Conclusion != "success" || m == nil:
			t.Errorf("job %s: %s\n%s", j.Name, j.Conclusion, j.Output)
		case j.Name == "one" && len(strings.Split(m[1], ",")) != 1, j.Name == "two" && len(strings.Split(m[1], ",")) != 2:
			t.Errorf("job %s saw GPUs %s", j.Name, m[1])
		default:
			t.Logf("job %s ran on %s with NVIDIA_VISIBLE_DEVICES=%s", j.Name, j.RunnerName, m[1])
		}
	}
	harness.Eventually(t, 30*time.Second, "the refusal in the log", func() bool { return f.LogHas("gpus=4: the pool allows gpus=1|2") })
	f.StopLeavesNothing()
}
