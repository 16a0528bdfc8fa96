package azure

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"
)

// A VM that powers itself off at its deadline is Stopped, still
// allocated and billed until something deallocates or deletes it; with
// the manager gone, nothing would. So each VM's deallocation at its
// deadline is submitted to Compute Schedule, Azure's own, once the VM is
// made: that needs no credential on the VM (an identity there allowed to
// deallocate would be a token a job step could read and use on other
// VMs), and one call takes a batch. The VMs made within DeallocateGather
// of each other, in one location, with deadlines in the same minute, go
// in one call, up to MaxDeallocateBatch; each is deallocated at the
// minute after its deadline, when it has powered itself off. A VM
// deleted before then is not looked for again: its deallocation finds
// nothing, which costs nothing.

// DeallocateGather is how long a VM's deallocation waits for others to
// join its call; MaxDeallocateBatch the most VMs one call names.
var (
	DeallocateGather   = 10 * time.Second
	MaxDeallocateBatch = 100
)

// deallocateTries is how many times a batch is sent before the log says
// its VMs have none; a batch Azure refuses for good is not sent again.
const deallocateTries = 5

// batchKey is what the VMs of one call share.
type batchKey struct {
	location string
	at       time.Time // the minute after the deadlines
}

// deadlines gathers VMs' deallocations into batches and submits them.
type deadlines struct {
	api    API
	logger *slog.Logger
	gather time.Duration // DeallocateGather when made
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	pending map[batchKey][]string // resource IDs
	running bool                  // a sender is gathering or sending
	sent    sync.WaitGroup
}

func newDeadlines(api API, logger *slog.Logger) *deadlines {
	ctx, cancel := context.WithCancel(context.Background())
	return &deadlines{api: api, logger: logger, gather: DeallocateGather, ctx: ctx, cancel: cancel, pending: map[batchKey][]string{}}
}

// add asks for a VM's deallocation at its deadline.
func (d *deadlines) add(location, id string, deadline time.Time) {
	at := deadline.UTC().Truncate(time.Minute).Add(time.Minute)
	d.mu.Lock()
	defer d.mu.Unlock()
	k := batchKey{location, at}
	d.pending[k] = append(d.pending[k], id)
	if d.running {
		return
	}
	d.running = true
	d.sent.Go(d.send)
}

// send waits for a batch to gather, and sends what is pending until
// nothing is.
func (d *deadlines) send() {
	for {
		select {
		case <-time.After(d.gather):
		case <-d.ctx.Done():
		}
		d.mu.Lock()
		batches := d.pending
		d.pending = map[batchKey][]string{}
		if len(batches) == 0 {
			d.running = false
			d.mu.Unlock()
			return
		}
		d.mu.Unlock()
		for _, k := range slices.SortedFunc(maps.Keys(batches), func(a, b batchKey) int { return a.at.Compare(b.at) }) {
			for ids := range slices.Chunk(batches[k], MaxDeallocateBatch) {
				d.submit(k, ids)
			}
		}
	}
}

// submit sends one batch, again after a failure no retry is known not to
// fix, backing off, up to deallocateTries times.
func (d *deadlines) submit(k batchKey, ids []string) {
	wait := time.Second
	for try := 1; ; try++ {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(d.ctx), CallTimeout)
		refused, err := d.api.Deallocate(ctx, k.location, k.at, ids)
		cancel()
		if err == nil {
			for id, code := range refused {
				d.logger.Warn("Compute Schedule would not deallocate a VM at its deadline: should this manager be gone, it is billed while stopped until it is deleted (runfleet gc)",
					"vm", id, "code", code)
			}
			d.logger.Debug("VMs' deallocation submitted", "vms", len(ids), "location", k.location, "at", k.at.Format(time.RFC3339))
			return
		}
		kind, _ := kindOf(err)
		if kind == errFatal || try == deallocateTries || d.ctx.Err() != nil {
			d.logger.Error("could not submit the VMs' deallocation at their deadline (does the manager's role allow Microsoft.ComputeSchedule's virtualMachinesSubmitDeallocate, and is the Microsoft.ComputeSchedule resource provider registered?): should this manager be gone, they are billed while stopped until deleted (runfleet gc)",
				"vms", len(ids), "location", k.location, "err", brief(err))
			return
		}
		select {
		case <-time.After(wait):
		case <-d.ctx.Done():
		}
		wait = min(2*wait, time.Minute)
	}
}

// close sends what is pending at once, and waits for it.
func (d *deadlines) close() {
	d.cancel()
	d.sent.Wait()
}
