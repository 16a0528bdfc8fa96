package github_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/actions/scaleset"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
)

func newScaleSet(t *testing.T, s *ghsim.Server) *github.ScaleSet {
	t.Helper()
	ss, err := github.NewScaleSet(github.ScaleSetConfig{Config: github.Config{URL: s.URL + "/acme", Token: token, Logger: quiet()}, Name: "gpu-set"})
	if err != nil {
		t.Fatal(err)
	}
	return ss
}

// runnerToken reads a runner's own token out of its JIT config, as the
// runner does.
func runnerToken(t *testing.T, cred forge.Credential) string {
	t.Helper()
	var files map[string]string
	raw, _ := base64.StdEncoding.DecodeString(cred.Env[github.EnvJITConfig])
	if err := json.Unmarshal(raw, &files); err != nil {
		t.Fatalf("JIT config: %v", err)
	}
	var c struct {
		Data struct {
			Token string `json:"token"`
		} `json:"data"`
	}
	raw, _ = base64.StdEncoding.DecodeString(files[".credentials"])
	if err := json.Unmarshal(raw, &c); err != nil || c.Data.Token == "" {
		t.Fatalf(".credentials: %v", err)
	}
	return c.Data.Token
}

// runner does what GitHub's runner does with its token: it takes a job,
// then reports it done.
func runner(t *testing.T, s *ghsim.Server, tok string) (finish func()) {
	t.Helper()
	call := func(path string, body string) *http.Response {
		req, _ := http.NewRequest("POST", s.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tok)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	res := call("/_runner/acquire", "")
	defer res.Body.Close()
	var job struct {
		ID int64 `json:"id"`
	}
	if res.StatusCode != http.StatusOK || json.NewDecoder(res.Body).Decode(&job) != nil {
		t.Fatalf("the runner got no job: %s", res.Status)
	}
	return func() {
		b, _ := json.Marshal(map[string]any{"id": job.ID, "conclusion": "success"})
		call("/_runner/complete", string(b)).Body.Close()
	}
}

// A scale set is created and held by one message session; jobs that name
// it are offered, acquired within the max capacity and counted as demand;
// a runner registered into it takes one, and the demand follows the job
// started and completed messages; the session goes when the listener
// stops.
func TestScaleSetDemandAndRunners(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: 300 * time.Millisecond})
	ss := newScaleSet(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	var changed atomic.Int64
	done := make(chan error, 1)
	go func() { done <- ss.Listen(ctx, 5, func() { changed.Add(1) }) }()
	waitUntil(t, "a session", func() bool { sets := s.ScaleSets(); return len(sets) == 1 && sets[0].Session })

	spec := ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "gpu-set"}}
	s.Queue("acme/app", spec, spec, spec)
	waitUntil(t, "3 jobs of demand", func() bool { return ss.Unserved(nil) == 3 })

	cred, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-1", Labels: []string{"gpu"}})
	if err != nil {
		t.Fatal(err)
	}
	finish := runner(t, s, runnerToken(t, cred))
	// Seen taking a job before the service said so: not counted twice.
	if n := ss.Unserved([]int64{cred.RunnerID}); n != 2 {
		t.Fatalf("unserved %d with the runner seen busy, want 2", n)
	}
	waitUntil(t, "the job started", func() bool { return ss.Unserved([]int64{cred.RunnerID}) == 2 && ss.Unserved(nil) == 2 })
	finish()
	waitUntil(t, "the job completed", func() bool { return changed.Load() > 3 && ss.Unserved(nil) == 2 })

	// A name left registered is taken over.
	if _, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-2"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-2"}); err != nil {
		t.Fatalf("register over a stale registration: %v", err)
	}
	if n := len(s.Runners()); n != 1 {
		t.Fatalf("%d registrations, want the one gpu-set-2", n)
	}
	if !slices.Contains(s.MaxCapacities(), 5) {
		t.Fatalf("polls sent max capacities %v, want 5", s.MaxCapacities())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("listen: %v", err)
	}
	if sets := s.ScaleSets(); sets[0].Session {
		t.Fatal("the session outlived the listener")
	}
}

// A session a killed manager left (never closed, no longer polled) is
// waited out, and the next manager's listener gets its own.
func TestScaleSetSessionTakenOver(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: 300 * time.Millisecond, SessionTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The first manager: a session opened, then nothing.
	c, err := scaleset.NewClientWithPersonalAccessToken(scaleset.NewClientWithPersonalAccessTokenConfig{GitHubConfigURL: s.URL + "/acme", PersonalAccessToken: token})
	if err != nil {
		t.Fatal(err)
	}
	first := newScaleSet(t, s)
	if _, err := first.Register(ctx, forge.RunnerRequest{Name: "x"}); err != nil { // creates the scale set
		t.Fatal(err)
	}
	if _, err := c.MessageSessionClient(ctx, s.ScaleSets()[0].ID, "killed"); err != nil {
		t.Fatal(err)
	}
	second := newScaleSet(t, s)
	go func() { _ = second.Listen(ctx, 2, func() {}) }()
	waitUntil(t, "the second session", func() bool { return s.Sessions() == 2 })
	if sets := s.ScaleSets(); len(sets) != 1 || !sets[0].Session {
		t.Fatalf("scale sets %+v, want one, held", sets)
	}
}
