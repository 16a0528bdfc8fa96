package azure

import (
	"context"
	"sync"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"

	"github.com/runfleet/runfleet/provider/vm"
)

// Listing is a subscription's VMs as last listed, shared by the pools of
// the subscription and endpoint. Compute meters the listing of a
// subscription's VMs as its costliest read (its "High Cost Get VM"
// policy: 300 a minute per subscription, a bucket of 900; Azure's
// compute-throttling-limits): so that a few pools do not use it up, the
// subscription is listed once for every pool that asks within the poll
// interval, and a pool that asks while a listing is under way waits for
// it rather than sending its own.
type Listing struct {
	mu      sync.Mutex
	began   time.Time // when the last listing was asked for
	vms     []*armcompute.VirtualMachine
	pending chan struct{} // closed when the listing under way ends
}

// Get returns the subscription's VMs from a listing asked for at most
// maxAge before now, through api when there is none, and when that
// listing was asked for. What it returns is shared: it must not be
// changed.
func (l *Listing) Get(ctx context.Context, api API, maxAge time.Duration, now func() time.Time) ([]*armcompute.VirtualMachine, time.Time, error) {
	asked := now()
	for {
		l.mu.Lock()
		if !l.began.IsZero() && !l.began.Before(asked.Add(-maxAge)) {
			vms, began := l.vms, l.began
			l.mu.Unlock()
			return vms, began, nil
		}
		if ch := l.pending; ch != nil {
			l.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, time.Time{}, ctx.Err()
			}
		}
		ch := make(chan struct{})
		l.pending = ch
		l.mu.Unlock()
		began := now()
		vms, err := api.List(ctx)
		l.mu.Lock()
		l.pending = nil
		if err == nil {
			l.vms, l.began = vms, began
		}
		l.mu.Unlock()
		close(ch)
		return vms, began, err
	}
}

// sharedListings are the listings the pools of one subscription and
// endpoint share.
var sharedListings = vm.Shared[*Listing]{New: func() *Listing { return &Listing{} }}
