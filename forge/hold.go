package forge

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// Hold is a connection's pause after a forge's rate-limit answer: every
// request waits until it ends. Drivers whose client neither reads the
// forge's rate-limit answers nor sends a refused request again (Microsoft's
// Azure DevOps client, the hand-written Bitbucket one) set it from the
// answers, through HoldTransport. The zero value holds nothing.
type Hold struct {
	// Max caps one hold, however far an answer puts it (5m if 0).
	Max time.Duration

	mu    sync.Mutex
	until time.Time
	waits int64
}

// Set holds requests for d from now, unless a longer hold is on.
func (h *Hold) Set(d time.Duration) {
	d = min(d, h.max())
	if d <= 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if until := time.Now().Add(d); until.After(h.until) {
		h.until = until
	}
}

func (h *Hold) max() time.Duration {
	if h.Max > 0 {
		return h.Max
	}
	return 5 * time.Minute
}

// Waits returns how many requests waited for a hold.
func (h *Hold) Waits() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.waits
}

// Wait waits while the hold is on, or until ctx ends. A wait longer than
// ctx allows is not begun: the request fails at once.
func (h *Hold) Wait(ctx context.Context) error {
	h.mu.Lock()
	d := time.Until(h.until)
	if d > 0 {
		h.waits++
	}
	h.mu.Unlock()
	if d <= 0 {
		return nil
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
		return fmt.Errorf("rate limit: %s before the next request, longer than the call may wait", d.Round(time.Second))
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

// HoldTransport wraps a transport so that every request waits for the
// hold, and each answer goes to note, which sets the hold from it and
// says whether the forge refused the request before carrying it out (a
// 429); such a request is sent again, up to retries times, after the hold.
// A request whose body cannot be read again is not.
func HoldTransport(next http.RoundTripper, h *Hold, retries int, note func(*http.Response) (again bool)) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return holdTransport{next: next, h: h, retries: retries, note: note}
}

type holdTransport struct {
	next    http.RoundTripper
	h       *Hold
	retries int
	note    func(*http.Response) bool
}

func (t holdTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	for attempt := 0; ; attempt++ {
		if err := t.h.Wait(r.Context()); err != nil {
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
		again := t.note(resp)
		if !again || attempt >= t.retries || (r.Body != nil && r.Body != http.NoBody && r.GetBody == nil) {
			return resp, nil
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
	}
}
