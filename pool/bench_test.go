package pool

import (
	"context"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/placement"
)

// BenchmarkReconcile1000 times one pass over a pool of 1,000 idle runners
// on an in-memory forge and provider, and reports the process's resident
// memory with them.
func BenchmarkReconcile1000(b *testing.B) {
	const n = 1000
	clk := &clock{t: time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)}
	f, prov := newFakeForge(), newFakeProvider(clk.Now)
	p := New(Config{Name: "gpu", Manager: "m1", Runners: placement.Runners{Labels: []string{"gpu"}}, Size: n, Max: n, IdleTimeout: time.Hour, BootstrapTimeout: time.Hour},
		f, prov, fakeAgent{}, WithClock(clk.Now), WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	ctx := context.Background()
	for range 3 {
		if err := p.Reconcile(ctx); err != nil {
			b.Fatal(err)
		}
		p.Wait()
	}
	f.mu.Lock()
	for _, r := range f.runners {
		r.Status = forge.StatusIdle
	}
	f.mu.Unlock()
	if got := len(prov.running()); got != n {
		b.Fatalf("%d runners, want %d", got, n)
	}
	runtime.GC()
	b.ResetTimer()
	for b.Loop() {
		if err := p.Reconcile(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if s := p.Runners(); len(s) != n || s[0].State != StateIdle {
		b.Fatalf("view %d runners, first %s", len(s), s[0].State)
	}
	b.ReportMetric(float64(rssKiB())/1024, "RSS-MiB")
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b.ReportMetric(float64(ms.HeapInuse)/(1<<20), "heap-MiB")
}

// rssKiB reads VmRSS from /proc/self/status.
func rssKiB() int {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	return 0
}
