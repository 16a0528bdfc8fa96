package kubernetes

import (
	"context"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/record"
)

// A pod's host is its node: the record of a runner keeps the node's
// system as its kubelet reports it in the Node's status (nodeInfo: OS
// image, kernel, architecture, container runtime; capacity: CPUs and
// memory), read once a node is named, in the background, so that no
// listing waits on it. Reading a Node needs `get` on nodes, cluster-wide
// (deploy/kubernetes/rbac.yaml's ClusterRole): without it the records
// keep no node's system, said once in the log.

// nodeRetry is how long after a failed read a node is read again.
const nodeRetry = 10 * time.Minute

// nodeSystems keeps the systems of the nodes read.
type nodeSystems struct {
	ctx    context.Context // the provider's: ends at Close
	mu     sync.Mutex
	known  map[string]*record.System
	failed map[string]time.Time // the last failed read, by node
	asking map[string]bool
	denied bool // no right to read nodes: never asked again
}

// systemOf is a node's system if it was read; nil otherwise, and a read
// is started.
func (p *Provider) systemOf(node string) *record.System {
	if node == "" {
		return nil
	}
	n := &p.nodes
	n.mu.Lock()
	defer n.mu.Unlock()
	if s, ok := n.known[node]; ok {
		return s
	}
	if n.denied || n.asking[node] || time.Since(n.failed[node]) < nodeRetry || n.ctx == nil {
		return nil
	}
	if n.asking == nil {
		n.asking, n.known, n.failed = map[string]bool{}, map[string]*record.System{}, map[string]time.Time{}
	}
	n.asking[node] = true
	go p.readNode(node)
	return nil
}

func (p *Provider) readNode(name string) {
	n := &p.nodes
	ctx, cancel := p.call(n.ctx)
	node, err := p.cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	cancel()
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.asking, name)
	switch {
	case apierrors.IsForbidden(err):
		if !n.denied {
			p.log.Info("nodes cannot be read (no get on nodes): runners' records keep no node's system", "err", err)
		}
		n.denied = true
	case err != nil:
		n.failed[name] = time.Now()
		if n.ctx.Err() == nil {
			p.log.Warn("a node could not be read for its system; read again later", "node", name, "err", err)
		}
	default:
		n.known[name] = nodeSystem(node)
	}
}

// nodeSystem is what a Node's status says of its system.
func nodeSystem(node *corev1.Node) *record.System {
	info := node.Status.NodeInfo
	s := &record.System{OS: info.OSImage, Kernel: info.KernelVersion, Arch: info.Architecture}
	if c, ok := node.Status.Capacity[corev1.ResourceCPU]; ok {
		s.CPUs = int(c.Value())
	}
	if m, ok := node.Status.Capacity[corev1.ResourceMemory]; ok {
		s.MemoryMiB = uint64(m.Value() >> 20)
	}
	// "containerd://1.7.24", "docker://28.2.2", "cri-o://1.31.0"
	if name, version, ok := strings.Cut(info.ContainerRuntimeVersion, "://"); ok {
		s.Runtime = name + " " + version
	} else {
		s.Runtime = info.ContainerRuntimeVersion
	}
	return s
}
