package gitea

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestScaleFromZero runs a workflow of 6 jobs on a pool of size 0 and max
// 4: with webhooks only (polling off), then with polling only (no
// webhook). No runner exists while idle; runners appear for the queued
// jobs, never more than 4; all 6 jobs succeed; after idle_timeout no
// runner is left.
func TestScaleFromZero(t *testing.T) {
	for _, mode := range []string{"webhooks", "polling"} {
		t.Run(mode, func(t *testing.T) {
			name := "zero" + mode[:4]
			f, base := harness.ScaleFleet(t, name, mode == "webhooks", mode == "polling")
			f.Start()
			harness.Eventually(t, 30*time.Second, "the status page", func() bool {
				code, body := harness.Get(t, base+"/")
				return code == 200 && strings.Contains(body, name)
			})
			time.Sleep(3 * time.Second) // a pass or two at size 0
			if n := len(f.Runners()); n != 0 || len(f.RunnerPIDs()) != 0 {
				t.Fatalf("%d registrations, %d runner processes while idle at size 0", n, len(f.RunnerPIDs()))
			}
			if code, _ := harness.Get(t, base+"/healthz"); code != 200 {
				t.Fatalf("/healthz: %d", code)
			}
			// The listener the forge reaches serves its webhook only.
			for _, path := range []string{"/", "/metrics", "/healthz"} {
				if code, _ := harness.Get(t, f.Hooks+path); code != http.StatusNotFound {
					t.Errorf("the webhook listener answers GET %s with %d, want 404", path, code)
				}
			}

			// At most 4 runners at any time, sampled while the jobs run.
			var most atomic.Int64
			stop := make(chan struct{})
			go func() {
				for {
					select {
					case <-stop:
						return
					case <-time.After(50 * time.Millisecond):
					}
					if n := int64(f.LiveRunners()); n > most.Load() {
						most.Store(n)
					}
				}
			}()
			start := time.Now()
			f.Push(harness.Matrix(name, 6, "echo job ${{ matrix.n }}\nsleep 2"))
			jobs := f.WaitJobs(6, 3*time.Minute)
			close(stop)
			t.Logf("%s: 6 jobs done in %s with at most %d runners at once", mode, time.Since(start).Round(100*time.Millisecond), most.Load())
			for _, j := range jobs {
				if j.Conclusion != "success" {
					t.Errorf("job %s: %s", j.Name, j.Conclusion)
				}
			}
			if most.Load() > 4 {
				t.Errorf("%d runners at once, max is 4", most.Load())
			}
			accepted := harness.Metric(t, base, `runfleet_webhook_deliveries_total{forge="local",result="accepted"}`)
			polls := harness.Metric(t, base, `runfleet_queue_polls_total{forge="local",result="ok"}`)
			started := harness.Metric(t, base, `runfleet_jobs_started_total{pool="`+name+`"}`)
			t.Logf("%s: webhook deliveries accepted %v, polls %v, jobs started (metric) %v", mode, accepted, polls, started)
			b, _ := os.ReadFile(f.LogPath)
			startedRunners := strings.Count(string(b), `msg="runner started"`)
			t.Logf("%s: %d runners started for 6 jobs", mode, startedRunners)
			// A runner for each job; one more at most, where a pass
			// falls between a runner taking a job and the forge saying
			// so. More is a runner kept idle for nothing.
			if startedRunners > 7 {
				t.Errorf("%d runners started for 6 jobs", startedRunners)
			}
			// E2E_SCALE_LOG=1 shows the pool's demand decisions, to see
			// why a runner was started.
			if os.Getenv("E2E_SCALE_LOG") != "" || startedRunners > 7 {
				for _, l := range strings.Split(string(b), "\n") {
					if strings.Contains(l, "runner started") || strings.Contains(l, "msg=demand") || strings.Contains(l, "job queued") || strings.Contains(l, "state=busy") && strings.Contains(l, "slot") {
						t.Log(l)
					}
				}
			}
			switch mode {
			case "webhooks":
				if accepted < 6 || polls != 0 {
					t.Errorf("webhooks only: %v deliveries accepted, %v polls", accepted, polls)
				}
				harness.BadSignature(t, base, f)
			case "polling":
				if accepted != 0 || polls < 1 {
					t.Errorf("polling only: %v deliveries accepted, %v polls", accepted, polls)
				}
			}

			// Idle runners above size 0 go after idle_timeout (8s).
			harness.Eventually(t, 45*time.Second, "no runner left after idle_timeout", func() bool {
				return len(f.Runners()) == 0 && len(f.RunnerPIDs()) == 0
			})
			f.StopLeavesNothing()
		})
	}
}

// TestBurstsOnAWarmPool pushes five 20-job workflows of one-second jobs at
// a pool of size 2 with webhooks on: each burst starts at most 20 runners
// (18 for the jobs the 2 warm runners did not take, 2 to refill the pool),
// because a runner that took a job is known at once from its own output
// and never counted as a job still queued.
func TestBurstsOnAWarmPool(t *testing.T) {
	const name = "warm"
	top, hooks, _ := harness.Listeners(t)
	f := harness.NewFleet(t, name, harness.FleetOptions{Size: 2, Max: 20, Top: top, Forge: "    webhook_secret: " + harness.HookSecret + "\n"})
	f.Hooks = hooks
	f.AddWebhook()
	f.Start()
	started := func() int {
		b, _ := os.ReadFile(f.LogPath)
		return strings.Count(string(b), `msg="runner started"`)
	}
	harness.Eventually(t, time.Minute, "2 warm runners", func() bool { return f.IdleOnline() == 2 })
	for burst := 1; burst <= 5; burst++ {
		before := started()
		f.Push(harness.Matrix(name, 20, fmt.Sprintf("echo burst %d job ${{ matrix.n }}\nsleep 1", burst)))
		f.WaitJobs(20*burst, 5*time.Minute)
		harness.Eventually(t, time.Minute, "the pool refilled", func() bool { return f.IdleOnline() >= 2 })
		time.Sleep(2 * time.Second) // a late start would show by now
		n, idle := started()-before, f.IdleOnline()
		t.Logf("burst %d: %d runners started for 20 jobs; %d idle after", burst, n, idle)
		if n > 20 || idle != 2 {
			t.Fatalf("burst %d started %d runners and left %d idle; want at most 20 (18 for the jobs, 2 to refill) and 2 idle", burst, n, idle)
		}
	}
	for _, j := range f.Jobs() {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	f.StopLeavesNothing()
}
