// Package scopes checks a driver's calls against a forge stand-in that
// enforces its credential's scopes: the calls the scopes allow go
// through, and each one they do not is refused with an error that no
// retry fixes and that names the scope.
package scopes

import (
	"errors"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/forge"
)

// Check holds each step's error (by the step's name) to what the
// credential's scopes allow: nil, or, for the steps in refused, a
// forge.ErrRejected saying the credential lacks the scope and naming the
// one given.
func Check(t testing.TB, errs map[string]error, refused map[string]string) {
	t.Helper()
	for step, err := range errs {
		want, ok := refused[step]
		switch {
		case !ok && err != nil:
			t.Errorf("%s: %v, want it to go through", step, err)
		case ok && (!errors.Is(err, forge.ErrRejected) || !strings.Contains(err.Error(), "lacks the scope") || !strings.Contains(err.Error(), want)):
			t.Errorf("%s: %v, want a refusal naming %s", step, err, want)
		case ok:
			t.Logf("%s: %v", step, err)
		}
	}
}
