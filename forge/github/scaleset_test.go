package github_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/actions/scaleset"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/internal/daemon"
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

// fastPoll is the long poll of these tests' Actions service: GitHub holds
// a poll about 50 s (ghsim's default, 2 s, is what the end-to-end
// TestGitHubScaleSet runs on); these tests count polls and watch
// sessions, so a poll that answers sooner only makes them quicker. It
// makes no expiry or conflict easier to meet: each is met at the next
// poll whatever its length.
const fastPoll = 300 * time.Millisecond

// listening is a scale set whose Listen (max 5) runs until cancel, its
// error then on done, once its session is open.
func listening(t *testing.T, s *ghsim.Server) (*github.ScaleSet, context.Context, context.CancelFunc, chan error) {
	t.Helper()
	ss := newScaleSet(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ss.Listen(ctx, 5, func() {}) }()
	waitUntil(t, "a session", func() bool { sets := s.ScaleSets(); return len(sets) == 1 && sets[0].Session })
	return ss, ctx, cancel, done
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
	s := newSim(t, ghsim.Options{LongPoll: fastPoll})
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
	s := newSim(t, ghsim.Options{LongPoll: fastPoll, SessionTimeout: time.Second})
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

// A message queue token expires (the service does not say when): the
// listener refreshes the session after one refused poll, not after the
// client's retries of the 401, and a job queued meanwhile is demand at
// once.
func TestScaleSetQueueTokenExpiry(t *testing.T) {
	// A second's lifetime, so that a test sees expiries; the default
	// (an hour) is TestScaleSetDemandAndRunners's.
	s := newSim(t, ghsim.Options{LongPoll: fastPoll, QueueTokenLifetime: time.Second})
	ss, ctx, cancel, done := listening(t, s)
	defer cancel()
	// A runner registered first: the client's admin connection is made.
	if _, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-1"}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "two expiries", func() bool { return s.ExpiredTokenCalls() >= 2 })
	refused, start := s.ExpiredTokenCalls(), time.Now()
	spec := ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "gpu-set"}}
	s.Queue("acme/app", spec)
	waitUntil(t, "the job as demand", func() bool { return ss.Unserved(nil) == 1 })
	took := time.Since(start)
	time.Sleep(3 * time.Second) // three more lifetimes
	expiries, sessions := s.ExpiredTokenCalls(), s.Sessions()
	t.Logf("a job queued after %d refused polls was demand in %s; %d polls refused for an expired token in all, %d session(s)", refused, took.Round(time.Millisecond), expiries, sessions)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("listen: %v", err)
	}
	// Each expiry costs one refused poll, then a refresh: about one a
	// lifetime (the listener polls every LongPoll), never the client's
	// four retries after each.
	if lifetimes := int(time.Since(start)/time.Second) + 3; expiries > lifetimes+2 {
		t.Errorf("%d polls refused for an expired token over about %d lifetimes: each expiry costs more than one poll", expiries, lifetimes)
	}
	if sessions != 1 {
		t.Errorf("%d sessions: an expiry is met with a refresh, not a new session", sessions)
	}
}

// sessionOfAnother creates the scale set and opens its message session
// as another manager ("other-manager") would.
func sessionOfAnother(ctx context.Context, t *testing.T, s *ghsim.Server) *scaleset.MessageSessionClient {
	t.Helper()
	if _, err := newScaleSet(t, s).Register(ctx, forge.RunnerRequest{Name: "x"}); err != nil { // creates the scale set
		t.Fatal(err)
	}
	c, err := scaleset.NewClientWithPersonalAccessToken(scaleset.NewClientWithPersonalAccessTokenConfig{GitHubConfigURL: s.URL + "/acme", PersonalAccessToken: token})
	if err != nil {
		t.Fatal(err)
	}
	other, err := c.MessageSessionClient(ctx, s.ScaleSets()[0].ID, "other-manager")
	if err != nil {
		t.Fatal(err)
	}
	return other
}

