package daemon

import (
	"errors"
	"strings"
	"testing"
	"time"
)

type passes struct {
	err   error
	since time.Time
}

func (p passes) LastError() error        { return p.err }
func (p passes) FailingSince() time.Time { return p.since }

// A forge that blinks leaves /healthz at 200; an outage that has lasted a
// minute in every pool turns it to 503, naming each pool's error.
func TestHealthRidesOutABlink(t *testing.T) {
	now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	down := errors.New("pool gpu: gitlab list runners: 503")
	ok := passes{}
	blink := passes{err: down, since: now.Add(-20 * time.Second)}
	outage := passes{err: down, since: now.Add(-90 * time.Second)}
	for _, tc := range []struct {
		name    string
		pools   []passChecker
		healthy bool
	}{
		{"no pools", nil, true},
		{"all passes work", []passChecker{ok, ok}, true},
		{"a 20 s blink", []passChecker{blink}, true},
		{"one pool out, another working", []passChecker{outage, ok}, true},
		{"one pool out, another blinking", []passChecker{outage, blink}, true},
		{"every pool out a minute and more", []passChecker{outage, outage}, false},
	} {
		err := health(tc.pools, now)
		if (err == nil) != tc.healthy {
			t.Errorf("%s: health = %v, want healthy %v", tc.name, err, tc.healthy)
		}
		if err != nil && !strings.Contains(err.Error(), "failing for 1m30s: pool gpu: gitlab list runners: 503") {
			t.Errorf("%s: %q does not say what fails and for how long", tc.name, err)
		}
	}
}
