package docker

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestDockerGPUsOnePerRunner gives each of four runner containers its own
// GPU of an injected 4-GPU inventory: each container's device request
// holds exactly one distinct UUID, the engine sets the job's
// NVIDIA_VISIBLE_DEVICES to it, a replacement gets the GPU its
// predecessor freed, and a restarted manager adopts the assignment.
func TestDockerGPUsOnePerRunner(t *testing.T) {
	eng := harness.NeedGPUEngine(t)
	smi := harness.FakeNvidiaSMI(t)
	f := harness.NewGitHubFleet(t, "gpuone", harness.GitHubOptions{
		Size: -1, Docker: true, Engine: eng,
		Top:  "gpu:\n  nvidia_smi: " + smi + "\n",
		Pool: "    gpus_per_runner: 1\n",
	})
	sim := f.GH
	f.Start()
	// A runner's agent can be online before the engine lists its
	// container as running (it records the start after the process runs).
	var held map[string][]string
	harness.Eventually(t, time.Minute, "4 idle runners, one per GPU", func() bool {
		held = f.GpusOf()
		return harness.IdleGitHub(sim) == 4 && len(held) == 4
	})
	t.Logf("4 containers, device requests: %v", held)
	harness.SplitsFourGPUs(t, held, 4, 1)
	for _, r := range sim.Runners() {
		for _, l := range []string{"gpu", "gpu-h100", "gpus-1", "cuda-12.4", "gpuone"} {
			if !slices.Contains(r.Labels, l) {
				t.Errorf("runner %s has labels %v, lacking %s", r.Name, r.Labels, l)
			}
		}
	}

	// A job asks for the hardware by label and sees its own GPU.
	sim.Queue("acme/gpuone", ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "gpu-h100", "cuda-12.4"}, Script: `echo "visible=$NVIDIA_VISIBLE_DEVICES"; sleep 0.5`})
	harness.Eventually(t, time.Minute, "the job done", func() bool { done, _ := harness.Completed(sim); return done == 1 })
	job := sim.Jobs()[0]
	if job.Conclusion != "success" {
		t.Fatalf("job: %s\n%s", job.Conclusion, job.Output)
	}
	var used string
	for _, u := range harness.H100UUIDs {
		if strings.Contains(job.Output, "visible="+u+"\n") {
			used = u
		}
	}
	if used == "" {
		t.Fatalf("the job did not see one of the GPUs in NVIDIA_VISIBLE_DEVICES:\n%s", job.Output)
	}
	t.Logf("job ran with NVIDIA_VISIBLE_DEVICES=%s", used)

	// Its container ended; the replacement gets the freed GPU.
	var replacement string
	harness.Eventually(t, time.Minute, "a replacement holding the freed GPU", func() bool {
		if harness.IdleGitHub(sim) != 4 {
			return false
		}
		now := f.GpusOf()
		for id, devs := range now {
			if _, old := held[id]; !old && slices.Equal(devs, []string{used}) {
				replacement = id
			}
		}
		return replacement != "" && len(now) == 4
	})
	after := f.GpusOf()
	harness.Disjoint(t, after)
	t.Logf("replacement container %s holds the freed %s", replacement[:12], used)

	// A manager killed and restarted learns the assignment from the
	// containers' labels: it starts nothing on a GPU that is taken.
	f.Kill9()
	f.Start()
	time.Sleep(5 * time.Second) // two resync periods
	harness.Eventually(t, time.Minute, "4 idle runners after the restart", func() bool { return harness.IdleGitHub(sim) == 4 })
	if again := f.GpusOf(); fmt.Sprint(again) != fmt.Sprint(after) {
		t.Fatalf("after a restart: %v, before: %v", again, after)
	}

	st := exec.Command(harness.FleetBin, "status", "-c", f.Config)
	st.Env = append(append(os.Environ(), f.Env...), "E2E_GITHUB_TOKEN="+harness.GHToken)
	if out, err := st.CombinedOutput(); err != nil || strings.Count(string(out), "GPU-") != 4 {
		t.Errorf("runfleet status does not show the 4 runners' GPUs: %v\n%s", err, out)
	} else {
		t.Logf("runfleet status -c:\n%s", out)
	}

	gpus := exec.Command(harness.FleetBin, "gpus", "-c", f.Config)
	gpus.Env = append(append(os.Environ(), f.Env...), "E2E_GITHUB_TOKEN="+harness.GHToken)
	out, err := gpus.CombinedOutput()
	if err != nil {
		t.Fatalf("runfleet gpus: %v\n%s", err, out)
	}
	t.Logf("runfleet gpus -c:\n%s", out)
	for _, u := range harness.H100UUIDs {
		if !strings.Contains(string(out), u) {
			t.Errorf("runfleet gpus does not list %s", u)
		}
	}
	if n := strings.Count(string(out), "gpuone-"); n != 4 {
		t.Errorf("runfleet gpus shows %d holders, want 4", n)
	}
	f.StopLeavesNothing()
}

// TestDockerGPUsTwoPerRunner: with two GPUs per runner, the 4-GPU host
// runs two runners with disjoint pairs.
func TestDockerGPUsTwoPerRunner(t *testing.T) {
	eng := harness.NeedGPUEngine(t)
	f := harness.NewGitHubFleet(t, "gputwo", harness.GitHubOptions{
		Size: -1, Docker: true, Engine: eng,
		Top:  "gpu:\n  nvidia_smi: " + harness.FakeNvidiaSMI(t) + "\n",
		Pool: "    gpus_per_runner: 2\n",
	})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return harness.IdleGitHub(f.GH) == 2 })
	time.Sleep(3 * time.Second) // a third would show by now
	held := f.GpusOf()
	t.Logf("2 per runner: %v", held)
	harness.SplitsFourGPUs(t, held, 2, 2)
	for _, r := range f.GH.Runners() {
		if !slices.Contains(r.Labels, "gpus-2") {
			t.Errorf("runner %s has labels %v, lacking gpus-2", r.Name, r.Labels)
		}
	}
	f.StopLeavesNothing()
}
