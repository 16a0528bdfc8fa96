package peers

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// KwokAnnotation marks the nodes kwok plays.
const KwokAnnotation = "kwok.x-k8s.io/node"

// kwokStages are the stage files (in kwok's module) that make fake nodes
// ready and keep them so, run the pods bound to them, and finish deleting
// the pods being deleted.
var kwokStages = []string{
	"node/fast/node-initialize.yaml",
	"node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
	"pod/fast/pod-ready.yaml",
	"pod/fast/pod-complete.yaml",
	"pod/fast/pod-delete.yaml",
}

// StartKwok starts kwok against the control plane, managing the nodes
// annotated KwokAnnotation=fake.
func (k *Kube) StartKwok(ctx context.Context) error {
	// A cold cache builds kwok here (minutes): show it.
	bin, stages, err := KwokBinary(ctx, os.Stderr)
	if err != nil {
		return err
	}
	var docs []string
	for _, s := range kwokStages {
		b, err := os.ReadFile(filepath.Join(stages, s))
		if err != nil {
			return fmt.Errorf("kwok stage: %w", err)
		}
		docs = append(docs, string(b))
	}
	cfg := filepath.Join(k.Dir, "kwok.yaml")
	if err := os.WriteFile(cfg, []byte(strings.Join(docs, "\n---\n")), 0o644); err != nil {
		return err
	}
	return k.start("kwok", bin, "--kubeconfig", k.Kubeconfig, "-c", cfg,
		"--manage-nodes-with-annotation-selector", KwokAnnotation+"=fake",
		"--node-lease-duration-seconds", "40", "--cidr", "10.244.0.0/16")
}

// FakeNode creates a node for kwok to play, with the given capacity
// (cpu, memory, pods, and extended resources such as nvidia.com/gpu) and
// labels.
func (k *Kube) FakeNode(ctx context.Context, name string, capacity map[string]string, labels map[string]string) error {
	list := corev1.ResourceList{}
	for r, q := range map[string]string{"cpu": "32", "memory": "256Gi", "pods": "2000"} {
		list[corev1.ResourceName(r)] = resource.MustParse(q)
	}
	for r, q := range capacity {
		list[corev1.ResourceName(r)] = resource.MustParse(q)
	}
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Annotations: map[string]string{KwokAnnotation: "fake"},
			Labels:      labels,
		},
		Spec:   corev1.NodeSpec{},
		Status: corev1.NodeStatus{Capacity: list, Allocatable: list},
	}
	created, err := k.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	// The apiserver taints a new node not-ready; the controller-manager
	// that would lift the taint once kwok reports the node ready does not
	// run here.
	created.Spec.Taints = nil
	if created, err = k.Client.CoreV1().Nodes().Update(ctx, created, metav1.UpdateOptions{}); err != nil {
		return err
	}
	// Capacity is status: the create drops it.
	created.Status.Capacity, created.Status.Allocatable = list, list
	_, err = k.Client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{})
	return err
}
