package manager

import (
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestReloadKeepsBusyRunner grows and shrinks a pool with SIGHUP while a
// job runs: the pool follows the new size, the busy runner is never
// touched and its job succeeds, and a reload that changes the forge is
// refused whole.
func TestReloadKeepsBusyRunner(t *testing.T) {
	f := harness.NewFleet(t, "reload", harness.FleetOptions{Size: 1, Max: 3, Extra: "    idle_timeout: 1s\n"})
	f.Start()
	harness.Eventually(t, time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("reload", 1, "sleep 25\necho done"))
	f.WaitInProgress(1)
	var busy string
	for _, j := range f.Jobs() {
		if j.Status == "in_progress" {
			busy = j.RunnerName
		}
	}

	f.Rewrite("size: 1\n    max: 3", "size: 2\n    max: 3")
	harness.Eventually(t, time.Minute, "2 idle runners beside the busy one", func() bool { return f.IdleOnline() == 2 })
	if !f.LogHas("pool reloaded") {
		t.Error("no reload in the log")
	}

	f.Rewrite("size: 2\n    max: 3", "size: 0\n    max: 3")
	harness.Eventually(t, time.Minute, "no idle runner at size 0", func() bool { return f.IdleOnline() == 0 })
	stillBusy := false
	for _, r := range f.Runners() {
		stillBusy = stillBusy || r.Name == busy
	}
	if !stillBusy || busy == "" {
		t.Fatalf("the busy runner %s is gone after reloads", busy)
	}

	f.Rewrite("    type: gitea\n", "    type: gitea\n    poll_interval: 5s\n")
	harness.Eventually(t, 10*time.Second, "the reload refused", func() bool { return f.LogHas("reload refused") })

	jobs := f.WaitJobs(1, time.Minute)
	if jobs[0].Conclusion != "success" {
		t.Fatalf("job: %s", jobs[0].Conclusion)
	}
	t.Logf("busy runner %s kept through 3 reloads; its job: %s", busy, jobs[0].Conclusion)
	f.StopLeavesNothing()
}
