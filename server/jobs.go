package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/runfleet/runfleet/history"
)

// ParseJobsQuery reads /jobs's parameters: since (a duration back from
// now, "24h", or a time, RFC 3339), pool, all (runners that took no job
// too) and limit.
func ParseJobsQuery(v map[string][]string, now time.Time) (history.Query, error) {
	get := func(k string) string {
		if len(v[k]) == 0 {
			return ""
		}
		return v[k][0]
	}
	q := history.Query{Pool: get("pool")}
	if s := get("since"); s != "" {
		t, err := Since(s, now)
		if err != nil {
			return q, err
		}
		q.Since = t
	}
	if s := get("all"); s != "" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return q, fmt.Errorf("all: %q is not true or false", s)
		}
		q.All = b
	}
	if s := get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return q, fmt.Errorf("limit: %q is not a count", s)
		}
		q.Limit = n
	}
	return q, nil
}

// Since reads a --since value: a duration back from now ("24h") or a time
// (RFC 3339).
func Since(s string, now time.Time) (time.Time, error) {
	if d, err := duration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("since: %q is negative", s)
		}
		return now.Add(-d), nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("since: %q is neither a duration (24h, 7d) nor a time (2026-11-26T06:00:00Z)", s)
}

// duration reads Go's durations, and days before them ("7d", "1d12h"),
// which Go's lack.
func duration(s string) (time.Duration, error) {
	days, rest, ok := strings.Cut(s, "d")
	if !ok {
		return time.ParseDuration(s)
	}
	n, err := strconv.Atoi(days)
	if err != nil || n < 0 || n > 36500 {
		return 0, fmt.Errorf("%q is not a number of days", days)
	}
	d := time.Duration(n) * 24 * time.Hour
	if rest == "" {
		return d, nil
	}
	r, err := time.ParseDuration(rest)
	return d + r, err
}

// jobs serves the history's records as JSON, newest first.
func (s *server) jobs(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Jobs == nil {
		http.NotFound(w, r)
		return
	}
	q, err := ParseJobsQuery(r.URL.Query(), time.Now())
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	recs, err := s.cfg.Jobs.Jobs(q)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	writeJSON(w, recs)
}

// jobRecord serves one record.
func (s *server) jobRecord(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Jobs == nil {
		http.NotFound(w, r)
		return
	}
	rec, err := s.cfg.Jobs.JobRecord(r.PathValue("id"))
	switch {
	case errors.Is(err, history.ErrNotFound):
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	case err != nil:
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	writeJSON(w, rec)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
