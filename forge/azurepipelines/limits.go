package azurepipelines

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Azure DevOps limits each identity's use of its services (global
// consumption, in TSTUs, over a sliding five minutes). It delays requests
// beyond the limit, and then refuses them with 429; its answers say how
// near the limit a client is: Retry-After (seconds before sending more),
// X-RateLimit-Remaining and X-RateLimit-Reset (when the usage is back
// under the limit, as epoch seconds). The Go client reads none of them
// and sends each request once, so the driver's transport does, by hand:
// it holds every request while a Retry-After or an exhausted limit says
// to, and sends again a request refused with 429 after the wait, a few
// times, within the call's time.

// maxLimitRetries is how often a request refused with 429 is sent again.
const maxLimitRetries = 3

// maxHold caps one wait, however far the server puts the reset.
const maxHold = 5 * time.Minute

// limits is the state of the rate limit as the answers tell it.
type limits struct {
	mu        sync.Mutex
	until     time.Time // send nothing before then
	remaining int64     // X-RateLimit-Remaining of the last answer, -1 before one
	waits     int64
}

// Remaining returns the last X-RateLimit-Remaining, -1 before any.
func (l *limits) Remaining() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.remaining
}

// Waits returns how many times a request waited for the limit.
func (l *limits) Waits() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.waits
}

func (l *limits) transport(next http.RoundTripper) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return limitedTransport{l: l, next: next}
}

type limitedTransport struct {
	l    *limits
	next http.RoundTripper
}

func (t limitedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	for attempt := 0; ; attempt++ {
		if err := t.l.hold(r.Context()); err != nil {
			return nil, err
		}
		req := r
		if attempt > 0 {
			req = r.Clone(r.Context())
			if r.GetBody != nil {
				body, err := r.GetBody()
				if err != nil {
					return nil, err
				}
				req.Body = body
			}
		}
		resp, err := t.next.RoundTrip(req)
		if err != nil {
			return nil, err
		}
		t.l.note(resp)
		if resp.StatusCode != http.StatusTooManyRequests || attempt >= maxLimitRetries || (r.Body != nil && r.Body != http.NoBody && r.GetBody == nil) {
			return resp, nil
		}
		// Refused before it was carried out: the same request again,
		// after the wait the answer asked for.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if !t.l.holdFor(resp) {
			t.l.setHold(time.Second)
		}
	}
}

// hold waits while the limit says to send nothing, or until ctx ends. A
// wait longer than ctx allows is not begun: the call fails at once.
func (l *limits) hold(ctx context.Context) error {
	l.mu.Lock()
	d := l.until.Sub(time.Now())
	if d > 0 {
		l.waits++
	}
	l.mu.Unlock()
	if d <= 0 {
		return nil
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
		return fmt.Errorf("azure devops rate limit: %s before the next request, longer than the call may wait", d.Round(time.Second))
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// note reads an answer's rate-limit headers.
func (l *limits) note(resp *http.Response) {
	if v := resp.Header.Get("X-RateLimit-Remaining"); v != "" {
		if n, err := strconv.ParseFloat(v, 64); err == nil {
			l.mu.Lock()
			l.remaining = int64(n)
			l.mu.Unlock()
			if n <= 0 {
				if reset, err := strconv.ParseInt(resp.Header.Get("X-RateLimit-Reset"), 10, 64); err == nil {
					l.setHold(time.Unix(reset, 0).Sub(time.Now()))
				}
			}
		}
	}
	l.holdFor(resp)
}

// holdFor holds further requests for an answer's Retry-After, and reports
// whether it had one.
func (l *limits) holdFor(resp *http.Response) bool {
	v := resp.Header.Get("Retry-After")
	if v == "" {
		return false
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		l.setHold(time.Duration(s * float64(time.Second)))
		return true
	}
	if t, err := http.ParseTime(v); err == nil {
		l.setHold(t.Sub(time.Now()))
		return true
	}
	return false
}

func (l *limits) setHold(d time.Duration) {
	d = min(d, maxHold)
	if d <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if until := time.Now().Add(d); until.After(l.until) {
		l.until = until
	}
}
