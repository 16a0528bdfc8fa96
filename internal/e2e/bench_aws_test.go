package e2e

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/ec2sim"
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
		sim.AddImage(ec2AMI, "")
		name := fmt.Sprintf("awsburst%d", i)
		top, _, status := listeners(b)
		f := newGitHubFleet(b, name, ghOptions{Size: runners, Max: runners, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool:  awsSection(sim, "      instance_types: [t3.medium]\n      spot: true\n      poll_interval: 5s\n")})
		f.ec2, f.env = sim, append(f.env, awsEnv()...)
		cfg, _ := os.ReadFile(f.config)
		cfg = []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1))
		os.WriteFile(f.config, cfg, 0o600)

		start := time.Now()
		f.start()
		for len(sim.Instances()) < runners {
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("%d of %d instances after 5m", len(sim.Instances()), runners)
			}
			time.Sleep(100 * time.Millisecond)
		}
		took := time.Since(start)
		burst := sim.Calls()
		rss := rssMiB(f.cmd.Process.Pid)
		time.Sleep(time.Minute)
		after := sim.Calls()
		total := func(c map[string]int) (n int) {
			for _, v := range c {
				n += v
			}
			return n
		}
		counted := metricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		b.ReportMetric(took.Seconds(), "s-to-100-launched")
		b.ReportMetric(float64(total(burst))/runners, "ec2-calls/runner")
		b.ReportMetric(float64(total(after)-total(burst)), "ec2-calls/min-steady")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d instances launched in %s; EC2 calls then %v (%.2f per runner); the next minute %d calls (%v); the manager counted %.0f; RSS %.1f MiB",
			runners, took.Round(100*time.Millisecond), burst, float64(total(burst))/runners, total(after)-total(burst), diff(after, burst), counted, rss)
		if err := f.stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		f.ec2LeavesNothing()
	}
}

func diff(after, before map[string]int) map[string]int {
	out := map[string]int{}
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}
