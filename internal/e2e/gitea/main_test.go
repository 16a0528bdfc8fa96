// Package gitea tests pools of fresh runners on the real Gitea: matrix jobs,
// bursts, a crash while jobs run, scaling from zero, no token in a runner,
// the status page, and the burst, scale and soak benchmarks.
package gitea

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
