package azure

import (
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Listing is a subscription's VMs as last listed, shared by the pools of
// the subscription and endpoint: Compute meters that listing as its
// costliest read (its "High Cost Get VM" policy: 300 a minute per
// subscription, a bucket of 900; Azure's compute-throttling-limits).
type Listing = provider.Listing[[]*armcompute.VirtualMachine]

// sharedListings are the listings the pools of one subscription and
// endpoint share.
var sharedListings = vm.Shared[*Listing]{New: func() *Listing { return &Listing{} }}
