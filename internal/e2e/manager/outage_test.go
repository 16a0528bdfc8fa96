package manager

import (
	"net/http"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestForgeOutage freezes Gitea (SIGSTOP: it accepts connections and
// answers nothing, as a hung forge does) for 60 s in the middle of a
// burst. While it is away nothing is removed and the manager keeps
// answering, healthy (a minute of failed passes is its bar); after it
// returns every job succeeds (those that ended while it was away report
// on its return), and the pool gets back to size (no job waiting for a
// runner, the warm runners idle) without backing off: no runner it starts
// then fails. How long that took is logged, not asserted: it is the time
// six runners take to start, 1.5-2.5 s here at load 8-15, and more at a
// CI run's load, where a 10-s bound once failed.
func TestForgeOutage(t *testing.T) {
	const name = "outage"
	top, hooks, status := harness.Listeners(t)
	f := harness.NewFleet(t, name, harness.FleetOptions{
		Size: 2, Max: 6, Top: top,
		Forge: "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 2s\n",
		Extra: "    idle_timeout: 3s\n",
	})
	f.Hooks = hooks
	f.AddWebhook()
	f.Start()
	harness.Eventually(t, time.Minute, "2 warm runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix(name, 10, "sleep 8\necho done"))
	harness.Eventually(t, time.Minute, "6 jobs in progress", func() bool { return harness.CountJobs(f, "in_progress") == 6 })

	before := f.LiveDirs()
	removedBefore := f.LogCount(`msg="runner removed"`)
	if err := harness.Gitea.Freeze(); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	thawed := false
	thaw := func() {
		if !thawed {
			thawed = true
			if err := harness.Gitea.Thaw(); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(thaw)
	t.Logf("Gitea frozen with %d runners alive", len(before))

	// The manager answers while the forge does not.
	c := &http.Client{Timeout: 3 * time.Second}
	slowest := time.Duration(0)
	for end := time.Now().Add(60 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Second) {
		start := time.Now()
		res, err := c.Get(status + "/healthz")
		if err != nil {
			t.Errorf("the status listener hung while the forge was frozen: %v", err)
			continue
		}
		res.Body.Close()
		slowest = max(slowest, time.Since(start))
		if res.StatusCode != http.StatusOK {
			// Unhealthy only once every pass has failed for a minute.
			t.Errorf("/healthz answered %d %s into the outage", res.StatusCode, time.Since(frozen).Round(time.Second))
		}
	}
	after := f.LiveDirs()
	for dir := range before {
		if !after[dir] {
			t.Errorf("runner %s was removed while the forge was away", dir)
		}
	}
	if n := f.LogCount(`msg="runner removed"`) - removedBefore; n != 0 {
		t.Errorf("%d runners removed while the forge was away", n)
	}
	failedBefore := f.LogCount(`msg="create runner failed"`)
	thaw()
	back := time.Now()
	harness.Eventually(t, 3*time.Minute, "the pool back to size", func() bool {
		return harness.CountJobs(f, "queued")+harness.CountJobs(f, "waiting") == 0 && f.IdleOnline() >= 2
	})
	took := time.Since(back)
	t.Logf("status answered in at most %s during the outage; the pool was back to size %s after the forge returned", slowest.Round(time.Millisecond), took.Round(time.Millisecond))
	if n := f.LogCount(`msg="create runner failed"`) - failedBefore; n != 0 {
		t.Errorf("%d runners failed to start after the forge returned: the pool backed off", n)
	}
	for _, j := range f.WaitJobs(10, 2*time.Minute) {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	f.StopLeavesNothing()
}
