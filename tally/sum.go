package tally

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/runfleet/runfleet/record"
)

// Sum is what the records of one key (a pool, a label, ...) held and cost.
type Sum struct {
	Key      string  `json:"key"`
	Runners  int     `json:"runners"`
	Jobs     int     `json:"jobs"`
	Hours    float64 `json:"hours"`     // machine time held
	GPUHours float64 `json:"gpu_hours"` // GPU time held
	Cost     float64 `json:"cost"`
	Currency string  `json:"currency,omitempty"`
	// Unpriced counts the runners whose machine had no price: their hours
	// are in Hours, and nothing of them in Cost.
	Unpriced int `json:"unpriced,omitempty"`
}

// Keys are what SumBy sums by.
var Keys = []string{"pool", "repository", "label", "forge", "provider", "machine", "result"}

// keyOf returns the keys a record is summed under: a record with several
// labels counts under each.
func keyOf(by string, r record.Record) ([]string, error) {
	switch by {
	case "pool":
		return []string{r.Pool}, nil
	case "forge":
		return []string{r.Forge}, nil
	case "provider":
		return []string{r.Provider}, nil
	case "machine":
		return []string{cmp.Or(r.Machine.InstanceType, r.Machine.Node, r.Machine.Host, "-")}, nil
	case "label":
		if len(r.Labels) == 0 {
			return []string{"-"}, nil
		}
		return r.Labels, nil
	case "repository":
		if r.Job == nil || r.Job.Repository == "" {
			return []string{"-"}, nil // no job, or a forge that did not say
		}
		return []string{r.Job.Repository}, nil
	case "result":
		if r.Job == nil {
			return []string{"no job"}, nil
		}
		return []string{cmp.Or(r.Job.Conclusion, r.Job.Status, "-")}, nil
	}
	return nil, fmt.Errorf("cannot sum by %q: by one of %s", by, strings.Join(Keys, ", "))
}

// SumBy sums the records by the key `by` names (one of Keys), the
// costliest first; a record still held counts up to now. Costs in
// different currencies are kept apart: the key then carries the
// currency.
func SumBy(recs []record.Record, by string, now time.Time) ([]Sum, error) {
	if _, err := keyOf(by, record.Record{}); err != nil {
		return nil, err
	}
	sums := map[string]*Sum{}
	for _, r := range recs {
		keys, _ := keyOf(by, r)
		cur := ""
		if r.Price != nil {
			cur = r.Price.Currency
		}
		for _, k := range keys {
			id := k + "\x00" + cur
			s := sums[id]
			if s == nil {
				s = &Sum{Key: k, Currency: cur}
				sums[id] = s
			}
			s.add(r, now)
		}
	}
	out := make([]Sum, 0, len(sums))
	for _, s := range sums {
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b Sum) int {
		return cmp.Or(cmp.Compare(b.Cost, a.Cost), cmp.Compare(b.Hours, a.Hours), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Currency, b.Currency))
	})
	return out, nil
}

func (s *Sum) add(r record.Record, now time.Time) {
	s.Runners++
	if r.Job != nil || !r.JobStarted.IsZero() {
		s.Jobs++
	}
	s.Hours += r.Held(now).Hours()
	s.GPUHours += r.GPUSeconds(now) / 3600
	if r.Price == nil {
		s.Unpriced++
		return
	}
	s.Cost += r.Cost(now)
}

// PoolCost is what a pool's priced runners cost over an interval, and
// the GPU time all its runners held.
type PoolCost struct {
	Cost, GPUHours float64
	Currency       string // "" while none of its runners had a price
}

// CostSince sums, by pool, what the entries cost and held from since to
// now: only the part of each machine's time within it.
func CostSince(entries []Entry, since, now time.Time) map[string]PoolCost {
	out := map[string]PoolCost{}
	for _, e := range entries {
		end := e.Ended
		if end.IsZero() || end.After(now) {
			end = now
		}
		start := e.Created
		if start.Before(since) {
			start = since
		}
		if !end.After(start) {
			continue
		}
		h := end.Sub(start).Hours()
		c := out[e.Pool]
		c.GPUHours += float64(e.GPUs) * h
		if e.Priced {
			c.Cost += e.PerHour * h
			c.Currency = cmp.Or(c.Currency, e.Currency)
		}
		out[e.Pool] = c
	}
	return out
}
