// Package gcp tests Compute Engine instances end to end against the
// Compute Engine stand-in: Spot preemptions, capacity falling back across
// zones, a manager killed and its instances' deadline, `runner --cloud=gcp`,
// and the burst benchmark.
package gcp

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
