// Package chaoscloud kills and drains managers of Kubernetes pods and of
// EC2, Compute Engine and Azure instances at seeded random moments; its
// tests run one at a time.
package chaoscloud

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
