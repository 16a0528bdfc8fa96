package gitea

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// FuzzAnswers gives the driver arbitrary answers to its listings of
// runners and jobs, seeded with odd-but-valid shapes (empty pages, nulls,
// unknown fields, huge labels): it never panics, and what it returns is
// either an error or runners and jobs with a known status.
func FuzzAnswers(f *testing.F) {
	f.Add(`{"runners":[{"id":7,"name":"p-1","status":"online","busy":false,"disabled":false,"labels":[{"id":1,"name":"gpu","type":"custom"}]}],"total_count":1}`,
		`{"jobs":[{"id":9,"run_id":3,"name":"train","status":"waiting","labels":["gpu"],"runner_id":0,"created_at":"2026-11-22T12:00:00Z"}],"total_count":1}`)
	f.Add(`{"runners":[],"total_count":0}`, `{"jobs":[],"total_count":0}`)
	f.Add(`{"runners":null}`, `{"jobs":null}`)
	f.Add(`{"runners":[{"id":7,"name":null,"labels":null,"version":"v1","ephemeral":true,"new":{"a":1}}]}`,
		`{"jobs":[{"id":9,"status":"queued","labels":["`+strings.Repeat("l", 70000)+`"],"started_at":"0001-01-01T00:00:00Z"}]}`)
	f.Add(`[]`, `{"jobs":[{"id":"nine"}]}`)
	f.Fuzz(func(t *testing.T, runners, jobs string) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			switch {
			case strings.HasSuffix(r.URL.Path, "/actions/runners"):
				_, _ = w.Write([]byte(runners))
			case strings.HasSuffix(r.URL.Path, "/actions/jobs"):
				_, _ = w.Write([]byte(jobs))
			default:
				w.WriteHeader(http.StatusNotFound)
			}
		}))
		defer srv.Close()
		d := New(Config{URL: srv.URL, Token: "t", Scope: Scope{Kind: "repo", Owner: "a", Repo: "b"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if rs, err := d.Runners(ctx); err == nil {
			for _, r := range rs {
				if r.Status != forge.StatusIdle && r.Status != forge.StatusBusy && r.Status != forge.StatusOffline {
					t.Fatalf("runner %+v has no status", r)
				}
			}
		}
		for _, st := range []forge.JobStatus{forge.JobQueued, forge.JobInProgress} {
			if js, err := d.Jobs(ctx, st); err == nil {
				for _, j := range js {
					if j.Status != st {
						t.Fatalf("listed as %s: %+v", st, j)
					}
				}
			}
		}
	})
}
