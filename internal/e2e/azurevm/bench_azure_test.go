package azurevm

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkAzureBurst starts a pool of 100 VMs from nothing against the
// Azure stand-in answering every call 200 ms late, with registrations at
// the GitHub simulator (the VMs boot nothing): the time until all 100
// creations' operations are done, the calls per runner then and over a
// minute of steady state, and the manager's RSS. Azure Resource
// Manager's documented buckets (writes 200 refilled at 10 a second,
// reads 250 at 25) allow the burst at once; the manager's limiter and
// the stand-in hold it to that.
//
//	go test ./internal/e2e/azurevm -run '^$' -bench AzureBurst -benchtime 1x
//
// With handoff_url the runners' assignments wait at the manager's desk
// (the VMs, which boot nothing, never claim them): the same calls.
func BenchmarkAzureBurst(b *testing.B) {
	b.Run("custom-data", func(b *testing.B) { azureBurst(b, false) })
	b.Run("handoff", func(b *testing.B) { azureBurst(b, true) })
}

func azureBurst(b *testing.B, handoff bool) {
	const runners = 100
	for i := range b.N {
		sim, err := armsim.New(armsim.Options{Latency: 200 * time.Millisecond})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(sim.Close)
		sim.AddImage(harness.ARMImage, "")
		name := fmt.Sprintf("azburst%d%t", i, handoff)
		top, hooks, status := harness.Listeners(b)
		extra := ""
		if handoff {
			extra = "      handoff_url: " + hooks + "\n      attested_roots: " + sim.AttestedRoots() + "\n"
		}
		f := harness.NewGitHubFleet(b, name, harness.GitHubOptions{Size: runners, Max: runners, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool:  harness.AzureVMSection(sim, "      spot: true\n      poll_interval: 5s\n"+extra)})
		f.ARM, f.Env = sim, append(f.Env, sim.Env()...)
		cfg, _ := os.ReadFile(f.Config)
		cfg = []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1))
		os.WriteFile(f.Config, cfg, 0o600)

		start := time.Now()
		f.Start()
		// Done once Azure has made every VM; the manager learns it from
		// its next listing.
		made := func() (n int) {
			for _, v := range sim.VMs() {
				if v.Provisioning == "Succeeded" {
					n++
				}
			}
			return n
		}
		for made() < runners {
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("%d of %d VMs made after 5m", made(), runners)
			}
			time.Sleep(100 * time.Millisecond)
		}
		took := time.Since(start)
		burst := sim.Calls()
		rss := harness.RSSMiB(f.Cmd.Process.Pid)
		time.Sleep(time.Minute)
		after := sim.Calls()
		total := func(c map[string]int) (n int) {
			for k, v := range c {
				if k != "token" && k != "openid-configuration" && !strings.HasSuffix(k, " done") {
					n += v
				}
			}
			return n
		}
		counted := harness.MetricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		b.ReportMetric(took.Seconds(), "s-to-100-made")
		b.ReportMetric(float64(total(burst))/runners, "arm-calls/runner")
		b.ReportMetric(float64(total(after)-total(burst)), "arm-calls/min-steady")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d VMs made in %s; ARM calls then %v (%.2f per runner; limits: writes 200 + 10/s, reads 250 + 25/s); the next minute %d calls (%v); the manager counted %.0f; RSS %.1f MiB",
			runners, took.Round(100*time.Millisecond), burst, float64(total(burst))/runners, total(after)-total(burst), harness.Diff(after, burst), counted, rss)
		if err := f.Stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		f.AzureLeavesNothing()
		// A life: made, its deallocation submitted, deleted, and the
		// listings and polls shared along the way.
		life := sim.Calls()
		b.ReportMetric(float64(total(life))/runners, "arm-calls/runner-life")
		b.Logf("a runner's life, made to deleted: %.2f ARM calls (%v)", float64(total(life))/runners, life)
	}
}
