package gitea

import (
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkReplenish measures a slot's refill: from the moment a runner's
// agent exits after its job until its replacement is registered and idle
// (online, no job) at Gitea. Jobs run one at a time so that the
// replacement's idle state is observable. Reports p50 and p95.
//
//	go test ./internal/e2e -run '^$' -bench Replenish -benchtime 20x
func BenchmarkReplenish(b *testing.B) {
	name := fmt.Sprintf("bench-%d", b.N) // the benchmark runs once per b.N
	f := harness.NewFleet(b, name, harness.FleetOptions{Size: 1})
	f.Start()
	harness.Eventually(b, time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	var lat []time.Duration
	for i := range b.N {
		var curID int64
		var curName string
		harness.Eventually(b, time.Minute, "an idle runner", func() bool {
			for _, r := range f.Runners() {
				if r.Status == "online" && !r.Busy {
					curID, curName = r.ID, r.Name
					return true
				}
			}
			return false
		})
		var pid int
		for _, r := range f.Records() {
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
		f.Push(fmt.Sprintf("name: ci\non: [push]\njobs:\n  one:\n    runs-on: %s\n    steps:\n      - run: echo %d\n", name, i))
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(fds, 120_000); n != 1 || err != nil {
			b.Fatalf("runner %s did not exit: %v", curName, err)
		}
		exited := time.Now()
		unix.Close(fd)
		lat = append(lat, f.WaitReplacement(curID, exited))
	}
	b.StopTimer()
	if err := f.Stop(time.Minute); err != nil {
		b.Error(err)
	}
	harness.ReportLatencies(b, lat)
	b.Logf("replenish latencies over %d jobs: %v", len(lat), lat)
}
