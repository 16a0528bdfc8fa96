package harness

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

var (
	SoakJobs     = flag.Int("soak.jobs", 1000, "jobs BenchmarkSoak runs")
	SoakDuration = flag.Duration("soak.duration", 30*time.Minute, "how long BenchmarkSoak spreads its jobs over")
)

type SoakSample struct {
	at                      time.Time
	RSSMiB, Goroutines, Fds float64
	calls, PerJob, PerMin   float64
}

// Rate sets the forge calls per job and per minute since an earlier
// sample, over n jobs: part of the calls follow the clock (each pass lists
// runners and running jobs), part follow the jobs, so both are shown.
func (s *SoakSample) Rate(since SoakSample, n float64) {
	calls := s.calls - since.calls
	s.PerJob = calls / n
	s.PerMin = calls / s.at.Sub(since.at).Minutes()
}

func (s SoakSample) String() string {
	return fmt.Sprintf("RSS %.1f MiB, %.0f goroutines, %.0f open files, %.2f forge calls per job, %.1f per minute", s.RSSMiB, s.Goroutines, s.Fds, s.PerJob, s.PerMin)
}

// SoakSample reads the manager's figures now.
func (f *Fleet) SoakSample(b *testing.B, status string) SoakSample {
	pid := f.Cmd.Process.Pid
	s := SoakSample{at: time.Now()}
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb float64
			fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(v), " kB"), &kb)
			s.RSSMiB = kb / 1024
		}
	}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	s.Fds = float64(len(fds))
	s.Goroutines = Metric(b, status, "go_goroutines")
	s.calls = Metric(b, status, `runfleet_forge_api_calls_total{forge="local"}`)
	return s
}
