package daemon_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/record"
	"github.com/runfleet/runfleet/tally"
)

// pastRecords writes n ended records of the toy pool into a history: one
// made every spread/n back from now, each online a minute after, busy a
// minute later for a job of 3 to 12 minutes, at 2 USD an hour; every
// tenth took no job.
func pastRecords(t testing.TB, path string, n int, spread time.Duration) {
	t.Helper()
	s, err := history.Open(path, history.Options{})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	for i := range n {
		c := now.Add(-spread + time.Duration(i)*spread/time.Duration(n))
		r := record.Record{
			Runner: fmt.Sprintf("past-%d", i), Registration: int64(1_000_000 + i), Manager: "toy-manager",
			Forge: "playground", ForgeType: "toy", Pool: "toys", Provider: "toy", Created: c,
			Online: c.Add(time.Minute), Price: &record.Price{PerHour: 2, Currency: "USD", Source: "price_per_hour"},
		}
		ran := time.Duration(3+i%10) * time.Minute
		r.Ended = c.Add(2*time.Minute + ran)
		if i%10 != 0 {
			r.JobStarted = c.Add(2 * time.Minute)
			r.Job = &record.Job{ID: int64(i + 1), Name: fmt.Sprintf("train (%d)", i), Status: "completed", Conclusion: "success",
				Queued: c.Add(time.Minute + 50*time.Second), Started: r.JobStarted, Completed: r.Ended}
		}
		if r.Ended.After(now) {
			r.Ended = time.Time{} // still at work
			r.Job.Completed, r.Job.Status, r.Job.Conclusion = time.Time{}, "in_progress", ""
		}
		s.Add(r)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// servePage starts the toy fleet on a state directory and returns its
// status listener's handler once the page shows the history.
func servePage(t testing.TB, state string) http.Handler {
	t.Setenv("TOY_FORGE_TOKEN", "toy-forge-secret")
	fleet, _ := toyFleetOn(t, state)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { fleet.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; fleet.Close() })
	h := fleet.StatusHandler()
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if strings.Contains(get(t, h), `href="jobs/`) {
			return h
		}
		if time.Now().After(end) {
			t.Fatal("the page never showed the history's jobs")
		}
	}
}

func get(t testing.TB, h http.Handler) string {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil))
	if w.Code != http.StatusOK {
		t.Fatalf("GET /: %d %s", w.Code, w.Body)
	}
	return w.Body.String()
}

var chartRE = regexp.MustCompile(`aria-label="runners, last hour" data-from="([^"]+)" data-step="60"`)
var seriesRE = regexp.MustCompile(`data-series="(busy|idle|starting)" data-values="([^"]*)"`)

// TestStatusPageDrawsTheHistory: the runners drawn over the last hour, by
// state, are those the history's records give at each minute; the week's
// cost is the records' price times their machines' time.
func TestStatusPageDrawsTheHistory(t *testing.T) {
	state := t.TempDir()
	path := filepath.Join(state, "history.db")
	pastRecords(t, path, 60, 2*time.Hour)
	h := servePage(t, state)
	var mismatch string
	for range 20 { // the toy pool's own runner may change between the page and the read
		page := get(t, h)
		m := chartRE.FindStringSubmatch(page)
		if m == nil {
			t.Fatalf("no hour chart on the page:\n%s", page)
		}
		from, _ := time.Parse(time.RFC3339, m[1])
		drawn := map[string][]string{}
		chart := page[strings.Index(page, m[0]):]
		chart = chart[:strings.Index(chart, "</svg>")]
		for _, s := range seriesRE.FindAllStringSubmatch(chart, -1) {
			drawn[s[1]] = strings.Fields(s[2])
		}
		ro, err := history.OpenReadOnly(path)
		if err != nil {
			t.Fatal(err)
		}
		recs, err := ro.List(history.Query{All: true})
		if err != nil {
			t.Fatal(err)
		}
		var entries []tally.Entry
		for _, r := range recs {
			entries = append(entries, tally.EntryOf(r))
		}
		want := tally.StateSeries(entries, "toys", from, time.Minute, 60, time.Now())
		mismatch = ""
		for i, w := range want {
			for name, n := range map[string]float64{"busy": w.Busy, "idle": w.Idle, "starting": w.Starting} {
				if i >= len(drawn[name]) || drawn[name][i] != strconv.FormatFloat(n, 'f', -1, 64) {
					mismatch = fmt.Sprintf("%s at %s: drawn %v, the history gives %v", name, w.At.Format("15:04"), drawn[name], n)
				}
			}
		}
		if mismatch == "" {
			if want[len(want)/2].Busy == 0 {
				t.Errorf("the history gives no busy runner half an hour ago: the records are not what the test means")
			}
			// The week's cost: 60 records of 2 USD an hour; all ended
			// but the last, which the test cannot price exactly.
			if !strings.Contains(page, "this week <b>") || !strings.Contains(page, " USD</b>") {
				t.Errorf("the page shows no week's cost")
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Error(mismatch)
}

// BenchmarkStatusPage renders the status page with 10,000 records in the
// history, over the last week, the charts drawn from them all.
func BenchmarkStatusPage(b *testing.B) {
	state := b.TempDir()
	pastRecords(b, filepath.Join(state, "history.db"), 10_000, 7*24*time.Hour-time.Hour)
	h := servePage(b, state)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		get(b, h)
	}
}
