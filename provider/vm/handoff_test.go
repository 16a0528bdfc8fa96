package vm

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
)

// A desk with a verifier that takes "token-<instance>" bound to any key.
func testDesk(t *testing.T) (*Desk, *httptest.Server, *time.Time) {
	t.Helper()
	now := time.Now()
	d := &Desk{now: func() time.Time { return now }}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	d.URL = srv.URL
	d.Verify = func(_ context.Context, token, audience string) (string, error) {
		id, ok := strings.CutPrefix(token, "token-")
		if !ok || !strings.HasPrefix(audience, srv.URL+"?key=") {
			return "", errors.New("bad token")
		}
		return id, nil
	}
	return d, srv, &now
}

func identityOf(id string) func(context.Context, string) (string, error) {
	return func(context.Context, string) (string, error) { return "token-" + id, nil }
}

// What the desk does not hold yet is asked for again; what it handed
// over is gone for good; what its instance never took ends with its
// time; a dropped one is not handed over.
func TestDeskHandsEachOnce(t *testing.T) {
	d, srv, now := testDesk(t)
	ctx := context.Background()
	if _, err := ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("1")); !errors.Is(err, bootstrap.ErrNotYet) {
		t.Fatalf("before the manager held it: %v, want ErrNotYet", err)
	}
	d.Hold("1", bootstrap.Assignment{Runner: "gpu-1", Command: "run"}, now.Add(time.Minute))
	a, err := ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("1"))
	if err != nil || a.Runner != "gpu-1" || a.Command != "run" {
		t.Fatalf("claim: %+v (%v), want gpu-1's", a, err)
	}
	if _, err := ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("1")); !errors.Is(err, ErrTaken) {
		t.Fatalf("again: %v, want ErrTaken", err)
	}
	if d.holds("1") {
		t.Error("the desk still holds a taken assignment")
	}

	d.Hold("2", bootstrap.Assignment{Runner: "gpu-2", Command: "run"}, now.Add(time.Minute))
	*now = now.Add(2 * time.Minute)
	if _, err := ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("2")); !errors.Is(err, bootstrap.ErrNotYet) {
		t.Errorf("past its time: %v, want nothing held", err)
	}
	d.Hold("3", bootstrap.Assignment{Runner: "gpu-3", Command: "run"}, now.Add(time.Minute))
	d.Drop("3")
	if d.holds("3") {
		t.Error("a dropped assignment is held")
	}

	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(`{"token":"token-1"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a claim without a key: %d, want 400", resp.StatusCode)
	}
	if _, err := ClaimFrom(ctx, srv.Client(), srv.URL, func(context.Context, string) (string, error) { return "forged", nil }); err == nil || errors.Is(err, bootstrap.ErrNotYet) || !strings.Contains(err.Error(), "403") {
		t.Errorf("a token that does not verify: %v, want refused for good (403)", err)
	}
}

// Claims that race for one instance's assignment: one gets it, every
// other is told it was taken.
func TestDeskHandsOnceUnderRace(t *testing.T) {
	d, srv, now := testDesk(t)
	d.Hold("1", bootstrap.Assignment{Runner: "gpu-1", Command: "run"}, now.Add(time.Minute))
	const n = 20
	got := make(chan error, n)
	for range n {
		go func() {
			_, err := ClaimFrom(context.Background(), srv.Client(), srv.URL, identityOf("1"))
			got <- err
		}()
	}
	won, taken := 0, 0
	for range n {
		switch err := <-got; {
		case err == nil:
			won++
		case errors.Is(err, ErrTaken):
			taken++
		default:
			t.Error(err)
		}
	}
	if won != 1 || taken != n-1 {
		t.Errorf("%d claims got the assignment and %d were told it was taken, want 1 and %d", won, taken, n-1)
	}
}

// The claims a desk refused are told, for the status page, with the last
// one's reason: a machine whose proof does not verify powers off, and the
// pool sees only a runner that never came online.
func TestDeskTellsWhatItRefused(t *testing.T) {
	d, srv, now := testDesk(t)
	ctx := context.Background()
	start := *now
	if got := d.Refusals(start); got != nil {
		t.Fatalf("refusals before any claim: %q", got)
	}
	_, _ = ClaimFrom(ctx, srv.Client(), srv.URL, func(context.Context, string) (string, error) { return "forged", nil })
	got := d.Refusals(start)
	if len(got) != 1 || !strings.Contains(got[0], "1 machine claims refused") || !strings.Contains(got[0], "the proof does not verify: bad token") {
		t.Fatalf("after a forged claim: %q", got)
	}
	d.Hold("1", bootstrap.Assignment{Runner: "gpu-1", Command: "run"}, now.Add(time.Minute))
	_, _ = ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("1"))
	*now = now.Add(time.Second)
	_, _ = ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("1"))
	got = d.Refusals(start)
	if len(got) != 1 || !strings.Contains(got[0], "2 machine claims refused") || !strings.Contains(got[0], "a second claim for 1, whose assignment was taken already") {
		t.Fatalf("after a second claim: %q", got)
	}
	if got := d.Refusals(now.Add(time.Second)); got != nil {
		t.Errorf("refusals since after the last: %q", got)
	}
	for range maxRefusals + 5 {
		_, _ = ClaimFrom(ctx, srv.Client(), srv.URL, identityOf("1"))
	}
	if got := d.Refusals(start); len(got) != 1 || !strings.Contains(got[0], "at least 50 machine claims") {
		t.Errorf("after many: %q, want the last %d remembered", got, maxRefusals)
	}
}
