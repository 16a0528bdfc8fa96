package gitea

import (
	"fmt"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkScaleFromZero measures how long a job waits for a runner when
// its pool has none: a pool of size 0 (max 4), fed by Gitea's webhooks
// (with polling every 2s behind them); each iteration pushes a workflow of
// one job and times it from when Gitea's API first lists it queued until
// it lists it in progress (polled every 20ms), then waits for the pool to
// be back at zero. Host processes and containers; reports p50 and p95.
//
//	go test ./internal/e2e -run '^$' -bench ScaleFromZero -benchtime 20x
func BenchmarkScaleFromZero(b *testing.B) {
	for _, mode := range []string{"process", "docker"} {
		b.Run(mode, func(b *testing.B) {
			name := fmt.Sprintf("sfz%s-%d", mode[:1], b.N)
			var f *harness.Fleet
			if mode == "docker" {
				f, _ = harness.ScaleFleet(b, name, true, true, "      image: "+harness.NeedDocker(b)+"\n")
			} else {
				f, _ = harness.ScaleFleet(b, name, true, true)
			}
			f.Start()
			time.Sleep(2 * time.Second)
			var lat []time.Duration
			for i := range b.N {
				prev := int64(0)
				for _, j := range f.Jobs() {
					prev = max(prev, j.RunID)
				}
				f.Push(fmt.Sprintf("name: ci\non: [push]\njobs:\n  one:\n    runs-on: %s\n    steps:\n      - run: echo %d\n", name, i))
				var queued, started time.Time
				deadline := time.Now().Add(2 * time.Minute)
				for started.IsZero() {
					if time.Now().After(deadline) {
						b.Fatalf("job %d did not start", i)
					}
					for _, j := range f.Jobs() {
						if j.RunID <= prev {
							continue
						}
						now := time.Now()
						if queued.IsZero() {
							queued = now
						}
						if j.Status != "queued" && j.Status != "waiting" {
							started = now
						}
					}
					time.Sleep(20 * time.Millisecond)
				}
				lat = append(lat, started.Sub(queued))
				harness.Eventually(b, 2*time.Minute, "the job done and no runner left", func() bool {
					done := true
					for _, j := range f.Jobs() {
						done = done && j.Status == "completed"
					}
					return done && len(f.Runners()) == 0
				})
			}
			b.StopTimer()
			if err := f.Stop(time.Minute); err != nil {
				b.Error(err)
			}
			harness.ReportLatencies(b, lat)
			b.Logf("%s: queued→in_progress over %d jobs: %v", mode, len(lat), lat)
		})
	}
}
