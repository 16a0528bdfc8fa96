// Package manager tests the manager's own conduct end to end: backoff from
// an unreachable forge, a bad config, a forge outage, reload, `runfleet
// runner`.
package manager

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
