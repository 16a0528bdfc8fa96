package tally

import (
	"math"
	"slices"
	"time"
)

// States is how many runners were in each state over one interval, on
// average: the time each spent in it over the interval's length, so that
// runners that live seconds count for what they held, however short.
type States struct {
	At                   time.Time // the interval's start
	Starting, Idle, Busy float64
}

// Spans are the times an entry's runner spent starting (from its creation
// until it came online, or took its job where no pass saw it idle), idle
// (until it took its job) and busy (until it ended); an entry not ended
// lasts until now. A zero-length span is none.
func (e Entry) Spans(now time.Time) (starting, idle, busy [2]time.Time) {
	end := e.Ended
	if end.IsZero() || end.After(now) {
		end = now
	}
	clip := func(t time.Time) time.Time {
		switch {
		case t.Before(e.Created):
			return e.Created
		case t.After(end):
			return end
		}
		return t
	}
	busyFrom, idleFrom := end, end
	if !e.JobStarted.IsZero() {
		busyFrom = clip(e.JobStarted)
	}
	idleFrom = busyFrom
	if !e.Online.IsZero() && e.Online.Before(busyFrom) {
		idleFrom = clip(e.Online)
	}
	return [2]time.Time{e.Created, idleFrom}, [2]time.Time{idleFrom, busyFrom}, [2]time.Time{busyFrom, end}
}

// StateSeries gives, for n intervals of step from `from` (the last ending
// no later than now), the pool's runners by state on average over each
// ("" pool: every pool's), rounded to hundredths.
func StateSeries(entries []Entry, pool string, from time.Time, step time.Duration, n int, now time.Time) []States {
	if step <= 0 || n <= 0 {
		return nil
	}
	out := make([]States, n)
	for i := range out {
		out[i].At = from.Add(time.Duration(i) * step)
	}
	to := from.Add(time.Duration(n) * step)
	for _, e := range entries {
		if pool != "" && e.Pool != pool || !e.Ended.IsZero() && !e.Ended.After(from) || !e.Created.Before(to) {
			continue
		}
		starting, idle, busy := e.Spans(now)
		for _, sp := range []struct {
			span [2]time.Time
			add  func(*States, float64)
		}{
			{starting, func(s *States, v float64) { s.Starting += v }},
			{idle, func(s *States, v float64) { s.Idle += v }},
			{busy, func(s *States, v float64) { s.Busy += v }},
		} {
			a, b := sp.span[0], sp.span[1]
			if !b.After(a) || !b.After(from) || !a.Before(to) {
				continue
			}
			first := max(0, int(a.Sub(from)/step))
			for i := first; i < n && out[i].At.Before(b); i++ {
				lo, hi := out[i].At, out[i].At.Add(step)
				lo, hi = later(lo, a), earlier(hi, b)
				if hi.After(lo) {
					sp.add(&out[i], float64(hi.Sub(lo))/float64(step))
				}
			}
		}
	}
	for i := range out {
		out[i].Starting, out[i].Idle, out[i].Busy = hundredths(out[i].Starting), hundredths(out[i].Idle), hundredths(out[i].Busy)
	}
	return out
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

func hundredths(v float64) float64 { return math.Round(v*100) / 100 }

// Spread is a quantity's median and 95th percentile over one interval.
type Spread struct {
	At       time.Time // the interval's start
	N        int       // how many were measured; 0: P50 and P95 mean nothing
	P50, P95 time.Duration
}

// Waits gives, per interval of step from `from` to `to`, the spread of
// how long the pool's jobs waited for a runner (queued to started, by
// when they started) and of how long they ran (by when they completed).
func Waits(entries []Entry, pool string, from, to time.Time, step time.Duration) (waited, ran []Spread) {
	if step <= 0 || !to.After(from) {
		return nil, nil
	}
	n := int((to.Sub(from) + step - 1) / step)
	w, r := make([][]time.Duration, n), make([][]time.Duration, n)
	bin := func(t time.Time) int {
		if t.Before(from) || !t.Before(to) {
			return -1
		}
		return int(t.Sub(from) / step)
	}
	for _, e := range entries {
		j := e.Job
		if j == nil || pool != "" && e.Pool != pool {
			continue
		}
		if i := bin(j.Started); i >= 0 && !j.Queued.IsZero() && !j.Started.Before(j.Queued) {
			w[i] = append(w[i], j.Started.Sub(j.Queued))
		}
		if i := bin(j.Completed); i >= 0 && !j.Started.IsZero() && !j.Completed.Before(j.Started) {
			r[i] = append(r[i], j.Completed.Sub(j.Started))
		}
	}
	spread := func(ds [][]time.Duration) []Spread {
		out := make([]Spread, n)
		for i, d := range ds {
			out[i] = Spread{At: from.Add(time.Duration(i) * step), N: len(d)}
			if len(d) > 0 {
				slices.Sort(d)
				out[i].P50, out[i].P95 = Quantile(d, 0.5), Quantile(d, 0.95)
			}
		}
		return out
	}
	return spread(w), spread(r)
}

// Quantile is the q-quantile of sorted ds by the nearest rank: the
// smallest value at least a fraction q of them are at or below.
func Quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	i := int(q*float64(len(ds))+0.999999) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}
