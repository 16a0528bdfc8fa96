package gcp

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"
)

// Each call counts in the group the rate quota docs put it in, a zonal
// method in its region's.
func TestQuotaOf(t *testing.T) {
	const p = "https://compute.googleapis.com/compute/v1/projects/p"
	for _, c := range []struct{ method, path, want string }{
		{"POST", "/zones/us-central1-a/instances", "writes_per_region in us-central1"},
		{"DELETE", "/zones/europe-west1-d/instances/x", "writes_per_region in europe-west1"},
		{"DELETE", "/zones/europe-west1-d/disks/x", "writes_per_region in europe-west1"},
		{"POST", "/zones/us-central1-b/operations/op-1/wait", "reads_per_region in us-central1"},
		{"GET", "/zones/us-central1-b/operations/op-1", "reads_per_region in us-central1"},
		{"GET", "/zones/us-east1-c/instances/x", "reads_per_region in us-east1"},
		{"GET", "/aggregated/instances", "global_reads"},
		{"GET", "/aggregated/operations", "global_reads"},
		{"POST", "/global/images", "global_writes"},
	} {
		if got := quotaOf(httptest.NewRequest(c.method, p+c.path, nil)).String(); got != c.want {
			t.Errorf("%s %s: %s, want %s", c.method, c.path, got, c.want)
		}
	}
}

// After a refusal the group waits for the next minute's start, when the
// quota refills; its other regions and the other groups do not.
func TestHeldUntilTheNextMinute(t *testing.T) {
	now := time.Date(2026, 11, 27, 12, 0, 59, 800_000_000, time.UTC)
	l := newLimits(map[string]int{QuotaWritesPerRegion: 600}, func() time.Time { return now })
	held := quota{QuotaWritesPerRegion, "us-central1"}
	l.hold(held)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err, ok := l.wait(ctx, held).(*QuotaHeldError); !ok || !err.Until.Equal(now.Truncate(time.Minute).Add(time.Minute)) {
		t.Errorf("held group within a short deadline: %v, want held until 12:01:00", err)
	}
	for _, q := range []quota{{QuotaWritesPerRegion, "europe-west1"}, {QuotaReadsPerRegion, "us-central1"}, {group: QuotaGlobalReads}} {
		if err := l.wait(ctx, q); err != nil {
			t.Errorf("%s: %v", q, err)
		}
	}
	start := time.Now()
	if err := l.wait(context.Background(), held); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited < 150*time.Millisecond {
		t.Errorf("sent after %s, before the minute's end (200 ms away)", waited)
	}
	if lim := l.lims[held]; lim.Burst() != 75 || lim.Limit() != 525.0/60 {
		t.Errorf("600 a minute: burst %d at %v/s, want 75 and then 525 a minute", lim.Burst(), lim.Limit())
	}
}
