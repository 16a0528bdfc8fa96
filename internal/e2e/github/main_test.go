// Package github tests the GitHub driver end to end against the GitHub
// stand-in: ephemeral runners, scale sets, duplicate names, rate limits,
// crash loops, lost runners re-run.
package github

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
