package gcp

import (
	"fmt"
	"strings"

	"github.com/runfleet/runfleet/provider"
)

// Starter is a Compute Engine pool's keys in `runfleet init`'s config.
func (driver) Starter(o provider.StarterOptions) string {
	image := o.Image
	if !strings.HasPrefix(image, "projects/") {
		image = "projects/acme-ci/global/images/family/runfleet-runner"
	}
	return fmt.Sprintf(`    # Each runner is a Compute Engine instance of its own, deleted after
    # its one job. Credentials: GOOGLE_APPLICATION_CREDENTIALS or the
    # machine's service account (compute scope), never the config.
    provider: gcp
    gcp:
      project: acme-ci
      zones: [us-central1-a, us-central1-b]   # tried in order
      image: %s   # runfleet and the forge's agent
      machine_types: [g2-standard-4]
      spot: true
      spot_fallback: on_demand
`, image)
}
