// Package docker tests the Docker provider end to end on the real Gitea: a
// fresh container per job, adoption after a crash, no token in a container,
// one and two GPUs per runner on a private engine with fake GPUs, an engine
// restart, the replenish benchmark.
package docker

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
