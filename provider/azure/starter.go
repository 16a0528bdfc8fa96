package azure

import (
	"cmp"
	"fmt"

	"github.com/runfleet/runfleet/provider"
)

// Starter is an Azure VM pool's keys in `runfleet init`'s config.
func (driver) Starter(o provider.StarterOptions) string {
	return fmt.Sprintf(`    # Each runner is an Azure VM of its own, deleted with its disk, NIC and
    # address after its one job. Credentials: AZURE_CLIENT_ID,
    # AZURE_CLIENT_SECRET and AZURE_TENANT_ID, or azidentity's chain.
    provider: azure
    azure:
      subscription_id: 00000000-0000-0000-0000-000000000000
      resource_group: ci-runners
      locations: [eastus]
      subnet: /subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/ci-runners/providers/Microsoft.Network/virtualNetworks/ci/subnets/runners
      image: %s   # runfleet and the forge's agent
      vm_sizes: [Standard_NC4as_T4_v3]
      spot: true
      spot_fallback: on_demand
`, cmp.Or(o.Image, "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/ci-images/providers/Microsoft.Compute/images/runfleet-runner"))
}
