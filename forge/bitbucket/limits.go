package bitbucket

import (
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// Bitbucket Cloud limits API calls per hour, per user or access token and
// per resource (1,000 an hour for most; more for workspaces with many
// paid users), over a rolling hour. Past the limit it answers 429, and
// says nothing of when to send again. The driver's transport
// (forge.HoldTransport) holds every request after a 429, for a wait that
// doubles while 429s go on (firstHold, up to five minutes) or for a
// Retry-After when one comes, and sends the refused request again a few
// times within the call's time. The connection's budget (calls_per_hour)
// keeps a pool under the limit to begin with.

const (
	maxLimitRetries = 3
	firstHold       = 2 * time.Second
)

// limits is the state of the rate limit as the answers tell it.
type limits struct {
	hold   forge.Hold
	mu     sync.Mutex
	streak time.Duration // the last hold, doubled by each 429 in a row
	// near is set while Bitbucket says less than a fifth of the hour's
	// calls is left (X-RateLimit-NearLimit, sent to access tokens on
	// its scaled endpoints: "Introducing Scaled Rate Limits for
	// Bitbucket Cloud API"); the driver then reads only what it must.
	near bool
}

// nearLimit reports whether Bitbucket last said the limit is near.
func (l *limits) nearLimit() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.near
}

// Waits returns how many times a request waited for the limit.
func (l *limits) Waits() int64 { return l.hold.Waits() }

func (l *limits) transport(next http.RoundTripper) http.RoundTripper {
	return forge.HoldTransport(next, &l.hold, maxLimitRetries, l.note)
}

// note holds further requests after a 429, for its Retry-After or twice
// the last hold, and ends a run of 429s on any other answer.
func (l *limits) note(resp *http.Response) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if v := resp.Header.Get("X-RateLimit-NearLimit"); v != "" {
		l.near = v == "true"
	}
	if resp.StatusCode != http.StatusTooManyRequests {
		l.streak = 0
		return false
	}
	d := firstHold
	if l.streak > 0 {
		d = l.streak * 2
	}
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s >= 0 {
		d = time.Duration(s) * time.Second
	}
	l.streak = d
	l.hold.Set(d)
	return true
}
