package gitlab_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/gitlab"
	"github.com/runfleet/runfleet/internal/testbed/glsim"
	"github.com/runfleet/runfleet/secret"
)

func check(t *testing.T, section string, tok string) error {
	t.Helper()
	d, ok := forge.Lookup("gitlab")
	if !ok {
		t.Fatal("gitlab is not registered")
	}
	return d.Check(forge.Config{Name: "gl", URL: "https://gitlab.example.com", Token: secret.String(tok), Section: json.RawMessage(section)})
}

// Every problem of a gitlab forge's section is named at once.
func TestCheck(t *testing.T) {
	for _, ok := range []string{`{"project":"acme/models"}`, `{"project":42}`, `{"group":"acme"}`, `{"scope":"instance"}`,
		`{"project":"acme/ml/models","run_untagged":true,"maximum_timeout":"3h"}`, `{"project":"acme/models","access_level":"not_protected"}`} {
		if err := check(t, ok, "glpat-x"); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	err := check(t, `{"scope":"project","group":"acme","maximum_timeout":"5m","colour":"red","access_level":"protected"}`, "")
	for _, want := range []string{"token: is required", "project: is required", "scope: project: set one of", "maximum_timeout: 5m0s is under", "colour", `access_level: "protected" is not ref_protected or not_protected`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not say %q", err, want)
		}
	}
	if err := check(t, `{"project":"models"}`, "glpat-x"); err == nil || !strings.Contains(err.Error(), "neither a full path") {
		t.Errorf("a bare name: %v", err)
	}
	if err := check(t, `{}`, "glpat-x"); err == nil || !strings.Contains(err.Error(), "scope: is required") {
		t.Errorf("no scope: %v", err)
	}
}

// runfleet runner configures GitLab from a project's URL, as CML does.
func TestRepoConfig(t *testing.T) {
	d, _ := forge.Lookup("gitlab")
	rd := d.(forge.RepoDriver)
	cases := map[string][2]string{
		"https://gitlab.com/acme/ml/models":             {"https://gitlab.com", `{"access_level":"not_protected","project":"acme/ml/models"}`},
		"https://gitlab.example.com/acme/models.git":    {"https://gitlab.example.com", `{"access_level":"not_protected","project":"acme/models"}`},
		"https://gitlab.example.com/acme/models/-/jobs": {"https://gitlab.example.com", `{"access_level":"not_protected","project":"acme/models"}`},
		"http://127.0.0.1:8080/acme":                    {"http://127.0.0.1:8080", `{"access_level":"not_protected","group":"acme"}`},
	}
	for in, want := range cases {
		u, sec, err := rd.RepoConfig(in)
		if err != nil || u != want[0] || string(sec) != want[1] {
			t.Errorf("%s: %s %s %v, want %s %s", in, u, sec, err, want[0], want[1])
		}
	}
	getenv := func(k string) (string, bool) { return map[string]string{"GITLAB_CI": "true"}[k], true }
	if !rd.InCI(getenv) {
		t.Error("a GitLab CI job is not recognized")
	}
	urls := map[string]string{"CI_SERVER_URL": "https://gitlab.example.com", "CI_PROJECT_URL": "https://gitlab.example.com/acme/models"}
	if !rd.InCI(func(k string) (string, bool) { v, ok := urls[k]; return v, ok }) {
		t.Error("a job with GitLab's CI_SERVER_URL and CI_PROJECT_URL is not recognized")
	}
	if rd.InCI(func(string) (string, bool) { return "", false }) {
		t.Error("recognized outside GitLab CI")
	}
}

// A Job Hook is taken only with the secret in X-Gitlab-Token; a queued
// job's tags are read from the jobs API, since the hook has none.
func TestParseWebhook(t *testing.T) {
	d, sim := newDriver(t, glsim.Options{}, gitlab.Config{})
	if _, err := sim.CreatePipeline("acme/models", glsim.JobSpec{Name: "train", Tags: []string{"gpu"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	job := sim.Jobs()[0]
	body := `{"object_kind":"build","ref":"main","tag":false,"build_id":` + itoa(job.ID) + `,"build_name":"train","build_status":"pending",` +
		`"build_created_at":"2026-11-23 10:00:00 UTC","build_started_at":null,"build_finished_at":null,"build_duration":null,` +
		`"pipeline_id":` + itoa(job.PipelineID) + `,"project_id":` + itoa(job.ProjectID) + `,"runner":null,"environment":null}`
	req := func(tok, event, body string) (forge.Delivery, error) {
		r := httptest.NewRequest("POST", "/webhook/gl", strings.NewReader(body)).WithContext(context.Background())
		if tok != "" {
			r.Header.Set("X-Gitlab-Token", tok)
		}
		r.Header.Set("X-Gitlab-Event", event)
		return d.ParseWebhook(r, []byte("s3cret"))
	}
	dl, err := req("s3cret", "Job Hook", body)
	if err != nil || dl.Job == nil {
		t.Fatalf("%+v %v", dl, err)
	}
	j := dl.Job
	if j.ID != job.ID || j.RunID != job.PipelineID || j.Status != forge.JobQueued || !slices.Equal(j.Labels, []string{"gpu"}) || j.CreatedAt.IsZero() {
		t.Errorf("job %+v", j)
	}
	for _, bad := range []string{"", "wrong", "s3cre"} {
		if _, err := req(bad, "Job Hook", body); !errors.Is(err, forge.ErrBadSignature) {
			t.Errorf("token %q: %v, want ErrBadSignature", bad, err)
		}
	}
	if _, err := req("s3cret", "Job Hook", `{"object_kind":"build","build_id":"x"}`); !errors.Is(err, forge.ErrBadPayload) {
		t.Errorf("malformed: %v, want ErrBadPayload", err)
	}
	if dl, err := req("s3cret", "Push Hook", `{"object_kind":"push"}`); err != nil || dl.Job != nil {
		t.Errorf("push hook: %+v %v, want no job", dl, err)
	}
	for st, want := range map[string]forge.JobStatus{"created": 0, "manual": 0, "running": forge.JobInProgress, "success": forge.JobCompleted, "canceled": forge.JobCompleted} {
		dl, err := req("s3cret", "Job Hook", strings.Replace(body, `"pending"`, `"`+st+`"`, 1))
		got := forge.JobStatus(0)
		if dl.Job != nil {
			got = dl.Job.Status
		}
		if err != nil || got != want {
			t.Errorf("%s: %v %v, want %v", st, got, err, want)
		}
	}
}

func itoa(n int64) string { b, _ := json.Marshal(n); return string(b) }
