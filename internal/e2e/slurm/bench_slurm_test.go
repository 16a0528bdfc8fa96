package slurm

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkSlurmSubmit starts a pool of 200 runners from nothing on the
// real slurmctld, with registrations at the GitHub simulator; the jobs are
// submitted held (sbatch --hold), so that 200 agents do not start on two
// cores: the time until all 200 are in the queue, the Slurm commands run
// per runner then, the commands in a minute of steady state (one
// `squeue --json` per poll interval, whatever the number of passes), and
// the manager's RSS.
//
//	go test ./internal/e2e/slurm -run '^$' -bench SlurmSubmit -benchtime 1x
func BenchmarkSlurmSubmit(b *testing.B) {
	const runners = 200
	harness.NeedSlurm(b)
	for range b.N {
		top, _, status := harness.Listeners(b)
		f := harness.NewGitHubFleet(b, "slurmburst", harness.GitHubOptions{Size: runners, Max: runners, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool:  harness.SlurmSection("      queue_wait: true\n      poll_interval: 5s\n      memory: 10M\n      sbatch_options: [--hold]\n")})
		cfg, _ := os.ReadFile(f.Config)
		cfg = []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1))
		os.WriteFile(f.Config, cfg, 0o600)

		start := time.Now()
		f.Start()
		queued := func() int { return len(harness.JobsOf(b, "e2e-slurmburst")) }
		for queued() < runners {
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("%d of %d runners' jobs queued after 5m", queued(), runners)
			}
			time.Sleep(100 * time.Millisecond)
		}
		took := time.Since(start)
		burst := harness.MetricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		rss := harness.RSSMiB(f.Cmd.Process.Pid)
		time.Sleep(time.Minute)
		after := harness.MetricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		b.ReportMetric(took.Seconds(), "s-to-200-queued")
		b.ReportMetric(burst/runners, "slurm-calls/runner")
		b.ReportMetric(after-burst, "slurm-calls/min-steady")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d runners' jobs queued in %s; %.0f Slurm commands then (%.2f per runner: sbatch, and squeue shared by every pass); the next minute %.0f commands (passes every 2s, the queue read every 5s); RSS %.1f MiB",
			runners, took.Round(100*time.Millisecond), burst, burst/runners, after-burst, rss)
		if err := f.Stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		if n := len(harness.JobsOf(b, "e2e-slurmburst")); n != 0 {
			b.Errorf("%d jobs left after the drain", n)
		}
	}
}
