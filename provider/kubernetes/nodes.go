package kubernetes

import (
	"context"
	"strings"

	corev1 "k8s.io/api/core/v1"
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

// readNode reads a node's system (provider.NodeSystems.Read).
func (p *Provider) readNode(ctx context.Context, name string) (*record.System, error) {
	ctx, cancel := p.call(ctx)
	defer cancel()
	node, err := p.cs.Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return nodeSystem(node), nil
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
