// Package bitbucket tests the Bitbucket Pipelines driver end to end against
// the Bitbucket simulator and the stand-in runner: pools of processes and
// of containers, a crash and kill -9 at random moments, scaling from zero,
// `runfleet runner`.
package bitbucket

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
