package aws

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkAWSBurst starts a pool of 100 instances from nothing against
// the EC2 stand-in answering every call 200 ms late, with registrations at
// the GitHub simulator (the instances boot nothing): the time until all
// 100 RunInstances calls have returned, the EC2 calls per runner then and
// over a minute of steady state, and the manager's RSS. EC2's documented
// request rate for RunInstances (a bucket of 5, refilled 2 a second)
// bounds the burst at about 48 s; the stand-in enforces it too.
//
//	go test ./internal/e2e -run '^$' -bench AWSBurst -benchtime 1x
func BenchmarkAWSBurst(b *testing.B) {
	const runners = 100
	for i := range b.N {
		sim, err := ec2sim.New(ec2sim.Options{Latency: 200 * time.Millisecond})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(sim.Close)
		sim.AddImage(harness.EC2AMI, "")
		name := fmt.Sprintf("awsburst%d", i)
		top, _, status := harness.Listeners(b)
		f := harness.NewGitHubFleet(b, name, harness.GitHubOptions{Size: runners, Max: runners, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool:  harness.AWSSection(sim, "      instance_types: [t3.medium]\n      spot: true\n      poll_interval: 5s\n")})
		f.EC2, f.Env = sim, append(f.Env, harness.AWSEnv()...)
		cfg, _ := os.ReadFile(f.Config)
		cfg = []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1))
		os.WriteFile(f.Config, cfg, 0o600)

		start := time.Now()
		f.Start()
		for len(sim.Instances()) < runners {
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("%d of %d instances after 5m", len(sim.Instances()), runners)
			}
			time.Sleep(100 * time.Millisecond)
		}
		took := time.Since(start)
		burst := sim.Calls()
		rss := harness.RSSMiB(f.Cmd.Process.Pid)
		time.Sleep(time.Minute)
		after := sim.Calls()
		total := func(c map[string]int) (n int) {
			for _, v := range c {
				n += v
			}
			return n
		}
		counted := harness.MetricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		b.ReportMetric(took.Seconds(), "s-to-100-launched")
		b.ReportMetric(float64(total(burst))/runners, "ec2-calls/runner")
		b.ReportMetric(float64(total(after)-total(burst)), "ec2-calls/min-steady")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d instances launched in %s; EC2 calls then %v (%.2f per runner); the next minute %d calls (%v); the manager counted %.0f; RSS %.1f MiB",
			runners, took.Round(100*time.Millisecond), burst, float64(total(burst))/runners, total(after)-total(burst), harness.Diff(after, burst), counted, rss)
		if err := f.Stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		f.EC2LeavesNothing()
	}
}
