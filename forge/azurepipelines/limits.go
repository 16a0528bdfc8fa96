package azurepipelines

import (
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// Azure DevOps limits each identity's use of its services (global
// consumption, in TSTUs, over a sliding five minutes). It delays requests
// beyond the limit (from milliseconds to 30 s each, the request still
// carried out), and then refuses them with 429; its answers say how near
// the limit a client is (learn.microsoft.com/azure/devops/integrate/
// concepts/rate-limits): Retry-After (seconds before sending more, the one
// the docs ask clients to obey), X-RateLimit-Remaining (0 once requests
// are delayed), X-RateLimit-Delay (how long this one was) and
// X-RateLimit-Reset (when usage would be back to 0 if all of it stopped:
// not when requests may be sent). The Go client reads none of them and
// sends each request once, so the driver's transport does, by hand
// (forge.HoldTransport): it holds every request while a Retry-After says
// to; while requests are delayed and no Retry-After came, it paces them
// by the delay the service applied, rather than add to it; and it sends
// again a request refused with 429 after the wait, a few times, within
// the call's time.

// maxDelay is the longest delay the service applies to a request.
const maxDelay = 30 * time.Second

// maxLimitRetries is how often a request refused with 429 is sent again.
const maxLimitRetries = 3

// limits is the state of the rate limit as the answers tell it.
type limits struct {
	hold      forge.Hold
	mu        sync.Mutex
	remaining int64 // X-RateLimit-Remaining of the last answer, -1 before one
}

// Remaining returns the last X-RateLimit-Remaining, -1 before any.
func (l *limits) Remaining() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.remaining
}

// Waits returns how many times a request waited for the limit.
func (l *limits) Waits() int64 { return l.hold.Waits() }

func (l *limits) transport(next http.RoundTripper) http.RoundTripper {
	return forge.HoldTransport(next, &l.hold, maxLimitRetries, l.note)
}

// note reads an answer's rate-limit headers, and reports a 429: a
// request refused before it was carried out, to send again after the
// wait it asked for (a second without one).
func (l *limits) note(resp *http.Response) bool {
	if v := resp.Header.Get("X-RateLimit-Remaining"); v != "" {
		if n, err := strconv.ParseFloat(v, 64); err == nil {
			l.mu.Lock()
			l.remaining = int64(n)
			l.mu.Unlock()
			if n <= 0 && resp.Header.Get("Retry-After") == "" {
				if s, err := strconv.ParseFloat(resp.Header.Get("X-RateLimit-Delay"), 64); err == nil && s > 0 {
					l.hold.Set(min(time.Duration(s*float64(time.Second)), maxDelay))
				}
			}
		}
	}
	waited := l.holdFor(resp)
	if resp.StatusCode != http.StatusTooManyRequests {
		return false
	}
	if !waited {
		l.hold.Set(time.Second)
	}
	return true
}

// holdFor holds further requests for an answer's Retry-After, and reports
// whether it had one.
func (l *limits) holdFor(resp *http.Response) bool {
	v := resp.Header.Get("Retry-After")
	if v == "" {
		return false
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		l.hold.Set(time.Duration(s * float64(time.Second)))
		return true
	}
	if t, err := http.ParseTime(v); err == nil {
		l.hold.Set(time.Until(t))
		return true
	}
	return false
}
