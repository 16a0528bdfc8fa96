package aws

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkAWSBurst starts a pool of 100 instances from nothing against
// the EC2 stand-in answering every call 200 ms late, with registrations at
// the GitHub simulator (the instances boot nothing): the time until all
// 100 instances are launched, the EC2 calls per runner then and over a
// minute of steady state, and the manager's RSS. Without an instance
// profile each runner's user data is its own, one RunInstances each, and
// EC2's documented request rate for RunInstances (a bucket of 5, refilled
// 2 a second) bounds the burst at about 48 s; with one (handoff) the user
// data is the pool's and the runners asked for together go out in one
// call. The stand-in enforces both. With handoff_url (desk) the same,
// the assignments held at the manager's desk rather than stored in
// Parameter Store (the instances, which boot nothing, never claim them).
//
//	go test ./internal/e2e/aws -run '^$' -bench AWSBurst -benchtime 1x
func BenchmarkAWSBurst(b *testing.B) {
	b.Run("user-data", func(b *testing.B) { awsBurst(b, nil) })
	b.Run("handoff", func(b *testing.B) {
		awsBurst(b, func(*ec2sim.Server, string) string { return "      instance_profile: runfleet-runner\n" })
	})
	b.Run("desk", func(b *testing.B) {
		awsBurst(b, func(sim *ec2sim.Server, hooks string) string {
			certs := filepath.Join(b.TempDir(), "aws-rsa.pem")
			if err := os.WriteFile(certs, sim.IdentityCert(), 0o600); err != nil {
				b.Fatal(err)
			}
			return "      handoff_url: " + hooks + "\n      identity_certs: " + certs + "\n"
		})
	})
}

// awsBurst runs the burst with the pool's keys that keys gives for the
// stand-in and the manager's webhook listener (none when nil).
func awsBurst(b *testing.B, keys func(sim *ec2sim.Server, hooks string) string) {
	const runners = 100
	for i := range b.N {
		sim, err := ec2sim.New(ec2sim.Options{Latency: 200 * time.Millisecond})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(sim.Close)
		sim.AddImage(harness.EC2AMI, "")
		top, hooks, status := harness.Listeners(b)
		extra := ""
		if keys != nil {
			extra = keys(sim, hooks)
		}
		name := fmt.Sprintf("awsburst%d%d", i, len(extra))
		f := harness.NewGitHubFleet(b, name, harness.GitHubOptions{Size: runners, Max: runners, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool:  harness.AWSSection(sim, "      instance_types: [t3.medium]\n      spot: true\n      poll_interval: 5s\n"+extra)})
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
		// From the first instance launched to the last: the burst as EC2
		// sees it, the manager's start and the registrations aside.
		var first, last time.Time
		for _, in := range sim.Instances() {
			if first.IsZero() || in.Created.Before(first) {
				first = in.Created
			}
			if in.Created.After(last) {
				last = in.Created
			}
		}
		burst := sim.Calls()
		for k, v := range sim.SSMCalls() {
			burst["ssm:"+k] = v
		}
		rss := harness.RSSMiB(f.Cmd.Process.Pid)
		time.Sleep(time.Minute)
		after := sim.Calls()
		for k, v := range sim.SSMCalls() {
			after["ssm:"+k] = v
		}
		total := func(c map[string]int) (n int) {
			for _, v := range c {
				n += v
			}
			return n
		}
		counted := harness.MetricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		b.ReportMetric(took.Seconds(), "s-to-100-launched")
		b.ReportMetric(last.Sub(first).Seconds(), "s-first-to-last-launch")
		b.ReportMetric(float64(total(burst))/runners, "calls/runner")
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
