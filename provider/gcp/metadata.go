package gcp

import (
	"context"
	"fmt"
	"net/http"
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

var _ bootstrap.Notices = Metadata{}

func init() { bootstrap.RegisterNotices("gcp", func() bootstrap.Notices { return NewMetadata() }) }

// NewMetadata is the metadata server at its link-local address, or at
// GCE_METADATA_HOST when that is set.
func NewMetadata() Metadata {
	return Metadata{metadata.NewClient(&http.Client{Timeout: 10 * time.Second})}
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
