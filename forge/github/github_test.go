package github_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/stall"
)

const token = "ghp_simulatedpersonalaccesstoken0001"

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newSim(t *testing.T, opt ghsim.Options) *ghsim.Server {
	t.Helper()
	if opt.Token == "" && opt.AppKey == nil {
		opt.Token = token
	}
	opt.Repos = append(opt.Repos, "acme/app")
	opt.Orgs = append(opt.Orgs, "acme")
	s := ghsim.New(opt)
	t.Cleanup(s.Close)
	return s
}

func newDriver(t *testing.T, s *ghsim.Server, path string, mod func(*github.Config)) *github.Forge {
	t.Helper()
	cfg := github.Config{URL: s.URL + path, Token: token, Logger: quiet()}
	if mod != nil {
		mod(&cfg)
	}
	d, err := github.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestParseURL(t *testing.T) {
	for _, tc := range []struct {
		in, api string
		scope   github.Scope
		bad     bool
	}{
		{in: "https://github.com/acme/app", api: "https://api.github.com/", scope: github.Scope{Owner: "acme", Repo: "app"}},
		{in: "https://github.com/acme/app.git", api: "https://api.github.com/", scope: github.Scope{Owner: "acme", Repo: "app"}},
		{in: "https://github.com/acme/", api: "https://api.github.com/", scope: github.Scope{Owner: "acme"}},
		{in: "https://ghe.example.com/acme/app", api: "https://ghe.example.com/api/v3/", scope: github.Scope{Owner: "acme", Repo: "app"}},
		{in: "https://github.com/", bad: true},
		{in: "https://github.com/a/b/c", bad: true},
		{in: "github.com/acme/app", bad: true},
	} {
		api, scope, err := github.ParseURL(tc.in)
		if tc.bad {
			if err == nil {
				t.Errorf("ParseURL(%q) = %q, %v; want an error", tc.in, api, scope)
			}
			continue
		}
		if err != nil || api != tc.api || scope != tc.scope {
			t.Errorf("ParseURL(%q) = %q, %+v, %v; want %q, %+v", tc.in, api, scope, err, tc.api, tc.scope)
		}
	}
}

func TestRegisterListRemove(t *testing.T) {
	for _, path := range []string{"/acme/app", "/acme"} {
		t.Run(strings.TrimPrefix(path, "/"), func(t *testing.T) {
			s := newSim(t, ghsim.Options{})
			d := newDriver(t, s, path, nil)
			ctx := context.Background()
			cred, err := d.Register(ctx, forge.RunnerRequest{Name: "gpu-1", Labels: []string{"gpu", "linux"}})
			if err != nil {
				t.Fatal(err)
			}
			if cred.RunnerID == 0 || cred.Env[github.EnvJITConfig] == "" || len(cred.Files) != 0 {
				t.Fatalf("credential = id %d, env keys %d, files %d; want an id and a JIT config in the environment", cred.RunnerID, len(cred.Env), len(cred.Files))
			}
			rs, err := d.Runners(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(rs) != 1 || rs[0].Name != "gpu-1" || rs[0].Status != forge.StatusOffline || strings.Join(rs[0].Labels, ",") != "gpu,linux" {
				t.Fatalf("runners = %+v", rs)
			}
			if err := d.RemoveRunner(ctx, cred.RunnerID); err != nil {
				t.Fatal(err)
			}
			if err := d.RemoveRunner(ctx, cred.RunnerID); !errors.Is(err, forge.ErrNotFound) {
				t.Fatalf("second remove: %v, want ErrNotFound", err)
			}
			if len(s.Runners()) != 0 {
				t.Fatalf("simulator still has %+v", s.Runners())
			}
		})
	}
}

func TestListPagesAndCaches(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	for i := range 230 {
		s.AddRunner("acme/app", "other-"+string(rune('a'+i%26))+time.Duration(i).String(), []string{"x"}, true, false)
	}
	d := newDriver(t, s, "/acme/app", func(c *github.Config) { c.CacheTTL = time.Hour })
	ctx := context.Background()
	rs, err := d.Runners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 230 {
		t.Fatalf("listed %d runners, want 230 over three pages", len(rs))
	}
	if d.Calls() != 3 {
		t.Fatalf("listing took %d calls, want 3 pages of 100", d.Calls())
	}
	// Within the TTL the list is kept current without calls.
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
	if err != nil {
		t.Fatal(err)
	}
	rs, _ = d.Runners(ctx)
	if len(rs) != 231 || d.Calls() != 4 {
		t.Fatalf("after register: %d runners, %d calls; want 231 and 4", len(rs), d.Calls())
	}
	d.Ended(cred.RunnerID)
	rs, _ = d.Runners(ctx)
	if len(rs) != 230 || d.Calls() != 4 {
		t.Fatalf("after ended: %d runners, %d calls; want 230 and 4", len(rs), d.Calls())
	}
}

// A registration made while a listing is under way is missing from that
// listing: it is not kept, so the next pass reads GitHub again and sees
// the runner, instead of missing it for a whole cache_ttl.
func TestListingThatOverlapsARegistrationIsNotKept(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	front, listing, release := stall.HoldAnswer(t, s.URL, func(r *http.Request) bool {
		return r.Method == "GET" && strings.HasSuffix(r.URL.Path, "/actions/runners")
	})
	d, err := github.New(github.Config{URL: front + "/acme/app", Token: token, Logger: quiet(), CacheTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	first := make(chan []forge.Runner, 1)
	go func() {
		rs, _ := d.Runners(ctx)
		first <- rs
	}()
	<-listing
	cred, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
	if err != nil {
		t.Fatal(err)
	}
	close(release)
	if rs := <-first; len(rs) != 0 {
		t.Fatalf("the held listing has %+v, want none (it was read before p-1 was made)", rs)
	}
	rs, err := d.Runners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 1 || rs[0].ID != cred.RunnerID {
		t.Errorf("the next listing is %+v, want the runner made during the last one", rs)
	}
}

// A registration whose answer never came (the drain cancelled it) may
// have been made: the kept list is dropped, so the next pass sees the
// runner and removes it, and a drain does not end with it left at GitHub.
func TestListingDroppedAfterAnUnansweredRegistration(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	front, made, release := stall.HoldAnswer(t, s.URL, func(r *http.Request) bool {
		return r.Method == "POST" && strings.HasSuffix(r.URL.Path, "/generate-jitconfig")
	})
	defer close(release)
	d, err := github.New(github.Config{URL: front + "/acme/app", Token: token, Logger: quiet(), CacheTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if rs, err := d.Runners(context.Background()); err != nil || len(rs) != 0 {
		t.Fatalf("first listing: %v, %v", rs, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-made; cancel() }()
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}}); err == nil {
		t.Fatal("a registration cancelled before its answer succeeded")
	}
	rs, err := d.Runners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 1 || rs[0].Name != "p-1" {
		t.Errorf("the listing after the unanswered registration is %+v, want the p-1 GitHub made", rs)
	}
}

func TestDuplicateNameReplacesStaleRegistration(t *testing.T) {
	for _, code := range []int{http.StatusConflict, http.StatusUnprocessableEntity} {
		t.Run(http.StatusText(code), func(t *testing.T) {
			s := newSim(t, ghsim.Options{DuplicateStatus: code})
			stale := s.AddRunner("acme/app", "p-1", []string{"x"}, false, false)
			d := newDriver(t, s, "/acme/app", nil)
			cred, err := d.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
			if err != nil {
				t.Fatal(err)
			}
			rs := s.Runners()
			if len(rs) != 1 || rs[0].ID == stale || rs[0].ID != cred.RunnerID {
				t.Fatalf("runners = %+v; want only the new p-1", rs)
			}
			calls, _ := s.Calls()
			if n := calls["POST /api/v3/repos/{owner}/{repo}/actions/runners/generate-jitconfig"]; n != 2 {
				t.Fatalf("generate-jitconfig called %d times, want 2 (refused, then after removal)", n)
			}
		})
	}
	t.Run("busy", func(t *testing.T) {
		s := newSim(t, ghsim.Options{})
		s.AddRunner("acme/app", "p-1", []string{"x"}, true, true)
		d := newDriver(t, s, "/acme/app", nil)
		_, err := d.Register(context.Background(), forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
		if !errors.Is(err, forge.ErrBusy) {
			t.Fatalf("register over a busy runner: %v, want ErrBusy", err)
		}
		if len(s.Runners()) != 1 {
			t.Fatal("the busy runner was removed")
		}
	})
}

func TestRemoveBusyRunnerRefused(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	id := s.AddRunner("acme/app", "p-1", []string{"x"}, true, true)
	d := newDriver(t, s, "/acme/app", nil)
	if err := d.RemoveRunner(context.Background(), id); !errors.Is(err, forge.ErrBusy) {
		t.Fatalf("remove busy: %v, want ErrBusy", err)
	}
	if len(s.Runners()) != 1 {
		t.Fatal("busy runner removed")
	}
}

// TestRateLimitWaitsForReset: a 403 with X-RateLimit-Remaining: 0 makes
// the driver wait until X-RateLimit-Reset, then try once more: two calls
// in all, not a tight loop.
func TestRateLimitWaitsForReset(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", nil)
	reset := time.Now().Add(1500 * time.Millisecond)
	s.ExhaustRateLimit(reset)
	start := time.Now()
	if _, err := d.Runners(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, calls := s.Calls()
	t.Logf("rate limited for %s: %d calls, %d answered 403, waited %s", time.Until(reset)+time.Since(start), calls, s.RateLimited(), time.Since(start).Round(time.Millisecond))
	if calls != 2 || s.RateLimited() != 1 || d.RateLimitWaits() != 1 {
		t.Fatalf("calls = %d, rate limited = %d, waits = %d; want 2, 1, 1", calls, s.RateLimited(), d.RateLimitWaits())
	}
	if time.Now().Before(reset) {
		t.Fatal("retried before the reset")
	}
	if d.RateRemaining() <= 0 {
		t.Fatalf("rate remaining = %d after the reset", d.RateRemaining())
	}
}

func TestRateLimitWaitEndsWithContext(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", nil)
	s.ExhaustRateLimit(time.Now().Add(time.Hour))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := d.Runners(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want the context's deadline", err)
	}
	if _, calls := s.Calls(); calls != 1 {
		t.Fatalf("%d calls while waiting an hour for the reset, want 1", calls)
	}
}

func TestFallsBackToRegistrationToken(t *testing.T) {
	s := newSim(t, ghsim.Options{NoJIT: true})
	d := newDriver(t, s, "/acme/app", nil)
	ctx := context.Background()
	for range 2 {
		cred, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}})
		if err != nil {
			t.Fatal(err)
		}
		if cred.Env[github.EnvToken] == "" || cred.Env[github.EnvJITConfig] != "" || cred.Env[github.EnvURL] != s.URL+"/acme/app" {
			t.Fatalf("fallback credential env keys wrong: token %t, jit %t, url %q", cred.Env[github.EnvToken] != "", cred.Env[github.EnvJITConfig] != "", cred.Env[github.EnvURL])
		}
	}
	calls, _ := s.Calls()
	if n := calls["POST /api/v3/repos/{owner}/{repo}/actions/runners/generate-jitconfig"]; n != 1 {
		t.Fatalf("JIT tried %d times, want once: the driver remembers", n)
	}
	if s.RegistrationTokens() != 2 {
		t.Fatalf("%d registration tokens, want 2", s.RegistrationTokens())
	}
}

// A runner whose credential would stay in a cloud instance's boot data
// (OneRunnerOnly) gets no registration token where GitHub has no
// just-in-time runners: a job that read it could enrol runners of its own
// for an hour. The refusal is one no retry fixes, and says what to do;
// no registration token is even asked for.
func TestNoRegistrationTokenInBootData(t *testing.T) {
	s := newSim(t, ghsim.Options{NoJIT: true})
	d := newDriver(t, s, "/acme/app", nil)
	ctx := context.Background()
	for range 2 {
		_, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}, OneRunnerOnly: true})
		if !errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "just-in-time") {
			t.Fatalf("a cloud runner where GitHub has no JIT runners: %v, want a refusal", err)
		}
	}
	if n := s.RegistrationTokens(); n > 1 {
		t.Errorf("%d registration tokens made, want at most the one that found JIT missing", n)
	}
	// With JIT runners, the same request gets one.
	j := newSim(t, ghsim.Options{})
	cred, err := newDriver(t, j, "/acme/app", nil).Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}, OneRunnerOnly: true})
	if err != nil || cred.Env[github.EnvJITConfig] == "" || cred.Env[github.EnvToken] != "" {
		t.Errorf("with JIT runners: %v, JIT config %t", err, cred.Env[github.EnvJITConfig] != "")
	}
}

