package github_test

// Tests of how the driver reads GitHub's answers: the defects a check
// against GitHub's published API found (issue 13).

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/stall"
)

// A runner name is reused by every runner of its slot: the job lost with a
// machine is the one its registration id held, not an earlier failed job
// of an older runner of the same name; and it is re-run once, however
// often the loss is reported.
func TestLostJobFoundByRegistrationID(t *testing.T) {
	s := newSim(t, ghsim.Options{KeepLostRunners: true})
	d := newDriver(t, s, "/acme/app", func(c *github.Config) { c.RerunPoll = 20 * time.Millisecond })
	spec := ghsim.JobSpec{Name: "train", Labels: []string{"gpu"}}

	older := s.Queue("acme/app", spec)
	oldRunner := s.AddRunner("acme/app", "cpu-1", []string{"gpu"}, true, false)
	s.Assign(older.Jobs[0], oldRunner)
	s.Complete(older.Jobs[0], "failure")

	current := s.Queue("acme/app", spec)
	newRunner := s.AddRunner("acme/app", "cpu-1", []string{"gpu"}, true, false)
	s.Assign(current.Jobs[0], newRunner)

	ctx := context.Background()
	lost := forge.Runner{ID: newRunner, Name: "cpu-1"}
	d.Lost(ctx, lost)
	d.Lost(ctx, lost) // reported again by the next pass
	time.Sleep(100 * time.Millisecond)
	s.Lose(newRunner)
	waitUntil(t, "a re-run", func() bool { return len(s.Reruns()) > 0 })
	time.Sleep(200 * time.Millisecond)
	d.Lost(ctx, lost) // and once more after the re-run
	time.Sleep(200 * time.Millisecond)
	if got := s.Reruns(); !slices.Equal(got, []int64{current.ID}) {
		t.Fatalf("re-ran runs %v; want only %d (run %d failed on an older cpu-1)", got, current.ID, older.ID)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A job behind needs: is queued inside a run that is already in progress:
// a poll must find it.
func TestPollFindsJobQueuedInRunInProgress(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", nil)
	run := s.Queue("acme/app",
		ghsim.JobSpec{Name: "build", Labels: []string{"cpu"}},
		ghsim.JobSpec{Name: "test", Labels: []string{"gpu"}, Needs: []string{"build"}})
	r := s.AddRunner("acme/app", "cpu-1", []string{"cpu"}, true, false)
	s.Assign(run.Jobs[0], r)
	s.Complete(run.Jobs[0], "success")

	jobs, err := d.Jobs(context.Background(), forge.JobQueued)
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 1 || jobs[0].ID != run.Jobs[1] || jobs[0].Status != forge.JobQueued {
		t.Fatalf("queued jobs = %+v; want job %d (test, queued once build passed)", jobs, run.Jobs[1])
	}
}

// However many runs are in progress, a poll lists the jobs of at most 30
// of them, and every run's turn comes.
func TestPollCostIsBounded(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", nil)
	r := s.AddRunner("acme/app", "busy", []string{"cpu"}, true, false)
	var want int64
	for i := range 80 {
		run := s.Queue("acme/app",
			ghsim.JobSpec{Name: "a", Labels: []string{"cpu"}},
			ghsim.JobSpec{Name: "b", Labels: []string{"gpu"}, Needs: []string{"a"}})
		s.AddRunner("acme/app", fmt.Sprint("r", i), []string{"cpu"}, true, false)
		s.Assign(run.Jobs[0], r)
		if i == 0 {
			// The oldest run's second job is queued; the others wait.
			s.Complete(run.Jobs[0], "success")
			want = run.Jobs[1]
		} else {
			s.Complete(run.Jobs[0], "success") // releases b
		}
		r = s.AddRunner("acme/app", fmt.Sprint("x", i), []string{"cpu"}, true, false)
	}
	ctx := context.Background()
	found := false
	for poll := 1; poll <= 3 && !found; poll++ {
		_, before := s.Calls()
		jobs, err := d.Jobs(ctx, forge.JobQueued)
		if err != nil {
			t.Fatal(err)
		}
		_, after := s.Calls()
		// Run lists: queued (one page) and in progress (one page of 100).
		if n := after - before; n > 2+30 {
			t.Fatalf("poll %d made %d calls; want at most 32", poll, n)
		}
		found = slices.ContainsFunc(jobs, func(j forge.Job) bool { return j.ID == want })
	}
	if !found {
		t.Fatalf("job %d never found in three polls", want)
	}
}

// A name in use answered 422 "Validation Failed" with the reason only in
// errors[]: the stale registration is removed and the name taken at once.
func TestDuplicateNameInErrorsArray(t *testing.T) {
	s := newSim(t, ghsim.Options{DuplicateStatus: http.StatusUnprocessableEntity, DuplicateInErrors: true})
	stale := s.AddRunner("acme/app", "p-1", []string{"x"}, false, false)
	d := newDriver(t, s, "/acme/app", nil)
	cred, err := d.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
	if err != nil {
		t.Fatal(err)
	}
	if rs := s.Runners(); len(rs) != 1 || rs[0].ID == stale || rs[0].ID != cred.RunnerID {
		t.Fatalf("runners = %+v; want only the new p-1", rs)
	}
}

// Labels GitHub refuses are a config error, and a request it refuses as
// invalid is reported (ErrRejected), never retried.
func TestLabelsGitHubRefuses(t *testing.T) {
	many := make([]string, 101)
	for i := range many {
		many[i] = fmt.Sprint("l", i)
	}
	d, ok := forge.Lookup("github")
	if !ok {
		t.Fatal("github driver not registered")
	}
	lc := d.(forge.LabelChecker)
	if err := lc.CheckLabels(many); err == nil || !strings.Contains(err.Error(), "labels: GitHub takes 1 to 100 labels a runner, got 101") {
		t.Fatalf("101 labels: %v", err)
	}
	if err := lc.CheckLabels([]string{"ok", strings.Repeat("x", 257)}); err == nil || !strings.Contains(err.Error(), "labels[1]:") {
		t.Fatalf("a 257-character label: %v", err)
	}
	if err := lc.CheckLabels(many[:100]); err != nil {
		t.Fatalf("100 labels: %v", err)
	}

	s := newSim(t, ghsim.Options{})
	drv := newDriver(t, s, "/acme/app", nil)
	_, err := drv.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: many})
	if !errors.Is(err, forge.ErrRejected) {
		t.Fatalf("register with 101 labels: %v; want ErrRejected", err)
	}
	if _, total := s.Calls(); total != 0 {
		t.Fatalf("%d calls for a request GitHub would refuse; want none", total)
	}
}

