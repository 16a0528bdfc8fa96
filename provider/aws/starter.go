package aws

import (
	"fmt"
	"strings"

	"github.com/runfleet/runfleet/provider"
)

// Starter is an EC2 pool's keys in `runfleet init`'s config.
func (driver) Starter(o provider.StarterOptions) string {
	image := o.Image
	if !strings.HasPrefix(image, "ami-") {
		image = "ami-0123456789abcdef0"
	}
	return fmt.Sprintf(`    # Each runner is an EC2 instance of its own, terminated after its one
    # job. Credentials come from the SDK's chain (AWS_ACCESS_KEY_ID and
    # AWS_SECRET_ACCESS_KEY, a profile, or this machine's role), never the
    # config.
    provider: aws
    aws:
      region: us-east-1
      image: %s   # an AMI holding runfleet and the forge's agent
      instance_types: [g4dn.xlarge, g5.xlarge]   # tried in order
      # subnets: [subnet-0123456789abcdef0]
      spot: true
      spot_fallback: on_demand
`, image)
}
