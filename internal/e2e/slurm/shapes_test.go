package slurm

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// jobsOn is a workflow of one job per runs-on, each sleeping long enough
// for its runner's Slurm job to be read while it runs.
func jobsOn(runsOn map[string]string) string {
	var b strings.Builder
	b.WriteString("name: ci\non: [push]\njobs:\n")
	for _, name := range slices.Sorted(maps.Keys(runsOn)) {
		fmt.Fprintf(&b, "  %s:\n    runs-on: %s\n    steps:\n      - run: |\n          echo job=%s\n          sleep 15\n", name, runsOn[name], name)
	}
	return b.String()
}

// A dynamic pool that lets its jobs choose partition gpu or short and a
// time of at most 20 minutes: a pool listing a partition the cluster lacks
// is refused at start; then a job asking [partition=short, time=10m] runs
// as a Slurm job in partition short whose --time is 12 minutes (30 s of
// idle_timeout, the job's 10 and a minute to end in), a job asking
// nothing runs in the pool's partition, and one asking a partition the
// pool does not list starts nothing, with the reason in `runfleet status`.
func TestSlurmJobChoosesPartitionAndTime(t *testing.T) {
	beside(t)
	harness.NeedSlurm(t)
	const label = "slurmdyn"
	f := harness.NewFleet(t, label, harness.FleetOptions{Size: 0, Max: 3, Slurm: mem,
		Extra: "    job_timeout: 1h\n    idle_timeout: 30s\n    dynamic:\n      partition: [gpu, nosuch]\n      time: 20m\n"})
	f.Start()
	harness.Eventually(t, 30*time.Second, "the manager refuses to start", f.Exited)
	log, _ := os.ReadFile(f.LogPath)
	if !strings.Contains(string(log), "dynamic.partition: partition nosuch") {
		t.Errorf("the refusal does not name the partition the cluster lacks:\n%s", log)
	}
	t.Logf("refused: %s", harness.LogLines(f.LogPath, "nosuch"))
	shorten(t, f, "partition: [gpu, nosuch]", "partition: [gpu, short]")
	f.Start()
	f.Push(jobsOn(map[string]string{
		"short": "[" + label + ", partition=short, time=10m]",
		"plain": "[" + label + "]",
		"bad":   "[" + label + ", partition=scavenger]",
	}))
	// Runner names are reused once a runner is gone: each Slurm job seen
	// running, by id, with its runner, start, partition and time limit.
	type seenJob struct {
		runner, got string
		start       time.Time
	}
	seen := map[string]seenJob{}
	harness.Eventually(t, 3*time.Minute, "the short and plain jobs to complete", func() bool {
		for _, j := range f.SlurmJobs() {
			if _, ok := seen[j.ID]; !ok && j.State == "RUNNING" {
				if got := harness.SlurmJob(t, j.ID, "%P %l"); got != "" {
					seen[j.ID] = seenJob{runner: j.Name, got: got, start: j.Start}
				}
			}
		}
		done := 0
		for _, j := range f.Jobs() {
			if j.Status == "completed" {
				done++
			}
		}
		return done == 2
	})
	for _, j := range f.Jobs() {
		switch {
		case j.Name == "bad" && j.Status == "completed":
			t.Error("the job asking partition=scavenger ran")
		case j.Name != "bad" && j.Conclusion != "success":
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	want := map[string]string{"short": "short 12:00", "plain": "gpu 4:00:00"}
	for _, j := range f.Jobs() {
		w, ok := want[j.Name]
		if !ok {
			continue
		}
		// The runner's Slurm job: the last of its name to start before
		// the job did.
		var on seenJob
		for _, sj := range seen {
			if sj.runner == j.RunnerName && !sj.start.After(j.StartedAt) && sj.start.After(on.start) {
				on = sj
			}
		}
		if on.got != w {
			t.Errorf("job %s ran on %s, whose Slurm job was %q, want %q (all seen: %v)", j.Name, j.RunnerName, on.got, w, seen)
		}
		t.Logf("job %s on %s: partition and time limit %s", j.Name, j.RunnerName, on.got)
	}
	const why = "partition=scavenger: the pool allows partition=gpu|short"
	harness.Eventually(t, 30*time.Second, "the refusal in `runfleet status`", func() bool {
		doc := f.Status()
		return len(doc.Pools) == 1 && len(doc.Pools[0].Refused) == 1 && strings.Contains(doc.Pools[0].Refused[0], why)
	})
	t.Logf("runfleet status says: %s", strings.Join(f.Status().Pools[0].Refused, "; "))
	f.StopLeavesNothing()
}

// A dynamic GPU pool that lets jobs ask for gpu=h100, which no node of
// the cluster has (its two GPUs are untyped gres): sbatch refuses that
// job's runner ("Requested node configuration is not available"), and
// `runfleet status` says so for jobs asking gpu=h100; the pool is not
// halted, and jobs pushed after the refusal, one asking gpus=1 and one
// asking nothing, run and pass while the h100 job waits in the queue.
func TestSlurmShapeOnNoNodeHoldsOnlyItself(t *testing.T) {
	harness.NeedSlurm(t)
	const label = "slurmnonode"
	f := harness.NewFleet(t, label, harness.FleetOptions{Size: 0, Max: 2, Slurm: mem,
		Extra: "    gpus_per_runner: 1\n    dynamic:\n      gpus: [1]\n      gpu: [h100]\n"})
	f.Start()
	f.Push(jobsOn(map[string]string{"h100": "[" + label + ", gpu=h100]"}))
	var why string
	harness.Eventually(t, 2*time.Minute, "the gpu=h100 shape refused in `runfleet status`", func() bool {
		for _, r := range f.Status().Pools[0].Refused {
			if strings.Contains(r, "jobs asking gpu=h100 get no runner") {
				why = r
				return true
			}
		}
		return false
	})
	t.Logf("runfleet status says: %s", why)
	if b := f.Status().Pools[0].Backoff; b != nil && b.Halted {
		t.Fatalf("the pool is halted for one shape: %+v", b)
	}
	f.Push(jobsOn(map[string]string{"one": "[" + label + ", gpus=1]", "plain": "[" + label + "]"}))
	harness.Eventually(t, 4*time.Minute, "the gpus=1 and plain jobs to pass", func() bool {
		passed := 0
		for _, j := range f.Jobs() {
			if j.Name != "h100" && j.Conclusion == "success" {
				passed++
			}
		}
		return passed == 2
	})
	for _, j := range f.Jobs() {
		if j.Name == "h100" && j.Status == "completed" {
			t.Errorf("the gpu=h100 job ran: %+v", j)
		}
	}
	f.StopLeavesNothing()
}