// A 422 answer GitHub gives for an invalid request is ErrRejected.
func TestInvalidRequestIsRejected(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", func(c *github.Config) { c.RunnerGroupID = -5 })
	_, err := d.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
	if !errors.Is(err, forge.ErrRejected) {
		t.Fatalf("register into group -5: %v; want ErrRejected", err)
	}
}

// A 403 that is no rate limit (a token without the permission, as GitHub
// answers it: "Resource not accessible by ...") is ErrRejected, asked
// once; a 5xx is not.
func TestForbiddenIsRejected(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", nil)
	s.Fail("/generate-jitconfig", http.StatusForbidden, 1)
	_, err := d.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
	if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "403 Resource not accessible") {
		t.Fatalf("register with a token that may not: %v; want ErrRejected with GitHub's words", err)
	}
	s.Fail("/generate-jitconfig", http.StatusBadGateway, 1)
	_, err = d.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
	if errors.Is(err, forge.ErrRejected) {
		t.Fatalf("register through a 502: %v; want an error that is retried", err)
	}
}

// Only X-Hub-Signature-256 authenticates a delivery: the legacy SHA-1
// X-Hub-Signature alone is refused, even when it is right.
func TestWebhookRequiresSHA256(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", nil)
	secret := []byte("0123456789abcdef-secret")
	body := []byte(`{"action":"queued","workflow_job":{"id":7,"run_id":3,"status":"queued","labels":["gpu"]}}`)
	sign := func(h func() hash.Hash, prefix string) string {
		m := hmac.New(h, secret)
		m.Write(body)
		return prefix + hex.EncodeToString(m.Sum(nil))
	}
	req := func(headers map[string]string) *http.Request {
		r := httptest.NewRequest("POST", "/webhook", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("X-GitHub-Event", "workflow_job")
		for k, v := range headers {
			r.Header.Set(k, v)
		}
		return r
	}
	_, err := d.ParseWebhook(req(map[string]string{"X-Hub-Signature": sign(sha1.New, "sha1=")}), secret)
	if !errors.Is(err, forge.ErrBadSignature) {
		t.Fatalf("SHA-1 only: %v; want ErrBadSignature", err)
	}
	dl, err := d.ParseWebhook(req(map[string]string{"X-Hub-Signature-256": sign(sha256.New, "sha256=")}), secret)
	if err != nil || dl.Job == nil || dl.Job.ID != 7 {
		t.Fatalf("SHA-256: %+v, %v", dl, err)
	}
	// Where the job's code came from, in the delivery's own fields
	// (docs.github.com, "Webhook events and payloads": workflow_job).
	body = []byte(`{"action":"queued","workflow_job":{"id":8,"run_id":3,"status":"queued","labels":["gpu"],"head_sha":"9fceb02d0ae598e95dc970b74767f19372d61af8","head_branch":"main","workflow_name":"train"},"repository":{"full_name":"acme/app"},"sender":{"login":"octocat"}}`)
	dl, err = d.ParseWebhook(req(map[string]string{"X-Hub-Signature-256": sign(sha256.New, "sha256=")}), secret)
	if err != nil || dl.Job == nil || dl.Job.Source != (forge.Source{Repository: "acme/app", Commit: "9fceb02d0ae598e95dc970b74767f19372d61af8", Ref: "main", Workflow: "train", Actor: "octocat"}) {
		t.Fatalf("the job's source: %+v, %v", dl.Job, err)
	}
}

// A forge that accepts connections and never answers cannot hold a pass:
// every call has a deadline.
func TestHangingForgeTimesOut(t *testing.T) {
	url := "http://" + stall.Listen(t)
	d, err := github.New(github.Config{URL: url + "/acme/app", APIURL: url, Token: token, Logger: quiet(), CallTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := d.Runners(context.Background()); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a forge that never answers gave a listing")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a call to a forge that never answers did not end")
	}
}
