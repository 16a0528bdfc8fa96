package harness

import (
	"slices"
	"testing"
	"time"
)

// Percentile returns the p-th percentile (0..1) of d, which it sorts.
func Percentile(d []time.Duration, p float64) time.Duration {
	slices.Sort(d)
	return d[min(len(d)-1, int(p*float64(len(d))))]
}

// ReportLatencies reports p50, p95 and the maximum, in milliseconds.
func ReportLatencies(b *testing.B, lat []time.Duration) {
	b.ReportMetric(float64(Percentile(lat, 0.50).Milliseconds()), "p50-ms")
	b.ReportMetric(float64(Percentile(lat, 0.95).Milliseconds()), "p95-ms")
	b.ReportMetric(float64(Percentile(lat, 1).Milliseconds()), "max-ms")
}

// WaitReplacement polls Gitea every 10ms until a runner registered after
// the one with id curID is online and idle, and returns the time since
// exited.
func (f *Fleet) WaitReplacement(curID int64, exited time.Time) time.Duration {
	f.T.Helper()
	for {
		for _, r := range f.Runners() {
			if r.ID > curID && r.Status == "online" && !r.Busy {
				return time.Since(exited)
			}
		}
		if time.Since(exited) > time.Minute {
			f.T.Fatal("no replacement within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
