package github_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/github"
)

// FuzzAnswers gives the driver arbitrary answers to its listings (runners,
// runs, jobs), seeded with odd-but-valid shapes GitHub's description
// allows (empty pages, nulls, unknown fields, huge labels): it never
// panics, and what it returns is either an error or runners and jobs with
// ids.
func FuzzAnswers(f *testing.F) {
	f.Add(`{"total_count":1,"runners":[{"id":7,"name":"p-1","os":"Linux","status":"online","busy":false,"labels":[{"id":1,"name":"gpu","type":"custom"}]}]}`,
		`{"total_count":1,"workflow_runs":[{"id":3,"status":"in_progress","updated_at":"2026-11-22T12:00:00Z"}]}`,
		`{"total_count":1,"jobs":[{"id":9,"run_id":3,"status":"queued","labels":["self-hosted","gpu"],"runner_id":null,"created_at":"2026-11-22T12:00:00Z"}]}`)
	f.Add(`{"total_count":0,"runners":[]}`, `{"total_count":0,"workflow_runs":[]}`, `{"total_count":0,"jobs":[]}`)
	f.Add(`{"runners":null}`, `{"workflow_runs":null}`, `{"jobs":null}`)
	f.Add(`{"total_count":1,"runners":[{"id":7,"name":null,"status":null,"labels":null,"new_field":{"x":[1,2]}}]}`,
		`{"workflow_runs":[{"id":3},{"id":null}],"extra":true}`,
		`{"jobs":[{"id":9,"status":"queued","labels":["`+strings.Repeat("l", 70000)+`"]},{"status":"queued"}]}`)
	f.Add(`[]`, `"x"`, `{"jobs":[{"id":"nine"}]}`)
	f.Fuzz(func(t *testing.T, runners, runs, jobs string) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			switch {
			case strings.HasSuffix(r.URL.Path, "/actions/runners"):
				_, _ = w.Write([]byte(runners))
			case strings.HasSuffix(r.URL.Path, "/jobs"):
				_, _ = w.Write([]byte(jobs))
			case strings.HasSuffix(r.URL.Path, "/actions/runs"):
				_, _ = w.Write([]byte(runs))
			default:
				w.WriteHeader(http.StatusNotFound)
			}
		}))
		defer srv.Close()
		d, err := github.New(github.Config{URL: srv.URL + "/acme/app", APIURL: srv.URL, Token: token, Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if rs, err := d.Runners(ctx); err == nil {
			for _, r := range rs {
				if r.Status != forge.StatusIdle && r.Status != forge.StatusBusy && r.Status != forge.StatusOffline {
					t.Fatalf("runner %+v has no status", r)
				}
			}
		}
		if js, err := d.Jobs(ctx, forge.JobQueued); err == nil {
			for _, j := range js {
				if j.Status != forge.JobQueued {
					t.Fatalf("listed as queued: %+v", j)
				}
			}
		}
	})
}
