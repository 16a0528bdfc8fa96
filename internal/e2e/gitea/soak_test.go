package gitea

import (
	"fmt"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkSoak runs -soak.jobs one-second jobs (1,000) spread evenly over
// -soak.duration (30 min) on a webhook-fed pool of size 2 and max 8 on the
// real Gitea, and reports the manager's resident memory, goroutines, open
// files and forge calls per job over the first and the last tenth of the
// jobs (figures taken as the window ends, calls counted within it): a leak
// shows as a figure that grows between them.
//
//	go test ./internal/e2e -run '^$' -bench Soak -benchtime 1x -timeout 60m
func BenchmarkSoak(b *testing.B) {
	const name = "soak"
	top, hooks, status := harness.Listeners(b)
	f := harness.NewFleet(b, name, harness.FleetOptions{Size: 2, Max: 8, Top: top,
		Forge: "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 30s\n",
		Extra: "    idle_timeout: 10s\n"})
	f.Hooks = hooks
	f.AddWebhook()
	f.Start()
	harness.Eventually(b, time.Minute, "2 warm runners", func() bool { return f.IdleOnline() == 2 })

	const burst = 10
	bursts := max(1, *harness.SoakJobs/burst)
	every := *harness.SoakDuration / time.Duration(bursts)
	window := max(1, bursts/10)
	var first, last harness.SoakSample
	zero := f.SoakSample(b, status)
	start := time.Now()
	for i := range bursts {
		// Sampled when burst i is due, before it is pushed: the window
		// before holds exactly its own bursts, the last of them pushed
		// one interval ago.
		time.Sleep(time.Until(start.Add(time.Duration(i) * every)))
		switch i {
		case window:
			first = f.SoakSample(b, status)
		case bursts - window:
			last = f.SoakSample(b, status)
		}
		f.Push(harness.Matrix(name, burst, fmt.Sprintf("echo soak %d job ${{ matrix.n }}\nsleep 1", i)))
	}
	jobs := f.WaitJobs(bursts*burst, 10*time.Minute)
	end := f.SoakSample(b, status)
	n := float64(window * burst)
	first.Rate(zero, n)
	end.Rate(last, n)
	failed := 0
	for _, j := range jobs {
		if j.Conclusion != "success" {
			failed++
		}
	}
	b.Logf("%d jobs in %s, %d failed", len(jobs), time.Since(start).Round(time.Second), failed)
	b.Logf("first %d jobs: %s", window*burst, first)
	b.Logf("last %d jobs:  %s", window*burst, end)
	b.ReportMetric(first.RSSMiB, "start-rss-MiB")
	b.ReportMetric(end.RSSMiB, "end-rss-MiB")
	b.ReportMetric(first.Goroutines, "start-goroutines")
	b.ReportMetric(end.Goroutines, "end-goroutines")
	b.ReportMetric(first.Fds, "start-fds")
	b.ReportMetric(end.Fds, "end-fds")
	b.ReportMetric(first.PerJob, "start-calls/job")
	b.ReportMetric(end.PerJob, "end-calls/job")
	b.ReportMetric(first.PerMin, "start-calls/min")
	b.ReportMetric(end.PerMin, "end-calls/min")
	if failed > 0 {
		b.Errorf("%d jobs failed", failed)
	}
	f.StopLeavesNothing()
}