// A session another manager keeps polling is not waited for for ever:
// Listen gives up after its wait with an error that names the session's
// owner, as the service's 409 does.
func TestScaleSetSessionHeldByAnother(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: fastPoll, SessionTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	other := sessionOfAnother(ctx, t, s)
	go func() { // the other manager polls on
		for ctx.Err() == nil {
			_, _ = other.GetMessage(ctx, 0, 2)
		}
	}()
	// Two seconds' wait, not the default three minutes: the behaviour,
	// not the figure, is under test.
	second, err := github.NewScaleSet(github.ScaleSetConfig{Config: github.Config{URL: s.URL + "/acme", Token: token, Logger: quiet()}, Name: "gpu-set", ConflictWait: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	err = second.Listen(ctx, 2, func() {})
	if err == nil || !strings.Contains(err.Error(), "other-manager") || !strings.Contains(err.Error(), "another manager serves it") {
		t.Fatalf("listen beside another manager's session: %v, want an error naming other-manager", err)
	}
	if n := s.Sessions(); n != 1 {
		t.Fatalf("%d sessions, want the other manager's only", n)
	}
	t.Logf("gave up: %v", err)
}

// A listener stopped before it has its session (waiting out another's,
// or with its request in flight, as a manager that lost its lease stands
// down) has stopped, not failed: Listen returns nil, as it does once it
// listens (TestScaleSetHandedOverOnLeaseLoss failed so in CI, cancelled
// as the service answered its session request).
func TestScaleSetStoppedBeforeItsSession(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: fastPoll, SessionTimeout: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sessionOfAnother(ctx, t, s)
	lctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- newScaleSet(t, s).Listen(lctx, 2, func() {}) }()
	time.Sleep(1500 * time.Millisecond) // one 409 and its wait
	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Listen stopped while it waited for the session: %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Listen did not stop with its context")
	}
}

// Jobs are acquired before their message is deleted (the library's
// listener deletes first): an acquire that fails (the service's 500, past
// the client's retries) loses no job; the session is opened again and
// the job is demand.
func TestScaleSetAcquireFails(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: fastPoll})
	ss := newScaleSet(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make(chan error, 10)
	go func() {
		for ctx.Err() == nil { // as the daemon does: a session that ends is opened again
			if err := ss.Listen(ctx, 5, func() {}); err != nil {
				errs <- err
			}
		}
	}()
	waitUntil(t, "a session", func() bool { sets := s.ScaleSets(); return len(sets) == 1 && sets[0].Session })
	s.FailAcquires(5) // the client's first try and its four retries
	spec := ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "gpu-set"}}
	s.Queue("acme/app", spec)
	// The client retries for about 15 s (1, 2, 4, 8 s) before it fails.
	for deadline := time.Now().Add(40 * time.Second); ss.Unserved(nil) != 1; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the job whose acquire failed never became demand")
		}
	}
	select {
	case err := <-errs:
		t.Logf("the failed acquire ended the session: %v", err)
	default:
		t.Error("the acquire failed and the session went on: were the jobs acquired at all?")
	}
}

// The service's admin token expires (its JWT says when): the client takes
// a new one before, and no call is refused for an expired one while a
// session polls and runners are registered.
func TestScaleSetAdminTokenExpiry(t *testing.T) {
	// 62 s: the client takes a new token once less than a minute is left
	// (client.go, updateTokenIfNeeded), so this one serves two seconds;
	// the default is an hour (TestScaleSetDemandAndRunners).
	s := newSim(t, ghsim.Options{LongPoll: fastPoll, AdminTokenLifetime: 62 * time.Second})
	ss, ctx, cancel, done := listening(t, s)
	defer cancel()
	for i := range 4 {
		if _, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-" + strconv.Itoa(i)}); err != nil {
			t.Fatalf("register after %d s: %v", 3*i, err)
		}
		time.Sleep(3 * time.Second)
	}
	issued, refused := s.AdminTokens()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("listen: %v", err)
	}
	t.Logf("%d admin tokens issued over 12 s, %d calls refused for an expired one", issued, refused)
	if issued < 3 || refused != 0 {
		t.Errorf("%d admin tokens issued, %d calls refused for an expired one: want a new token before each expiry, none refused", issued, refused)
	}
}

