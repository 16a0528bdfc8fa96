// Package gitlab tests the GitLab driver end to end against the GitLab
// stand-in: a runner per job, crashes, kill -9 at random moments, an outage,
// re-runs on timeout, `runfleet runner`.
package gitlab

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
