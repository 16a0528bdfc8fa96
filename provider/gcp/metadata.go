package gcp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"cloud.google.com/go/compute/metadata"

	"github.com/runfleet/runfleet/bootstrap"
)

// Metadata is the instance side's view of Compute Engine's metadata
// server: instance/preempted turns TRUE when a Spot VM is being taken
// back (30 s before it is stopped), and instance/maintenance-event names
// a coming host maintenance, which stops an instance with GPUs
// (TERMINATE_ON_HOST_MAINTENANCE, announced an hour ahead for GPUs).
type Metadata struct{ c *metadata.Client }

var _ bootstrap.Watcher = Metadata{}

func init() { bootstrap.RegisterNotices("gcp", func() bootstrap.Notices { return NewMetadata() }) }

// NewMetadata is the metadata server at its link-local address, or at
// GCE_METADATA_HOST when that is set.
func NewMetadata() Metadata {
	// Options without a client: calls with a timeout, and watches
	// (wait_for_change) on a client of their own without one.
	return Metadata{metadata.NewWithOptions(&metadata.Options{})}
}

// errPreempted ends a watch of instance/preempted.
var errPreempted = errors.New("preempted")

// WatchInterruption holds a request on instance/preempted until it turns
// TRUE (wait_for_change with its ETag, as Compute Engine's docs detect a
// preemption), so that the 30 s notice is not spent waiting for a poll.
func (m Metadata) WatchInterruption(ctx context.Context) (time.Time, error) {
	err := m.c.SubscribeWithContext(ctx, "instance/preempted", func(_ context.Context, v string, ok bool) error {
		if ok && strings.TrimSpace(v) == "TRUE" {
			return errPreempted
		}
		return nil
	})
	switch {
	case errors.Is(err, errPreempted):
		return time.Now().Add(preemptionNotice), nil
	case err == nil:
		err = errors.New("no longer defined")
	}
	return time.Time{}, fmt.Errorf("metadata instance/preempted: %w", err)
}

func (m Metadata) Interruption(ctx context.Context) (time.Time, bool, error) {
	v, err := m.c.GetWithContext(ctx, "instance/preempted")
	if err != nil {
		return time.Time{}, false, fmt.Errorf("metadata instance/preempted: %w", err)
	}
	if strings.TrimSpace(v) != "TRUE" {
		return time.Time{}, false, nil
	}
	return time.Now().Add(preemptionNotice), true, nil
}

// Rebalance reports a host maintenance that will stop the instance: an
// idle runner ends, a busy one finishes its job if it can.
func (m Metadata) Rebalance(ctx context.Context) (bool, error) {
	v, err := m.c.GetWithContext(ctx, "instance/maintenance-event")
	if err != nil {
		return false, fmt.Errorf("metadata instance/maintenance-event: %w", err)
	}
	return strings.HasPrefix(strings.TrimSpace(v), "TERMINATE"), nil
}