// A 5xx of the service is retried by the client; a 403 (a token without
// the permission to register runners) halts: Register and Listen say so
// with forge.ErrRejected, which the pool and the daemon do not retry.
func TestScaleSetErrors(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: fastPoll})
	ss := newScaleSet(t, s)
	ctx := context.Background()
	s.Fail("/generatejitconfig", http.StatusServiceUnavailable, 2)
	if _, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-1"}); err != nil {
		t.Fatalf("register through two 503s: %v", err)
	}
	if s.Failed() != 2 {
		t.Fatalf("%d requests failed, want the two 503s", s.Failed())
	}

	// A new connection, whose first call asks for a registration token.
	ss = newScaleSet(t, s)
	s.Fail("/actions/runners/registration-token", http.StatusForbidden, 100)
	_, err := ss.Register(ctx, forge.RunnerRequest{Name: "gpu-set-2"})
	if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "403") {
		t.Fatalf("register with a token that may not: %v, want ErrRejected with the 403", err)
	}
	began := time.Now()
	err = ss.Listen(ctx, 2, func() {})
	if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "403") {
		t.Fatalf("listen with a token that may not: %v, want ErrRejected with the 403", err)
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Errorf("the 403 took %s to come back: retried?", took)
	}
	t.Logf("refused: %v", err)
}

// scaleSetFleet is a manager of one pool on the simulator's scale set.
func scaleSetFleet(t *testing.T, s *ghsim.Server) *daemon.Fleet {
	t.Helper()
	yml := "id: m\nstate_dir: " + t.TempDir() + "\nforges:\n  - name: gh\n    type: github\n    url: " + s.URL + "/acme\n    token: " + token +
		"\n    mode: scaleset\n    scale_set: gpu-set\npools:\n  - name: gpu\n    forge: gh\n    labels: [gpu]\n    size: 0\n    max: 2\n    agent: {path: /bin/sh}\n"
	cfg, err := config.Parse([]byte(yml))
	if err != nil {
		t.Fatal(err)
	}
	f, err := daemon.New(t.Context(), cfg, quiet())
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// A manager whose token may not register runners in the scale set's
// organisation (403) does not ask again and again: its listener stops, and
// the status page says why.
func TestScaleSetForbiddenStopsTheListener(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: fastPoll})
	s.Fail("/actions/runners/registration-token", http.StatusForbidden, 1000)
	f := scaleSetFleet(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() {
		defer close(ran)
		f.Run(ctx)
	}()
	refusal := func() string {
		for _, pv := range f.Page(ctx).Pools {
			for _, r := range pv.Words {
				if strings.Contains(r, "session stopped") {
					return r
				}
			}
		}
		return ""
	}
	waitUntil(t, "the refusal on the status page", func() bool { return refusal() != "" })
	first := s.Failed()
	time.Sleep(5 * time.Second) // beyond the listener's first backoffs (1, 2 s)
	if again := s.Failed(); again != first {
		t.Errorf("%d more 403s after the listener stopped: the refusal was retried", again-first)
	}
	cancel()
	<-ran
	if r := refusal(); !strings.Contains(r, "403") {
		t.Errorf("the page says %q, want the 403", r)
	}
	t.Logf("%d calls answered 403; the page: %s", first, refusal())
}

// A manager that loses its lease hands the scale set's session over: it
// deletes its session as it stands down, so that the next leader's first
// try opens one (no 409 to wait out).
func TestScaleSetHandedOverOnLeaseLoss(t *testing.T) {
	s := newSim(t, ghsim.Options{LongPoll: fastPoll, SessionTimeout: time.Minute})
	f := scaleSetFleet(t, s)
	lost := make(chan struct{})
	ran := make(chan struct{})
	go func() {
		defer close(ran)
		f.RunLeader(context.Background(), lost)
	}()
	waitUntil(t, "the leader's session", func() bool { sets := s.ScaleSets(); return len(sets) == 1 && sets[0].Session })
	close(lost)
	began := time.Now()
	next := newScaleSet(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- next.Listen(ctx, 2, func() {}) }()
	waitUntil(t, "the next leader's session", func() bool { return s.Sessions() == 2 })
	took := time.Since(began)
	<-ran
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("the next leader's listen: %v", err)
	}
	t.Logf("the next leader had the session %s after the lease was lost", took.Round(time.Millisecond))
	if took > 3*time.Second {
		t.Errorf("the next leader waited %s for the session: the old one was not deleted as the manager stood down", took)
	}
}
