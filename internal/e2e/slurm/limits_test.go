package slurm

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/provider/slurm"
)

// A pool whose one job cannot fit its partition's MaxTime (Gitea's 3 h
// limit on partition short, MaxTime 30 minutes, EnforcePartLimits=ALL) is
// refused at start, naming the partition and both figures, and submits
// nothing; with a job_timeout that fits, its runner's --time is the
// partition's MaxTime, the idle life shortened to leave room for a job.
// The same holds for a QOS's MaxWall.
func TestSlurmTimeMustFit(t *testing.T) {
	beside(t)
	harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmfit", harness.FleetOptions{Size: 1, Slurm: mem + "      partition: short\n"})
	f.Start()
	harness.Eventually(t, 30*time.Second, "the manager refuses to start", f.Exited)
	log, _ := os.ReadFile(f.LogPath)
	for _, want := range []string{"job_timeout", "at least 3h11m0s", "a job of 3h0m0s", "partition short's MaxTime 30m0s"} {
		if !strings.Contains(string(log), want) {
			t.Errorf("the refusal lacks %q:\n%s", want, log)
		}
	}
	if n := len(f.SlurmJobs()); n != 0 {
		t.Errorf("%d jobs submitted by a pool that was refused", n)
	}
	t.Logf("refused: %s", harness.LogLines(f.LogPath, "MaxTime"))

	shorten(t, f, "    bootstrap_timeout: 1m\n", "    bootstrap_timeout: 1m\n    job_timeout: 20m\n")
	f.Start()
	harness.Eventually(t, 2*time.Minute, "a runner idle", func() bool { return f.IdleOnline() == 1 })
	jobs := f.SlurmJobs()
	if len(jobs) != 1 {
		t.Fatalf("%d jobs, want 1", len(jobs))
	}
	if limit := harness.SlurmJob(t, jobs[0].ID, "%l"); limit != "30:00" {
		t.Errorf("the runner's job has time limit %q, want the partition's 30:00", limit)
	}
	if !f.LogHas("idle runners retire early") {
		t.Error("the manager did not say that the partition shortens the runners' idle life")
	}
	f.StopLeavesNothing()

	// The QOS's MaxWall (read with sacctmgr) bounds --time as the
	// partition's MaxTime does: a job of 20m cannot fit ciwall's 20
	// minutes; one of 10m can, and its runner's job runs (asking the
	// default partition's 4 hours, it would pend for ever:
	// QOSMaxWallDurationPerJobLimit).
	shorten(t, f, "      partition: short\n", "      qos: "+harness.WallQOS+"\n")
	f.Start()
	harness.Eventually(t, 30*time.Second, "the manager refuses to start", f.Exited)
	if want := "over QOS " + harness.WallQOS + "'s MaxWall 20m0s"; len(harness.LogLines(f.LogPath, want)) == 0 {
		t.Errorf("the refusal lacks %q:\n%s", want, harness.LogLines(f.LogPath, "job_timeout"))
	}
	shorten(t, f, "    job_timeout: 20m\n", "    job_timeout: 10m\n")
	f.Start()
	harness.Eventually(t, 2*time.Minute, "a runner idle in QOS "+harness.WallQOS, func() bool { return f.IdleOnline() == 1 })
	jobs = f.SlurmJobs()
	if len(jobs) != 1 {
		t.Fatalf("%d jobs, want 1", len(jobs))
	}
	if limit, qos := harness.SlurmJob(t, jobs[0].ID, "%l"), harness.SlurmJob(t, jobs[0].ID, "%q"); limit != "20:00" || qos != harness.WallQOS {
		t.Errorf("the runner's job has time limit %q in QOS %q, want the QOS's 20:00 in %s", limit, qos, harness.WallQOS)
	}
	f.StopLeavesNothing()
}

