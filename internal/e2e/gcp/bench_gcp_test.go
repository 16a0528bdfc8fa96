package gcp

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkGCPBurst starts a pool of 100 instances from nothing against
// the Compute Engine stand-in answering every call 200 ms late, with
// registrations at the GitHub simulator (the instances boot nothing): the
// time until all 100 instances are placed, the calls per runner
// then and over a minute of steady state, and the manager's RSS. Compute
// Engine's documented rate quotas (1,500 requests a minute per group and
// project) allow the burst at once; the manager's limiter and the
// stand-in hold it to that.
//
//	go test ./internal/e2e/gcp -run '^$' -bench GCPBurst -benchtime 1x
//
// With handoff_url the startup-script is the pool's, and the runners go
// out in bulk inserts (one request and one operation's wait for many);
// their assignments wait at the manager's desk (the instances, which boot
// nothing, never claim them).
func BenchmarkGCPBurst(b *testing.B) {
	b.Run("metadata", func(b *testing.B) { gcpBurst(b, false) })
	b.Run("handoff", func(b *testing.B) { gcpBurst(b, true) })
}

func gcpBurst(b *testing.B, handoff bool) {
	const runners = 100
	for i := range b.N {
		sim, err := gcesim.New(gcesim.Options{Latency: 200 * time.Millisecond})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(sim.Close)
		sim.AddImage(harness.GCEImage, "")
		name := fmt.Sprintf("gcpburst%d%t", i, handoff)
		top, hooks, status := harness.Listeners(b)
		extra := ""
		if handoff {
			extra = "      service_account: runner@" + gcesim.Project + ".iam.gserviceaccount.com\n      handoff_url: " + hooks + "\n      identity_certs: " + sim.CertsURL() + "\n"
		}
		f := harness.NewGitHubFleet(b, name, harness.GitHubOptions{Size: runners, Max: runners, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool:  harness.GCPSection(sim, "      spot: true\n      poll_interval: 5s\n"+extra)})
		f.GCE, f.Env = sim, append(f.Env, harness.GCPEnv(sim)...)
		cfg, _ := os.ReadFile(f.Config)
		cfg = []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1))
		os.WriteFile(f.Config, cfg, 0o600)

		start := time.Now()
		f.Start()
		done := func() int {
			n := 0
			for _, in := range sim.Instances() {
				if in.Status != "PROVISIONING" {
					n++
				}
			}
			return n
		}
		for done() < runners {
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("%d of %d instances placed after 5m", done(), runners)
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
		b.ReportMetric(took.Seconds(), "s-to-100-placed")
		b.ReportMetric(float64(total(burst))/runners, "gce-calls/runner")
		b.ReportMetric(float64(total(after)-total(burst)), "gce-calls/min-steady")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d instances placed in %s; Compute Engine calls then %v (%.2f per runner, quota 1,500 a minute per group); the next minute %d calls (%v); the manager counted %.0f; RSS %.1f MiB",
			runners, took.Round(100*time.Millisecond), burst, float64(total(burst))/runners, total(after)-total(burst), harness.Diff(after, burst), counted, rss)
		if err := f.Stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		f.GCELeavesNothing()
	}
}
