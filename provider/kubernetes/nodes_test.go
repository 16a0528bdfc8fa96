package kubernetes

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/runfleet/runfleet/kubeclient/kubeclienttest"
	"github.com/runfleet/runfleet/record"
)

// waitSystem asks for a node's system until it is read.
func waitSystem(t *testing.T, p *Provider, node string) *record.System {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if s := p.nodes.Of(node); s != nil {
			return s
		}
		if time.Now().After(deadline) {
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A pod's record keeps its node's system as the kubelet reported it, read
// once however many pods ran there.
func TestNodeSystem(t *testing.T) {
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "gpu-node-1"},
		Status: corev1.NodeStatus{
			Capacity: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("96"), corev1.ResourceMemory: resource.MustParse("1056716Mi")},
			NodeInfo: corev1.NodeSystemInfo{OSImage: "Ubuntu 22.04.5 LTS", KernelVersion: "5.15.0-1071-nvidia", Architecture: "amd64",
				ContainerRuntimeVersion: "containerd://1.7.24", OperatingSystem: "linux"},
		},
	}
	cs := fake.NewClientset(node)
	gets := 0
	cs.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		gets++
		return false, nil, nil
	})
	p, err := New(Options{Client: kubeclienttest.FromClientset(cs), Namespace: "ns", Manager: "m", Pool: "r"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	got := waitSystem(t, p, "gpu-node-1")
	want := record.System{OS: "Ubuntu 22.04.5 LTS", Kernel: "5.15.0-1071-nvidia", Arch: "amd64", CPUs: 96, MemoryMiB: 1056716, Runtime: "containerd 1.7.24"}
	if got == nil || got.OS != want.OS || got.Kernel != want.Kernel || got.CPUs != want.CPUs || got.MemoryMiB != want.MemoryMiB || got.Runtime != want.Runtime {
		t.Fatalf("node system %+v, want %+v", got, want)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "m-r-1", Labels: map[string]string{LabelRunner: "r-1"}}, Spec: corev1.PodSpec{NodeName: "gpu-node-1"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	if in := p.instance(pod); in.System == nil || in.System.Kernel != want.Kernel {
		t.Errorf("the pod's instance names no system: %+v", in.System)
	}
	if gets != 1 {
		t.Errorf("the node was read %d times, want once", gets)
	}
}

// Without the right to read nodes, nothing is asked again and nothing
// fails: the records keep no system.
func TestNodeSystemForbidden(t *testing.T) {
	cs := fake.NewClientset()
	gets := 0
	cs.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		gets++
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "n1", nil)
	})
	p, err := New(Options{Client: kubeclienttest.FromClientset(cs), Namespace: "ns", Manager: "m", Pool: "r"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if s := waitSystem(t, p, "n1"); s != nil {
		t.Fatalf("a forbidden node read gave %+v", s)
	}
	_ = p.nodes.Of("n2")
	time.Sleep(50 * time.Millisecond)
	if gets != 1 {
		t.Errorf("nodes read %d times after a 403, want 1", gets)
	}
}
