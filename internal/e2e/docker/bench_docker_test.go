package docker

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/provider/docker"
)

// BenchmarkReplenishDocker measures a Docker slot's refill: from the
// engine's die event of a runner container after its job until the
// replacement container's runner is registered and idle at Gitea. Next to
// it, the floor in the same run: creating and starting a container of the
// same image with AutoRemove (what `docker run --rm` does) until its
// process has started, and one forge API call (listing the runners).
//
//	go test ./internal/e2e -run '^$' -bench ReplenishDocker -benchtime 20x
func BenchmarkReplenishDocker(b *testing.B) {
	img := harness.NeedDocker(b)
	name := fmt.Sprintf("dbench-%d", b.N)
	f := harness.NewFleet(b, name, harness.FleetOptions{Size: 1, Docker: "      image: " + img + "\n"})
	f.Start()
	harness.Eventually(b, time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	ctx := context.Background()
	var lat []time.Duration
	for i := range b.N {
		var curID int64
		harness.Eventually(b, time.Minute, "an idle runner", func() bool {
			for _, r := range f.Runners() {
				if r.Status == "online" && !r.Busy {
					curID = r.ID
					return true
				}
			}
			return false
		})
		evctx, cancel := context.WithCancel(ctx)
		ev := harness.DockerCli.Events(evctx, client.EventsListOptions{Filters: make(client.Filters).
			Add("type", "container").Add("event", "die").Add("label", docker.LabelManager+"=e2e-"+name)})
		f.Push(fmt.Sprintf("name: ci\non: [push]\njobs:\n  one:\n    runs-on: %s\n    steps:\n      - run: echo %d\n", name, i))
		select {
		case <-ev.Messages:
		case err := <-ev.Err:
			b.Fatalf("events: %v", err)
		case <-time.After(2 * time.Minute):
			b.Fatal("runner container did not exit")
		}
		exited := time.Now()
		cancel()
		lat = append(lat, f.WaitReplacement(curID, exited))
	}
	b.StopTimer()
	if err := f.Stop(time.Minute); err != nil {
		b.Error(err)
	}

	// The floor, measured now on the same engine and image.
	var floor, api []time.Duration
	for range max(b.N, 20) {
		start := time.Now()
		res, err := harness.DockerCli.ContainerCreate(ctx, client.ContainerCreateOptions{
			Config:     &container.Config{Image: img, Cmd: []string{"true"}},
			HostConfig: &container.HostConfig{AutoRemove: true},
		})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := harness.DockerCli.ContainerStart(ctx, res.ID, client.ContainerStartOptions{}); err != nil {
			b.Fatal(err)
		}
		floor = append(floor, time.Since(start))
		start = time.Now()
		f.Runners()
		api = append(api, time.Since(start))
	}
	p50 := func(d []time.Duration) time.Duration { return harness.Percentile(d, 0.50) }
	p95 := func(d []time.Duration) time.Duration { return harness.Percentile(d, 0.95) }
	b.ReportMetric(float64(p50(lat).Milliseconds()), "p50-ms")
	b.ReportMetric(float64(p95(lat).Milliseconds()), "p95-ms")
	b.ReportMetric(float64(p50(floor).Milliseconds()), "floor-p50-ms")
	b.ReportMetric(float64(p50(api).Milliseconds()), "api-p50-ms")
	target := time.Duration(1.2*float64(p50(floor))) + p50(api)
	b.Logf("latencies: %v", lat)
	b.Logf("replenish over %d jobs: p50 %s p95 %s; floor (create+start, AutoRemove) p50 %s p95 %s; forge call p50 %s; target 1.2×floor+call = %s",
		len(lat), p50(lat), p95(lat), p50(floor), p95(floor), p50(api), target)
}
