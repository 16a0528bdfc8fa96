// Package chaos kills and drains managers of host processes and Docker
// containers at seeded random moments, on the real Gitea; its tests run one
// at a time.
package chaos

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
