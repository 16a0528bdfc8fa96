package gitlab_test

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
	"github.com/runfleet/runfleet/forge/gitlab"
)

// FuzzAnswers gives the driver arbitrary answers to its listings (runners,
// jobs) and arbitrary Job Hooks, seeded with odd-but-valid shapes GitLab's
// documentation allows (nulls, empty pages, unknown fields, a runner
// without a name, huge tags): it never panics, and what it returns is an
// error or runners and jobs with a status.
func FuzzAnswers(f *testing.F) {
	f.Add(`[{"id":7,"description":"p-1","paused":false,"runner_type":"project_type","name":null,"online":true,"status":"online"}]`,
		`[{"id":9,"status":"pending","tag_list":["gpu"],"pipeline":{"id":3},"runner":null,"created_at":"2026-11-22T12:00:00.000Z"}]`,
		`{"object_kind":"build","build_id":9,"build_status":"pending","project_id":1,"build_started_at":null,"runner":null}`)
	f.Add(`[]`, `[]`, `{"object_kind":"build","build_id":9,"build_status":"success","build_duration":null,"environment":null}`)
	f.Add(`null`, `null`, `null`)
	f.Add(`[{"id":7,"description":null,"status":null,"new_field":{"x":[1,2]}}]`,
		`[{"id":9,"status":"running","tag_list":["`+strings.Repeat("t", 70000)+`"],"runner":{"id":7}},{"status":"pending"}]`,
		`{"object_kind":"build","build_id":"nine"}`)
	f.Add(`{"message":"x"}`, `"x"`, `[]`)
	f.Fuzz(func(t *testing.T, runners, jobs, hook string) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			switch {
			case strings.HasSuffix(r.URL.Path, "/runners"):
				_, _ = w.Write([]byte(runners))
			case strings.Contains(r.URL.Path, "/jobs"):
				_, _ = w.Write([]byte(jobs))
			default:
				w.WriteHeader(http.StatusNotFound)
			}
		}))
		defer srv.Close()
		d, err := gitlab.New(gitlab.Config{URL: srv.URL, Token: token, Scope: gitlab.Scope{Kind: "project", Ref: "1"},
			CallTimeout: 2 * time.Second, CacheTTL: -1, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if rs, err := d.Runners(ctx); err == nil {
			for _, r := range rs {
				if r.Status != forge.StatusIdle && r.Status != forge.StatusBusy && r.Status != forge.StatusOffline {
					t.Fatalf("runner %d has no status", r.ID)
				}
			}
		}
		if js, err := d.Jobs(ctx, forge.JobQueued); err == nil {
			for _, j := range js {
				if j.Status != forge.JobQueued && j.Status != forge.JobInProgress && j.Status != forge.JobCompleted {
					t.Fatalf("job %d listed without a status", j.ID)
				}
			}
		}
		r := httptest.NewRequest("POST", "/webhook/gl", strings.NewReader(hook))
		r.Header.Set("X-Gitlab-Token", "s3cret")
		r.Header.Set("X-Gitlab-Event", "Job Hook")
		if dl, err := d.ParseWebhook(r, []byte("s3cret")); err == nil && dl.Job != nil && dl.Job.Status == 0 {
			t.Fatalf("hook job %d without a status", dl.Job.ID)
		}
	})
}
