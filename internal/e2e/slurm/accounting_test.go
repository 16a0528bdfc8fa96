package slurm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// A pool of 3 in an account whose association allows 2 jobs
// (MaxSubmitJobs, AccountingStorageEnforce=limits): sbatch's refusal of the
// third is no fault of the job and not for ever, so the pool keeps its 2
// runners, backs off between tries rather than submitting in a loop, and
// `runfleet status` says why.
func TestSlurmSubmitLimitBacksOff(t *testing.T) {
	beside(t)
	harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmcap", harness.FleetOptions{Size: 3, Max: 3, Slurm: mem + "      account: " + harness.CappedAccount + "\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == harness.CappedSubmitJobs })
	const limit = "AssocMaxSubmitJobLimit"
	harness.Eventually(t, 30*time.Second, "sbatch's refusal in the log", func() bool { return f.LogHas(limit) })
	first := time.Now()
	time.Sleep(25 * time.Second)
	tries := len(harness.LogLines(f.LogPath, limit))
	t.Logf("%d refusals logged in the %s after the first: %s", tries, time.Since(first).Round(time.Second), harness.LogLines(f.LogPath, limit)[0])
	// The pool's backoff doubles from 1 s: tries 1, 3, 7 and 15 s after
	// the first, each a pass's lag late; a loop would try every pass
	// (2 s), 12 times or more.
	if tries > 7 {
		t.Errorf("%d submissions refused within 25 s: no backoff", tries)
	}
	if n := len(f.SlurmJobs()); n != harness.CappedSubmitJobs {
		t.Errorf("%d Slurm jobs, want the association's %d", n, harness.CappedSubmitJobs)
	}
	doc := f.Status()
	if len(doc.Pools) != 1 || doc.Pools[0].Backoff == nil || doc.Pools[0].Backoff.Halted || !strings.Contains(doc.Pools[0].Backoff.Reason, limit) {
		t.Errorf("runfleet status does not say why the pool is short (a backoff, not halted): %+v", doc.Pools)
	}
	f.StopLeavesNothing()
}

// A node that crashes under a busy runner while the manager is away (kill
// -9), its job ended NODE_FAIL with no notice left (SIGKILL runs no trap)
// and gone from the queue by the time the next manager reads it
// (MinJobAge): accounting (sacct) tells the job was lost, and it is re-run
// once and passes.
func TestSlurmNodeFailFromAccountingReruns(t *testing.T) {
	s := harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmnodefail", harness.FleetOptions{Size: 1, Max: 2, Slurm: mem})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("slurmnodefail", 1, attempts(t, "slurmnodefail")))
	victim, reg := busyJob(t, f)
	f.Kill9()
	crashed := time.Now()
	back := s.CrashNode(t)
	state := endState(t, s, victim, time.Minute)
	// The node's scratch goes with it (a reboot): what the killed job
	// left there no trap removed. The manager is away: nothing else is
	// there.
	left, _ := os.ReadDir(f.Work)
	for _, e := range left {
		_ = os.RemoveAll(filepath.Join(f.Work, e.Name()))
	}
	back()
	harness.Eventually(t, 3*time.Minute, "the job gone from the queue", func() bool { return harness.SlurmJob(t, victim, "%T") == "" })
	gone := time.Since(crashed)
	f.Start()
	checkRerun(t, f, reg)
	if !f.LogHas("from accounting") {
		t.Error("the manager did not say that accounting told the job's end")
	}
	t.Logf("node crashed: job %s ended %s, left the queue %s after, re-run and passed %s after",
		victim, state, gone.Round(time.Second), time.Since(crashed).Round(time.Second))
	if state != "NODE_FAIL" {
		t.Errorf("the runner's job ended %s, not NODE_FAIL", state)
	}
	f.StopLeavesNothing()
}
