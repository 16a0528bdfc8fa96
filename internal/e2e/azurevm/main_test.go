// Package azurevm tests Azure VMs end to end against the Azure stand-in
// (armcompute's fake server behind an HTTPS front): Spot evictions,
// capacity falling back across sizes and locations, a manager killed and
// its VMs' deadline, `runner --cloud=azure`, and the burst benchmark.
package azurevm

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