// A job taken late in its runner's life (max_lifetime 30 s, job_timeout
// 1m: --time 3 minutes) runs past the runner's max_lifetime and finishes:
// the runner's job has room for a whole job after its idle life.
func TestSlurmLateJobFinishes(t *testing.T) {
	s := harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmlate", harness.FleetOptions{Size: 1, Max: 2, Slurm: mem})
	shorten(t, f, "    bootstrap_timeout: 1m\n", "    bootstrap_timeout: 1m\n    max_lifetime: 30s\n    job_timeout: 1m\n")
	f.Start()
	harness.Eventually(t, 2*time.Minute, "a runner idle", func() bool { return f.IdleOnline() == 1 })
	var runner, id string
	var started time.Time
	for _, j := range f.SlurmJobs() {
		if j.State == "RUNNING" {
			runner, id, started = j.Name, j.ID, j.Start
		}
	}
	if id == "" {
		t.Fatal("no running runner job")
	}
	if limit := harness.SlurmJob(t, id, "%l"); limit != "3:00" {
		t.Errorf("the runner's job has time limit %q, want 3:00 (30s idle, a job of 1m, 1m to end in)", limit)
	}
	// Pushed 12 s before the runner's max lifetime: the job starts within
	// a few seconds, late in the runner's life.
	time.Sleep(time.Until(started.Add(18 * time.Second)))
	f.Push(harness.Matrix("slurmlate", 1, "sleep 45\necho done"))
	jobs := f.WaitJobs(1, 3*time.Minute)
	harness.CheckJobs(t, jobs)
	took := jobs[0].StartedAt.Sub(started)
	ended := jobs[0].CompletedAt.Sub(started)
	t.Logf("runner %s (Slurm job %s) took its job %s into its life and finished it %s in (max_lifetime 30s, --time 3m)",
		runner, id, took.Round(time.Second), ended.Round(time.Second))
	if jobs[0].RunnerName != runner {
		t.Fatalf("the job ran on %s, not on the runner started at %s (%s)", jobs[0].RunnerName, started, runner)
	}
	if ended < 30*time.Second {
		t.Errorf("the job ended %s into its runner's life: no test of a job past max_lifetime", ended)
	}
	harness.Eventually(t, time.Minute, "the runner's job ended", func() bool {
		for _, j := range s.Jobs(t) {
			if j.ID == id {
				return j.State != "RUNNING" && j.State != "COMPLETING"
			}
		}
		return true
	})
	for _, j := range s.Jobs(t) {
		if j.ID == id && j.State != "COMPLETED" {
			t.Errorf("the runner's job ended %s, not COMPLETED", j.State)
		}
	}
	f.StopLeavesNothing()
}

// attempts is a job's script that runs long the first time and passes at
// once when re-run: the first run leaves a mark on the node.
func attempts(t *testing.T, name string) string {
	mark := fmt.Sprintf("/tmp/runfleet-e2e-%s-%d", name, os.Getpid())
	t.Cleanup(func() { os.Remove(mark) })
	return fmt.Sprintf("if [ -e %[1]s ]; then echo re-run; exit 0; fi\ntouch %[1]s\nsleep 600\n", mark)
}

// A busy runner's job killed by Slurm at its time limit (TIMEOUT: an admin
// shortened it to a minute) is a runner lost: the notice comes with
// --signal's USR1 ahead of the kill, and the job is re-run once on
// another runner and passes.
func TestSlurmTimeoutReruns(t *testing.T) {
	beside(t)
	s := harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmtimeout", harness.FleetOptions{Size: 1, Max: 2, Slurm: mem})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("slurmtimeout", 1, attempts(t, "slurmtimeout")))
	victim, reg := busyJob(t, f)
	time.Sleep(3 * time.Second)
	shortened := time.Now()
	harness.Scontrol(t, "update", "JobId="+victim, "TimeLimit=1")
	harness.Eventually(t, 2*time.Minute, "the notice", func() bool { return f.LogHas("Slurm signalled the job's end") })
	noticed := time.Since(shortened)
	state := endState(t, s, victim, 3*time.Minute)
	ended := time.Since(shortened)
	checkRerun(t, f, reg)
	t.Logf("time limit cut to 1m: notice %s after, the job %s %s after, re-run and passed %s after",
		noticed.Round(100*time.Millisecond), state, ended.Round(100*time.Millisecond), time.Since(shortened).Round(100*time.Millisecond))
	if state != "TIMEOUT" {
		t.Errorf("the runner's job ended %s, not TIMEOUT", state)
	}
	f.StopLeavesNothing()
}

// A busy runner's job on a preemptible partition (scavenger:
// PreemptMode=CANCEL, GraceTime 20 s) preempted by a job of a higher
// PriorityTier: the notice comes with the preemption's signal (the TERM of
// its grace time, with --signal's USR1 where preempt_send_user_signal
// sends it), before the job ends, and the job is re-run once on another
// runner, which waits for the GPUs, and passes.
func TestSlurmPreemptedReruns(t *testing.T) {
	s := harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmpreempt", harness.FleetOptions{Size: 1, Max: 2,
		Slurm: mem + "      partition: scavenger\n      queue_wait: true\n", Extra: "    gpus_per_runner: 2\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("[slurmpreempt, gpus-2]", 1, attempts(t, "slurmpreempt")))
	victim, reg := busyJob(t, f)
	time.Sleep(3 * time.Second)
	urgent := harness.Sbatch(t, "--partition=urgent", "--gres=gpu:2", "--mem=10M", "--wrap=sleep 10")
	preempted := time.Now()
	harness.Eventually(t, 2*time.Minute, "the notice", func() bool { return f.LogHas("Slurm signalled the job's end") })
	noticed := time.Since(preempted)
	state := endState(t, s, victim, 2*time.Minute)
	ended := time.Since(preempted)
	checkRerun(t, f, reg)
	t.Logf("urgent job %s: notice %s after, the runner's job %s %s after (grace %s), re-run and passed %s after",
		urgent, noticed.Round(100*time.Millisecond), state, ended.Round(100*time.Millisecond), harness.PreemptGrace, time.Since(preempted).Round(100*time.Millisecond))
	// The scheduler preempts at its next pass over the urgent job: the
	// notice is the signal that comes then, not the state squeue shows
	// after the job ended.
	if noticed > ended {
		t.Errorf("the notice came %s after the urgent job, after the runner's job ended (%s)", noticed, ended)
	}
	if state != "PREEMPTED" && state != "CANCELLED" {
		t.Errorf("the runner's job ended %s, not PREEMPTED", state)
	}
	f.StopLeavesNothing()
}

