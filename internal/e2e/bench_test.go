package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkReplenish measures a slot's refill: from the moment a runner's
// agent exits after its job until its replacement is registered and idle
// (online, no job) at Gitea. Jobs run one at a time so that the
// replacement's idle state is observable. Reports p50 and p95.
//
//	go test ./internal/e2e -run '^$' -bench Replenish -benchtime 20x
func BenchmarkReplenish(b *testing.B) {
	name := fmt.Sprintf("bench-%d", b.N) // the benchmark runs once per b.N
	f := newFleet(b, name, fleetOptions{Size: 1})
	f.start()
	eventually(b, time.Minute, "1 idle runner", func() bool { return f.idleOnline() == 1 })
	var lat []time.Duration
	for i := range b.N {
		var curID int64
		var curName string
		eventually(b, time.Minute, "an idle runner", func() bool {
			for _, r := range f.runners() {
				if r.Status == "online" && !r.Busy {
					curID, curName = r.ID, r.Name
					return true
				}
			}
			return false
		})
		var pid int
		for _, r := range f.records() {
			if r.Name == curName {
				pid = r.PID
			}
		}
		if pid == 0 {
			b.Fatalf("no process for %s", curName)
		}
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			b.Fatalf("pidfd: %v", err)
		}
		f.push(fmt.Sprintf("name: ci\non: [push]\njobs:\n  one:\n    runs-on: %s\n    steps:\n      - run: echo %d\n", name, i))
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(fds, 120_000); n != 1 || err != nil {
			b.Fatalf("runner %s did not exit: %v", curName, err)
		}
		exited := time.Now()
		unix.Close(fd)
		lat = append(lat, f.waitReplacement(curID, exited))
	}
	b.StopTimer()
	if err := f.stop(time.Minute); err != nil {
		b.Error(err)
	}
	reportLatencies(b, lat)
	b.Logf("replenish latencies over %d jobs: %v", len(lat), lat)
}

// percentile returns the p-th percentile (0..1) of d, which it sorts.
func percentile(d []time.Duration, p float64) time.Duration {
	slices.Sort(d)
	return d[min(len(d)-1, int(p*float64(len(d))))]
}

// reportLatencies reports p50, p95 and the maximum, in milliseconds.
func reportLatencies(b *testing.B, lat []time.Duration) {
	b.ReportMetric(float64(percentile(lat, 0.50).Milliseconds()), "p50-ms")
	b.ReportMetric(float64(percentile(lat, 0.95).Milliseconds()), "p95-ms")
	b.ReportMetric(float64(percentile(lat, 1).Milliseconds()), "max-ms")
}

// waitReplacement polls Gitea every 10ms until a runner registered after
// the one with id curID is online and idle, and returns the time since
// exited.
func (f *fleet) waitReplacement(curID int64, exited time.Time) time.Duration {
	f.t.Helper()
	for {
		for _, r := range f.runners() {
			if r.ID > curID && r.Status == "online" && !r.Busy {
				return time.Since(exited)
			}
		}
		if time.Since(exited) > time.Minute {
			f.t.Fatal("no replacement within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
