package tally

import (
	"testing"
	"time"

	"github.com/runfleet/runfleet/record"
)

var t0 = time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)

func at(min float64) time.Time { return t0.Add(time.Duration(min * float64(time.Minute))) }

// rec is a runner made at c, online at o, busy at b, ended at e (minutes
// from t0; negative: never).
func rec(id, pool string, c, o, b, e float64) record.Record {
	r := record.Record{ID: id, Runner: id, Pool: pool, Forge: "f", Created: at(c)}
	if o >= 0 {
		r.Online = at(o)
	}
	if b >= 0 {
		r.JobStarted = at(b)
		r.Job = &record.Job{ID: 1, Name: "job " + id, Queued: at(b - 1), Started: at(b), Status: "in_progress"}
	}
	if e >= 0 {
		r.Ended = at(e)
		if r.Job != nil {
			r.Job.Completed, r.Job.Status, r.Job.Conclusion = at(e), "completed", "success"
		}
	}
	return r
}

func TestStateSeriesAveragesEachInterval(t *testing.T) {
	entries := []Entry{
		EntryOf(rec("a", "p", 0, 2, 5, 10)),  // starting 0-2, idle 2-5, busy 5-10
		EntryOf(rec("b", "p", 3, -1, 4, -1)), // starting 3-4, busy from 4 on, not ended
		EntryOf(rec("c", "q", 0, 1, -1, -1)), // another pool's
		EntryOf(rec("d", "p", 6, 7, -1, 8)),  // starting 6-7, idle 7-8, then gone without a job
		// Lived 3 seconds, in the 12th minute: counted for its share.
		EntryOf(record.Record{ID: "e", Pool: "p", Created: at(11.5), Ended: at(11.55)}),
	}
	now := at(12.5) // the last interval is half over
	got := StateSeries(entries, "p", at(0), 5*time.Minute, 3, now)
	want := []States{
		// 0-5: a starting 2 min, idle 3; b starting 1, busy 1.
		{Starting: 3.0 / 5, Idle: 3.0 / 5, Busy: 1.0 / 5},
		// 5-10: a busy 5; b busy 5; d starting 1, idle 1.
		{Starting: 1.0 / 5, Idle: 1.0 / 5, Busy: 2},
		// 10-12.5: b busy 2.5 minutes; e starting 3 s.
		{Starting: hundredths(0.05 / 5), Busy: 0.5},
	}
	for i := range want {
		want[i].At = at(float64(5 * i))
		want[i].Starting, want[i].Idle, want[i].Busy = hundredths(want[i].Starting), hundredths(want[i].Idle), hundredths(want[i].Busy)
		if got[i] != want[i] {
			t.Errorf("interval %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	// Every pool's: c is idle from minute 1 on.
	if all := StateSeries(entries, "", at(0), 5*time.Minute, 3, now); all[0].Idle != hundredths(3.0/5+4.0/5) || all[2].Idle != 0.5 {
		t.Errorf("every pool's: %+v", all)
	}
}

func TestWaitsSpreadByInterval(t *testing.T) {
	var entries []Entry
	// Ten jobs started in the first ten minutes, waiting 1..10 s; each
	// ran 60 s.
	for i := 1; i <= 10; i++ {
		r := rec("r", "p", 0, 0, float64(i), float64(i)+1)
		r.Job.Queued = r.Job.Started.Add(-time.Duration(i) * time.Second)
		entries = append(entries, EntryOf(r))
	}
	waited, ran := Waits(entries, "p", at(0), at(20), 10*time.Minute)
	if len(waited) != 2 || waited[0].N != 9 || waited[1].N != 1 {
		t.Fatalf("waited %+v: want 9 jobs started in the first interval, 1 in the second", waited)
	}
	if waited[0].P50 != 5*time.Second || waited[0].P95 != 9*time.Second {
		t.Errorf("p50 %s, p95 %s: want 5s and 9s (nearest rank over 1..9 s)", waited[0].P50, waited[0].P95)
	}
	if ran[0].N != 8 || ran[0].P50 != time.Minute || ran[1].N != 2 {
		t.Errorf("ran %+v: want 8 ended in the first interval, of a minute each", ran)
	}
}

func TestQuantile(t *testing.T) {
	ds := []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}
	for q, want := range map[float64]time.Duration{0.5: 10, 0.95: 19, 1: 20, 0: 1} {
		if got := Quantile(ds, q); got != want {
			t.Errorf("q%v = %d, want %d", q, got, want)
		}
	}
	if Quantile(nil, 0.5) != 0 {
		t.Error("the quantile of nothing is not 0")
	}
}

func TestSumByAndCost(t *testing.T) {
	price := func(r record.Record, v float64, cur string) record.Record {
		r.Price = &record.Price{PerHour: v, Currency: cur}
		return r
	}
	a := price(rec("a", "p", 0, 0, 10, 70), 3, "USD") // 70 min at 3/h = 3.5
	a.GPUs = []record.GPU{{ID: "g0"}, {ID: "g1"}}     // 2 GPUs × 70 min
	b := price(rec("b", "p", 0, 0, -1, 30), 3, "USD") // 30 min, no job: 1.5
	c := rec("c", "q", 0, 0, 5, 60)                   // no price
	d := price(rec("d", "q", 0, 0, 5, 60), 1, "EUR")  // 1 EUR
	a.Labels, b.Labels, c.Labels = []string{"gpu", "linux"}, []string{"linux"}, nil
	sums, err := SumBy([]record.Record{a, b, c, d}, "pool", at(100))
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string]Sum{}
	for _, s := range sums {
		byKey[s.Key+"/"+s.Currency] = s
	}
	if p := byKey["p/USD"]; p.Runners != 2 || p.Jobs != 1 || !near(p.Cost, 5) || !near(p.Hours, 100.0/60) || !near(p.GPUHours, 140.0/60) {
		t.Errorf("pool p: %+v", p)
	}
	if q := byKey["q/"]; q.Unpriced != 1 || q.Cost != 0 || byKey["q/EUR"].Cost != 1 {
		t.Errorf("pool q: %+v and %+v: want the unpriced and the EUR runner apart", q, byKey["q/EUR"])
	}
	if sums[0].Key != "p" {
		t.Errorf("the costliest is not first: %+v", sums)
	}
	a.Job.Repository, c.Job.Repository = "acme/models", "acme/models"
	repos, _ := SumBy([]record.Record{a, b, c}, "repository", at(100))
	// c has no price: it is summed apart from a, under the same key.
	if len(repos) != 3 || repos[0].Key != "acme/models" || repos[0].Runners != 1 || !near(repos[0].Cost, 3.5) || repos[1].Key != "-" ||
		repos[2].Key != "acme/models" || repos[2].Unpriced != 1 {
		t.Errorf("by repository: %+v", repos)
	}
	labels, _ := SumBy([]record.Record{a, b, c}, "label", at(100))
	for _, s := range labels {
		if s.Key == "linux" && (s.Runners != 2 || !near(s.Cost, 5)) || s.Key == "-" && s.Runners != 1 {
			t.Errorf("label %+v", s)
		}
	}
	if _, err := SumBy(nil, "colour", at(0)); err == nil {
		t.Error("a sum by an unknown key was not refused")
	}
	// Only the part within the interval counts.
	cost := CostSince([]Entry{EntryOf(a)}, at(40), at(100))
	if got := cost["p"]; !near(got.Cost, 1.5) || !near(got.GPUHours, 1) || got.Currency != "USD" {
		t.Errorf("since minute 40: %+v, want 30 min at 3/h and 2 GPUs for 30 min", got)
	}
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }

func TestWindowFollowsTheHistory(t *testing.T) {
	var ended []Entry
	var late []string
	w := NewWindow(24*time.Hour, func(e Entry, priceOnly bool) {
		if priceOnly {
			late = append(late, e.ID)
			return
		}
		ended = append(ended, e)
	})
	w.now = func() time.Time { return at(60) }
	old := rec("old", "p", -2*24*60, 0, -1, -1) // made two days ago: past the span
	done := rec("done", "p", 5, 6, 7, 8)
	done.Registration = 7
	w.Load([]record.Record{done, old})
	if w.Len() != 2 || len(ended) != 0 {
		t.Fatalf("after Load: %d entries, %d told ended: want 2, and none told", w.Len(), len(ended))
	}
	live := rec("live", "p", 10, 11, -1, -1)
	live.Registration = 9
	w.Observe(live, false)
	if w.Len() != 2 {
		t.Errorf("%d entries: the two-day-old one was not dropped", w.Len())
	}
	if id := w.Find("f", 9); id != "live" {
		t.Errorf("registration 9 is %q", id)
	}
	// The runner takes a job and ends: told once, with its cost.
	live = rec("live", "p", 10, 11, 12, 40)
	live.Registration = 9
	w.Observe(live, false)
	w.Observe(live, false)
	if len(ended) != 1 || ended[0].ID != "live" {
		t.Errorf("told ended: %+v, want live once", ended)
	}
	// Its price, read from a price list after it ended, is told once,
	// as the price alone.
	live.Price = &record.Price{PerHour: 2, Currency: "USD", Source: "aws price list"}
	w.Observe(live, false)
	w.Observe(live, false)
	if len(ended) != 1 || len(late) != 1 || late[0] != "live" {
		t.Errorf("priced after its end: told ended %d times, priced late %v; want once and [live]", len(ended), late)
	}
	// An entry made earlier than the last comes before it.
	early := rec("early", "p", 1, -1, -1, -1)
	w.Observe(early, false)
	if s := w.Since(at(0)); len(s) != 3 || s[0].ID != "early" || s[2].ID != "live" {
		t.Errorf("order: %v", s)
	}
	w.Observe(record.Record{ID: "done"}, true)
	if w.Find("f", 7) != "" || w.Len() != 2 {
		t.Error("a dropped record stays")
	}
}
