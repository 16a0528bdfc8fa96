package e2e

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

var (
	soakJobs     = flag.Int("soak.jobs", 1000, "jobs BenchmarkSoak runs")
	soakDuration = flag.Duration("soak.duration", 30*time.Minute, "how long BenchmarkSoak spreads its jobs over")
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
	top, hooks, status := listeners(b)
	f := newFleet(b, name, fleetOptions{Size: 2, Max: 8, Top: top,
		Forge: "    webhook_secret: " + hookSecret + "\n    poll_interval: 30s\n",
		Extra: "    idle_timeout: 10s\n"})
	f.hooks = hooks
	f.addWebhook()
	f.start()
	eventually(b, time.Minute, "2 warm runners", func() bool { return f.idleOnline() == 2 })

	const burst = 10
	bursts := max(1, *soakJobs/burst)
	every := *soakDuration / time.Duration(bursts)
	window := max(1, bursts/10)
	var first, last soakSample
	zero := f.soakSample(b, status)
	start := time.Now()
	for i := range bursts {
		// Sampled when burst i is due, before it is pushed: the window
		// before holds exactly its own bursts, the last of them pushed
		// one interval ago.
		time.Sleep(time.Until(start.Add(time.Duration(i) * every)))
		switch i {
		case window:
			first = f.soakSample(b, status)
		case bursts - window:
			last = f.soakSample(b, status)
		}
		f.push(matrix(name, burst, fmt.Sprintf("echo soak %d job ${{ matrix.n }}\nsleep 1", i)))
	}
	jobs := f.waitJobs(bursts*burst, 10*time.Minute)
	end := f.soakSample(b, status)
	n := float64(window * burst)
	first.rate(zero, n)
	end.rate(last, n)
	failed := 0
	for _, j := range jobs {
		if j.Conclusion != "success" {
			failed++
		}
	}
	b.Logf("%d jobs in %s, %d failed", len(jobs), time.Since(start).Round(time.Second), failed)
	b.Logf("first %d jobs: %s", window*burst, first)
	b.Logf("last %d jobs:  %s", window*burst, end)
	b.ReportMetric(first.rssMiB, "start-rss-MiB")
	b.ReportMetric(end.rssMiB, "end-rss-MiB")
	b.ReportMetric(first.goroutines, "start-goroutines")
	b.ReportMetric(end.goroutines, "end-goroutines")
	b.ReportMetric(first.fds, "start-fds")
	b.ReportMetric(end.fds, "end-fds")
	b.ReportMetric(first.perJob, "start-calls/job")
	b.ReportMetric(end.perJob, "end-calls/job")
	b.ReportMetric(first.perMin, "start-calls/min")
	b.ReportMetric(end.perMin, "end-calls/min")
	if failed > 0 {
		b.Errorf("%d jobs failed", failed)
	}
	f.stopLeavesNothing()
}

type soakSample struct {
	at                      time.Time
	rssMiB, goroutines, fds float64
	calls, perJob, perMin   float64
}

// rate sets the forge calls per job and per minute since an earlier
// sample, over n jobs: part of the calls follow the clock (each pass lists
// runners and running jobs), part follow the jobs, so both are shown.
func (s *soakSample) rate(since soakSample, n float64) {
	calls := s.calls - since.calls
	s.perJob = calls / n
	s.perMin = calls / s.at.Sub(since.at).Minutes()
}

func (s soakSample) String() string {
	return fmt.Sprintf("RSS %.1f MiB, %.0f goroutines, %.0f open files, %.2f forge calls per job, %.1f per minute", s.rssMiB, s.goroutines, s.fds, s.perJob, s.perMin)
}

// soakSample reads the manager's figures now.
func (f *fleet) soakSample(b *testing.B, status string) soakSample {
	pid := f.cmd.Process.Pid
	s := soakSample{at: time.Now()}
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb float64
			fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(v), " kB"), &kb)
			s.rssMiB = kb / 1024
		}
	}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	s.fds = float64(len(fds))
	s.goroutines = metric(b, status, "go_goroutines")
	s.calls = metric(b, status, `runfleet_forge_api_calls_total{forge="local"}`)
	return s
}