func TestGitHubApp(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	pemKey := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	s := newSim(t, ghsim.Options{AppID: 4242, InstallationID: 77, AppKey: &key.PublicKey})
	d := newDriver(t, s, "/acme/app", func(c *github.Config) {
		c.Token, c.AppID, c.InstallationID, c.PrivateKey = "", 4242, 77, pemKey
	})
	ctx := context.Background()
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"x"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Register(ctx, forge.RunnerRequest{Name: "p-2", Labels: []string{"x"}}); err != nil {
		t.Fatal(err)
	}
	calls, _ := s.Calls()
	if n := calls["POST /api/v3/app/installations/{id}/access_tokens"]; n != 1 {
		t.Fatalf("installation token fetched %d times, want once (cached)", n)
	}

	// A wrong key is refused, and the error does not show the key.
	other, _ := rsa.GenerateKey(rand.Reader, 2048)
	bad := newDriver(t, s, "/acme/app", func(c *github.Config) {
		c.Token, c.AppID, c.InstallationID = "", 4242, 77
		c.PrivateKey = pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(other)})
	})
	_, err = bad.Register(ctx, forge.RunnerRequest{Name: "p-3", Labels: []string{"x"}})
	if err == nil || strings.Contains(err.Error(), "PRIVATE KEY") {
		t.Fatalf("register with a wrong key: %v", err)
	}
	if _, err := github.New(github.Config{URL: s.URL + "/acme/app", AppID: 1, InstallationID: 2, PrivateKey: []byte("not a key")}); err == nil || strings.Contains(err.Error(), "not a key") {
		t.Fatalf("a malformed key: %v", err)
	}
}

func TestBadTokenIsAClearError(t *testing.T) {
	s := newSim(t, ghsim.Options{})
	d := newDriver(t, s, "/acme/app", func(c *github.Config) { c.Token = "ghp_wrong" })
	_, err := d.Runners(context.Background())
	if err == nil || !strings.Contains(err.Error(), "401 Bad credentials") || strings.Contains(err.Error(), "ghp_wrong") {
		t.Fatalf("err = %v", err)
	}
	d = newDriver(t, s, "/acme/nope", nil)
	if _, err := d.Runners(context.Background()); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("unknown repository: %v", err)
	}
}