// endState waits for a Slurm job to end and returns the state it ended in.
func endState(t *testing.T, s *harness.SlurmCluster, id string, timeout time.Duration) string {
	t.Helper()
	var state string
	harness.Eventually(t, timeout, "the runner's job ended", func() bool {
		for _, j := range s.Jobs(t) {
			if j.ID == id {
				state = j.State
			}
		}
		return state != "" && state != "RUNNING" && state != "COMPLETING"
	})
	return state
}

// busyJob waits for the fleet's one job to run and returns its runner's
// Slurm job and registration.
func busyJob(t *testing.T, f *harness.Fleet) (id string, reg int64) {
	t.Helper()
	f.WaitInProgress(1)
	var name string
	for _, r := range f.Status().Pools[0].Runners {
		if r.State == "busy" {
			reg, name = r.RunnerID, r.Name
		}
	}
	for _, j := range f.SlurmJobs() {
		if j.Name == name && j.State == "RUNNING" {
			id = j.ID
		}
	}
	if id == "" {
		t.Fatalf("no running Slurm job for busy runner %q", name)
	}
	return id, reg
}

// checkRerun: the job was reported lost and re-run once, on another
// runner, and passed.
func checkRerun(t *testing.T, f *harness.Fleet, lostReg int64) {
	t.Helper()
	harness.Eventually(t, 4*time.Minute, "the job re-run and passed on another runner", func() bool {
		jobs := f.Jobs()
		return len(jobs) == 1 && jobs[0].Status == "completed" && jobs[0].Conclusion == "success" && jobs[0].RunnerID != lostReg
	})
	if n := len(harness.LogLines(f.LogPath, "re-ran the failed jobs of a run whose runner was lost")); n != 1 {
		t.Errorf("the job was re-run %d times, want once", n)
	}
}

// With 50 foreign jobs in the queue (another user's, held), a read of the
// queue returns this manager's user's jobs only, and a pool in steady
// state reads it once a poll interval (5 s, the default), not once a pass
// (every 2 s): the calls and bytes of a read, and the calls a minute.
func TestSlurmReadsOnlyItsJobs(t *testing.T) {
	beside(t)
	harness.NeedSlurm(t)
	for i := range 50 {
		harness.Sbatch(t, "--hold", fmt.Sprintf("--job-name=foreign-%d", i), "--mem=1M", "--wrap=true")
	}
	top, _, status := harness.Listeners(t)
	f := harness.NewFleet(t, "slurmlight", harness.FleetOptions{Size: 2, Max: 2, Top: top, Slurm: mem + "      poll_interval: 5s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })

	all, err := exec.Command("squeue", "--json").Output()
	if err != nil {
		t.Fatal(err)
	}
	c := &slurm.CLI{User: harness.SlurmUser}
	jobs, err := c.Queue(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	calls, size := c.Calls(), c.Bytes()
	jobs, err = c.Queue(t.Context()) // as every read after the first
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range jobs {
		if j.User != harness.SlurmUser {
			t.Errorf("a read of the queue returned %s's job %s (%s)", j.User, j.ID, j.Name)
		}
	}
	if len(jobs) < 2 {
		t.Errorf("the read found %d jobs, want the fleet's 2 at least", len(jobs))
	}
	t.Logf("whole-cluster squeue --json: %d bytes; a read of the user's %d jobs: %d command(s), %d bytes the first time (squeue --json, whose filter 22.05 ignores), then %d command(s), %d bytes",
		len(all), len(jobs), calls, size, c.Calls()-calls, c.Bytes()-size)

	before := harness.MetricValue(t, status+"/metrics", "runfleet_provider_api_calls_total")
	time.Sleep(20 * time.Second)
	steady := harness.MetricValue(t, status+"/metrics", "runfleet_provider_api_calls_total") - before
	passes := 20 / 2
	t.Logf("steady state: %.0f Slurm commands in 20 s, %d passes (%.2f a pass)", steady, passes, steady/float64(passes))
	if steady > 7 {
		t.Errorf("%.0f Slurm commands in 20 s of steady state; want one read a poll interval (4, and a margin)", steady)
	}
	f.StopLeavesNothing()
}
