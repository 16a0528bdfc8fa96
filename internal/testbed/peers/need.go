package peers

import (
	"os"
	"testing"
)

// Need skips a test whose prerequisite (what) did not come up (err), or
// fails it where CI=true: there every prerequisite must be present, and a
// skipped test would pass unseen.
func Need(t testing.TB, what string, err error) {
	t.Helper()
	if err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is required in CI: %v", what, err)
	}
	t.Skipf("needs %s: %v", what, err)
}
