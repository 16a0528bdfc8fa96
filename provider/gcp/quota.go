package gcp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Compute Engine's rate quotas ("Compute Engine rate quotas",
// docs.cloud.google.com/compute/docs/api-rate-limits, and "Use simplified
// API quota metrics"): each request counts in one group, per project and
// minute; a zonal or regional method's group is its region's, so the
// calls of one region do not spend another's. The groups runfleet's calls
// fall in:
//
//   - reads_per_region: instances.get and list, zoneOperations.get and
//     wait (wait was "heavy-weight reads per region" before the groups
//     were simplified; it is one of them still);
//   - writes_per_region: instances.insert and delete, disks.delete;
//   - global_reads: the aggregatedList methods (the heavy-weight reads
//     of old) and global gets;
//   - global_writes: global mutations (none of runfleet's).
//
// Google no longer prints the defaults; 1,500 a minute was each legacy
// group's (the simplified groups "offer higher limits"), so it is the
// floor assumed, and a project whose quotas differ says so in
// request_quotas. A quota refills at the start of each minute, whatever
// was spent in it: a project that has spent one (another manager, gcloud,
// the console) is answered 403 rateLimitExceeded until then, so after
// such an answer the group's requests wait for the next minute rather
// than being sent to be refused.
const (
	QuotaReadsPerRegion  = "reads_per_region"
	QuotaWritesPerRegion = "writes_per_region"
	QuotaGlobalReads     = "global_reads"
	QuotaGlobalWrites    = "global_writes"
)

// QuotaPerMinute is the assumed default of each group.
const QuotaPerMinute = 1500

// quotaGroups are the groups request_quotas may name.
var quotaGroups = []string{QuotaReadsPerRegion, QuotaWritesPerRegion, QuotaGlobalReads, QuotaGlobalWrites}

// quota is a group, and for a regional one its region.
type quota struct{ group, region string }

func (q quota) String() string {
	if q.region == "" {
		return q.group
	}
	return q.group + " in " + q.region
}

// quotaOf is the group a request to the Compute Engine API counts in.
func quotaOf(r *http.Request) quota {
	read := r.Method == http.MethodGet || strings.HasSuffix(r.URL.Path, "/wait")
	region := ""
	parts := strings.Split(r.URL.Path, "/")
	for i := 0; i+1 < len(parts) && region == ""; i++ {
		switch parts[i] {
		case "zones":
			region = regionOf(parts[i+1])
		case "regions":
			region = parts[i+1]
		}
	}
	switch {
	case region != "" && read:
		return quota{QuotaReadsPerRegion, region}
	case region != "":
		return quota{QuotaWritesPerRegion, region}
	case read:
		return quota{group: QuotaGlobalReads}
	}
	return quota{group: QuotaGlobalWrites}
}

// regionOf is a zone's region (us-central1-a: us-central1).
func regionOf(zone string) string {
	if i := strings.LastIndexByte(zone, '-'); i > 0 {
		return zone[:i]
	}
	return zone
}

// Limits keeps a manager's requests within a project's rate quotas,
// group by group and region by region. A bucket of 75 refilled at the
// minute's quota less 75 never sends more than the quota in any one
// minute. Pools of one project share them.
type Limits struct {
	perMinute map[string]int
	now       func() time.Time

	mu   sync.Mutex
	lims map[quota]*rate.Limiter
	held map[quota]time.Time // refused until then: the next minute's start
}

// NewLimits is Compute Engine's default quotas.
func NewLimits() *Limits { return newLimits(nil, time.Now) }

func newLimits(perMinute map[string]int, now func() time.Time) *Limits {
	return &Limits{perMinute: perMinute, now: now, lims: map[quota]*rate.Limiter{}, held: map[quota]time.Time{}}
}

// QuotaHeldError is a request not sent: its group's quota was spent this
// minute.
type QuotaHeldError struct {
	Quota string
	Until time.Time
}

func (e *QuotaHeldError) Error() string {
	return fmt.Sprintf("Compute Engine's %s request quota is spent until %s; not sent", e.Quota, e.Until.Format(time.TimeOnly))
}

// wait waits for the request's turn in its group; a group held until
// after ctx's deadline fails at once.
func (l *Limits) wait(ctx context.Context, q quota) error {
	l.mu.Lock()
	until := l.held[q]
	lim, ok := l.lims[q]
	if !ok {
		n := max(l.perMinute[q.group], 0)
		if n == 0 {
			n = QuotaPerMinute
		}
		burst := min(75, n)
		lim = rate.NewLimiter(rate.Limit(float64(max(n-burst, 1))/60), burst)
		l.lims[q] = lim
	}
	l.mu.Unlock()
	if d := until.Sub(l.now()); d > 0 {
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
			return &QuotaHeldError{Quota: q.String(), Until: until}
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
	return lim.Wait(ctx)
}

// hold refuses the group's requests until the next minute's start.
func (l *Limits) hold(q quota) {
	until := l.now().Truncate(time.Minute).Add(time.Minute)
	l.mu.Lock()
	if until.After(l.held[q]) {
		l.held[q] = until
	}
	l.mu.Unlock()
}

// rateLimited says whether an answer is Compute Engine's 403
// rateLimitExceeded, leaving its body to be read again.
func rateLimited(res *http.Response) bool {
	if res.StatusCode != http.StatusForbidden && res.StatusCode != http.StatusTooManyRequests {
		return false
	}
	b, err := io.ReadAll(io.LimitReader(res.Body, 64<<10))
	res.Body.Close()
	res.Body = io.NopCloser(bytes.NewReader(b))
	if err != nil {
		return false
	}
	var body struct {
		Error struct {
			Errors []struct {
				Reason string `json:"reason"`
			} `json:"errors"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &body) != nil {
		return false
	}
	for _, e := range body.Error.Errors {
		if e.Reason == "rateLimitExceeded" || e.Reason == "userRateLimitExceeded" {
			return true
		}
	}
	return false
}

// checkQuotas checks request_quotas' groups and numbers.
func checkQuotas(q map[string]int) error {
	var bad []string
	for k, v := range q {
		if !slices.Contains(quotaGroups, k) {
			bad = append(bad, fmt.Sprintf("%q is not a quota group (%s)", k, strings.Join(quotaGroups, ", ")))
		} else if v < 1 {
			bad = append(bad, fmt.Sprintf("%s: %d requests a minute; want at least 1", k, v))
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		return fmt.Errorf("request_quotas: %s", strings.Join(bad, "; "))
	}
	return nil
}
