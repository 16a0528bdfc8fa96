package slurm

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/record"
)

// A GPU pool on the 2-GPU node: 2 warm runners, at most 3, one GPU each.
// Six jobs print the GPUs they got. Slurm never gives one GPU to two
// running jobs, the third runner waits pending (queue_wait, past its
// bootstrap timeout) with Slurm's reason shown, every job succeeds, and
// nothing is left: no job, directory, credential or registration; neither
// the token nor any runner's credential in what Slurm shows or keeps.
func TestSlurmGPUPool(t *testing.T) {
	s := harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmgpu", harness.FleetOptions{Size: 2, Max: 3,
		Slurm: "      queue_wait: true\n      memory: 200M\n",
		Extra: "    gpus_per_runner: 1\n"})
	shorten(t, f, "bootstrap_timeout: 1m", "bootstrap_timeout: 15s")
	secrets := f.WatchSlurmSecrets()
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	checkUnprivileged(t, f, s)

	// Samples of the queue while the jobs run: GPUs held by running jobs,
	// and the pending job's reason.
	stop, sampled := make(chan struct{}), make(chan []string)
	go func() {
		var clash []string
		seenPending := ""
		for {
			held := map[string]string{}
			for _, j := range f.SlurmJobs() {
				switch j.State {
				case "RUNNING":
					for _, g := range j.GPUs {
						if other, dup := held[g]; dup {
							clash = append(clash, fmt.Sprintf("GPU %s held by jobs %s and %s", g, other, j.ID))
						}
						held[g] = j.ID
					}
				case "PENDING":
					// "None" until the scheduler first looked at it.
					if j.Reason == "Resources" || seenPending == "" && j.Reason != "None" {
						seenPending = j.Reason
					}
				}
			}
			select {
			case <-stop:
				sampled <- append(clash, "pending reason: "+seenPending)
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	f.Push(harness.Matrix("[slurmgpu, gpus-1]", 6, `echo "gpus=[$CUDA_VISIBLE_DEVICES] job=$SLURM_JOB_ID node=$SLURMD_NODENAME"
sleep 20
`+harness.RecordJob))
	// The third runner pends for a GPU past its bootstrap timeout, its
	// reason in status.
	shown := ""
	harness.Eventually(t, 2*time.Minute, "a runner pending with Slurm's reason in status", func() bool {
		for _, r := range f.Status().Pools[0].Runners {
			if strings.Contains(r.Reason, "pending: Resources") {
				shown = r.Name + ": " + r.Reason
				return true
			}
		}
		return false
	})
	t.Logf("status shows %s", shown)
	jobs := f.WaitJobs(6, 5*time.Minute)
	close(stop)
	result := <-sampled
	harness.CheckJobs(t, jobs)
	for _, c := range result[:len(result)-1] {
		t.Error(c)
	}
	t.Log(result[len(result)-1])
	if !strings.HasSuffix(result[len(result)-1], "Resources") {
		t.Errorf("no pending job waiting for Resources was seen (%s)", result[len(result)-1])
	}
	gpuRE := regexp.MustCompile(`gpus=\[([0-9,]*)\] job=([0-9]+)`)
	var got []string
	for _, j := range jobs {
		logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		m := gpuRE.FindStringSubmatch(string(logs))
		if m == nil || (m[1] != "0" && m[1] != "1") {
			t.Errorf("job %s did not get one GPU of its own:\n%s", j.Name, logs)
			continue
		}
		got = append(got, "slurm job "+m[2]+" GPU "+m[1])
	}
	t.Logf("jobs printed: %s", strings.Join(got, ", "))
	// Each job's record names its node (written on the node), and the
	// history the node and the GPU Slurm gave it.
	f.CheckRecords(jobs, func(printed, kept record.Record) {
		if printed.Machine.Node != harness.Slurm.Node || printed.Provider != "slurm" || kept.Machine.Node != harness.Slurm.Node ||
			kept.Machine.ID == "" || len(kept.GPUs) != 1 || !strings.HasPrefix(kept.GPUs[0].ID, harness.Slurm.Node+":") {
			t.Errorf("Slurm job records: the job's %+v, the history's %+v %+v", printed.Machine, kept.Machine, kept.GPUs)
		}
		// The node's system, as slurmd registered it.
		if s := kept.System; s == nil || s.Kernel == "" || s.CPUs == 0 || s.MemoryMiB == 0 || s.Arch == "" {
			t.Errorf("the history's record of %s keeps no system of node %s: %+v", kept.Runner, kept.Machine.Node, s)
		}
	})
	if n := len(harness.LogLines(f.LogPath, "retiring", "not online after")); n > 0 {
		t.Errorf("a pending runner was retired by the bootstrap timeout despite queue_wait")
	}
	f.StopLeavesNothing()
	secrets.Check(f)
	checkOutputKept(t, f)
}

// checkUnprivileged: the manager runs as the cluster's ordinary user, and
// so do its jobs.
func checkUnprivileged(t *testing.T, f *harness.Fleet, s *harness.SlurmCluster) {
	t.Helper()
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", f.Cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	uid := regexp.MustCompile(`(?m)^Uid:\s+(\d+)`).FindSubmatch(st)
	if uid == nil || string(uid[1]) == "0" {
		t.Fatalf("the manager runs as uid %s, not as %s", uid, s.User)
	}
	for _, j := range f.SlurmJobs() {
		if j.User != s.User {
			t.Errorf("job %s is %s's, not %s's", j.ID, j.User, s.User)
		}
	}
	t.Logf("manager uid %s (%s); its jobs are %s's", uid[1], s.User, s.User)
}

// checkOutputKept: the agents' output stays in the spool for reading
// after the jobs (the pool read its phases from it).
func checkOutputKept(t *testing.T, f *harness.Fleet) {
	t.Helper()
	logs, _ := os.ReadDir(f.State + "/slurm/" + f.Repo + "/logs")
	if len(logs) < 6 {
		t.Errorf("%d agent outputs kept, want one per runner (at least 6)", len(logs))
	}
}

// scancel of a runner's job mid-job, as a cluster admin would: the job is
// reported lost, re-run once by Gitea's re-run on another runner, and
// passes; the slot refilled.
func TestSlurmScancelMidJob(t *testing.T) {
	beside(t)
	harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmcancel", harness.FleetOptions{Size: 1, Max: 2, Slurm: mem})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("slurmcancel", 1, "sleep 30\necho done"))
	f.WaitInProgress(1)
	var victimReg int64
	var victimName string
	for _, r := range f.Status().Pools[0].Runners {
		if r.State == "busy" {
			victimReg, victimName = r.RunnerID, r.Name
		}
	}
	var victim string
	for _, j := range f.SlurmJobs() {
		if j.Name == victimName && j.State == "RUNNING" {
			victim = j.ID
		}
	}
	if victim == "" {
		t.Fatalf("no running Slurm job for busy runner %q", victimName)
	}
	time.Sleep(3 * time.Second) // its step under way
	cancelled := time.Now()
	harness.Scancel(t, victim)
	lost := []string{"taken back while it runs a job", "taken back; its runner's job", "taken back as its runner's job ended", "died while running a job", "vanished while it ran a job"}
	harness.Eventually(t, time.Minute, "the job reported lost", func() bool { return len(harness.LogLines(f.LogPath, lost...)) > 0 })
	t.Logf("job reported lost %s after scancel %s: %s", time.Since(cancelled).Round(100*time.Millisecond), victim,
		strings.Join(harness.LogLines(f.LogPath, lost...), ""))
	harness.Eventually(t, time.Minute, "the slot refilled: a new runner idle", func() bool { return f.IdleOnline() >= 1 })
	harness.Eventually(t, 4*time.Minute, "the cancelled job re-run and passed on another runner", func() bool {
		jobs := f.Jobs()
		return len(jobs) == 1 && jobs[0].Status == "completed" && jobs[0].Conclusion == "success" && jobs[0].RunnerID != victimReg
	})
	if n := len(harness.LogLines(f.LogPath, "re-ran the failed jobs of a run whose runner was lost")); n != 1 {
		t.Errorf("the job was re-run %d times, want once", n)
	}
	f.StopLeavesNothing()
}

// kill -9 of the manager while two jobs run; the next manager adopts both
// runners' jobs by their records and comments: both jobs finish once, on
// the Slurm jobs they started on (none cancelled, none submitted twice for
// a runner), and nothing is left.
func TestSlurmCrashAdopts(t *testing.T) {
	beside(t)
	s := harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmcrash", harness.FleetOptions{Size: 2, Max: 2, Slurm: mem})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("slurmcrash", 2, "sleep 15\necho done"))
	f.WaitInProgress(2)
	busy := map[string]string{} // Slurm job id by runner
	for _, j := range f.SlurmJobs() {
		busy[j.Name] = j.ID
	}
	f.Kill9()
	f.Start()
	stop, dups := make(chan struct{}), make(chan []string)
	go func() {
		var found []string
		for {
			live := map[string][]string{}
			for _, j := range f.SlurmJobs() {
				live[j.Name] = append(live[j.Name], j.ID)
			}
			for name, ids := range live {
				if len(ids) > 1 {
					found = append(found, fmt.Sprintf("%s: %v", name, ids))
				}
			}
			select {
			case <-stop:
				dups <- found
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	jobs := f.WaitJobs(2, 3*time.Minute)
	close(stop)
	harness.CheckJobs(t, jobs)
	for _, d := range <-dups {
		t.Errorf("a runner had two live Slurm jobs at once: %s", d)
	}
	states := map[string]string{}
	harness.Eventually(t, time.Minute, "the adopted jobs ended", func() bool {
		for _, j := range s.Jobs(t) {
			states[j.ID] = j.State
		}
		for _, id := range busy {
			if st := states[id]; st == "RUNNING" || st == "COMPLETING" {
				return false
			}
		}
		return true
	})
	for name, id := range busy {
		t.Logf("runner %s: Slurm job %s from before the crash ended %s", name, id, states[id])
		if states[id] != "COMPLETED" {
			t.Errorf("runner %s's job %s ended %s, not COMPLETED: it was not adopted", name, id, states[id])
		}
	}
	f.StopLeavesNothing()
}

// mem is the slurm section of the pools without GPUs.
const mem = "      memory: 100M\n"

// TestChaosSlurm: kill -9 and drains of the manager at seeded moments
// while bursts of jobs run as Slurm jobs.
func TestChaosSlurm(t *testing.T) {
	harness.NeedSlurm(t)
	opt := harness.ChaosOptions("")
	opt.Slurm = mem
	f := harness.NewFleet(t, "chaosslurm", opt)
	harness.RunChaos(t, f)
}

// shorten edits the fleet's config before its manager starts.
func shorten(t testing.TB, f *harness.Fleet, old, new string) {
	t.Helper()
	b, err := os.ReadFile(f.Config)
	if err != nil || !strings.Contains(string(b), old) {
		t.Fatalf("config lacks %q (%v)", old, err)
	}
	if err := os.WriteFile(f.Config, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
}

// kill -9 of the manager, not restarted: `runfleet gc`, run as the same
// ordinary user, lists the runners' jobs and registrations, and with --yes
// cancels the jobs (whose traps remove their directories) and removes the
// registrations, records and credentials.
func TestSlurmGC(t *testing.T) {
	harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmgc", harness.FleetOptions{Size: 2, Max: 2, Slurm: mem})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Kill9()
	listed := f.Runfleet("gc", "-c", f.Config)
	t.Logf("gc:\n%s", listed)
	if strings.Count(listed, "machine") != 2 || strings.Count(listed, "registration") != 2 {
		t.Errorf("gc lists, want 2 machines and 2 registrations:\n%s", listed)
	}
	removed := f.Runfleet("gc", "-c", f.Config, "--yes")
	t.Logf("gc --yes:\n%s", removed)
	if !strings.Contains(removed, "removed 4 of 4") {
		t.Errorf("gc --yes did not remove 2 jobs and 2 registrations")
	}
	harness.Eventually(t, 30*time.Second, "no live job, no runner process", func() bool {
		return len(f.SlurmJobs()) == 0 && len(f.RunnerPIDs()) == 0
	})
	harness.Eventually(t, 30*time.Second, "the jobs' directories removed", func() bool {
		left, _ := os.ReadDir(f.Work)
		return len(left) == 0
	})
	if len(f.Runners()) != 0 {
		t.Errorf("registrations left after gc --yes: %d", len(f.Runners()))
	}
	f.SlurmLeavesNothing()
	if out := f.Runfleet("gc", "-c", f.Config); !strings.Contains(out, "left nothing") {
		t.Errorf("gc after gc --yes:\n%s", out)
	}
}

// slurmctld frozen for 40 s while a job runs (it accepts connections and
// answers nothing, and squeue exits 0 with an empty list and an error
// beside it): the manager keeps answering, removes and submits nothing
// while the queue cannot be read, logs the failure once, and once the
// controller is back the job has succeeded and the pool is whole.
func TestSlurmControllerOutage(t *testing.T) {
	s := harness.NeedSlurm(t)
	top, _, status := harness.Listeners(t)
	f := harness.NewFleet(t, "slurmout", harness.FleetOptions{Size: 2, Max: 2, Slurm: mem, Top: top})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	// Older than a submission a queue read may miss: a failed read taken
	// for an empty queue would read them as ended.
	time.Sleep(35 * time.Second)
	f.Push(harness.Matrix("slurmout", 1, "sleep 25\necho done"))
	f.WaitInProgress(1)
	removedBefore := len(harness.LogLines(f.LogPath, "runner removed"))
	thaw := s.FreezeController(t)
	frozen := time.Now()
	for time.Since(frozen) < 40*time.Second {
		if code, _ := harness.Get(t, status+"/healthz"); code != 200 {
			t.Errorf("/healthz answered %d %s into the outage", code, time.Since(frozen).Round(time.Second))
			break
		}
		time.Sleep(2 * time.Second)
	}
	if n := len(harness.LogLines(f.LogPath, "runner removed")); n != removedBefore {
		t.Errorf("%d runners removed while the controller was frozen", n-removedBefore)
	}
	thaw()
	back := time.Now()
	jobs := f.WaitJobs(1, 3*time.Minute)
	harness.CheckJobs(t, jobs)
	harness.Eventually(t, 2*time.Minute, "the pool whole again", func() bool { return f.IdleOnline() == 2 })
	t.Logf("pool back to 2 idle runners %s after the controller", time.Since(back).Round(100*time.Millisecond))
	if n := len(harness.LogLines(f.LogPath, "reading the Slurm queue failed")); n < 1 || n > 3 {
		t.Errorf("the outage logged %d times, want once a minute", n)
	}
	f.StopLeavesNothing()
}
