package provider

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/runfleet/runfleet/record"
)

// NodeRetry is how long after a failed read a node is read again.
const NodeRetry = 10 * time.Minute

// NodeSystems keeps the systems of a cluster's nodes (a pod's, a batch
// job's), for the records of the machines that ran there: each node is
// read once, in the background, so that no listing waits on it. Set Read
// (and Denied, Log) before the first Of; Close ends the reads.
type NodeSystems struct {
	// Read reads a node's system.
	Read func(ctx context.Context, node string) (*record.System, error)
	// Denied, where set, says that an error means no node may be read
	// (no right to): nothing is asked again.
	Denied func(error) bool
	Log    *slog.Logger

	mu     sync.Mutex
	ctx    context.Context
	cancel context.CancelFunc
	known  map[string]*record.System
	failed map[string]time.Time // the last failed read, by node
	asking map[string]bool
	denied bool
}

// Of is a node's system if it was read; nil otherwise, and a read is
// started unless one is under way, failed lately, or was refused.
func (n *NodeSystems) Of(node string) *record.System {
	if node == "" || n.Read == nil {
		return nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if s, ok := n.known[node]; ok {
		return s
	}
	if n.denied || n.asking[node] || time.Since(n.failed[node]) < NodeRetry {
		return nil
	}
	if n.ctx == nil {
		n.ctx, n.cancel = context.WithCancel(context.Background())
		n.asking, n.known, n.failed = map[string]bool{}, map[string]*record.System{}, map[string]time.Time{}
	}
	if n.ctx.Err() != nil {
		return nil
	}
	n.asking[node] = true
	go n.read(n.ctx, node)
	return nil
}

func (n *NodeSystems) read(ctx context.Context, node string) {
	s, err := n.Read(ctx, node)
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.asking, node)
	log := n.Log
	if log == nil {
		log = slog.Default()
	}
	switch {
	case err != nil && n.Denied != nil && n.Denied(err):
		if !n.denied {
			log.Info("nodes cannot be read: runners' records keep no node's system", "err", err)
		}
		n.denied = true
	case err != nil:
		n.failed[node] = time.Now()
		if ctx.Err() == nil {
			log.Warn("a node could not be read for its system; read again later", "node", node, "err", err, "retry", NodeRetry)
		}
	default:
		n.known[node] = s
	}
}

// Close ends the reads under way.
func (n *NodeSystems) Close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cancel != nil {
		n.cancel()
	} else {
		n.ctx, n.cancel = context.WithCancel(context.Background())
		n.cancel()
	}
}
