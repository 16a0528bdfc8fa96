// Package aws tests EC2 instances end to end against the EC2 stand-in: spot
// interruptions, a manager killed mid-job, no capacity, and the burst
// benchmark.
package aws

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
