package kubernetes

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/runfleet/runfleet/kubeclient/kubeclienttest"
	"github.com/runfleet/runfleet/provider"
)

// A pass may list a pod ended (the informer's cache is updated before its
// handlers run) while the provider still holds a log read as it ran: that
// log would say the agent was mid-job, and the pool would report a job
// that finished as lost with its agent (TestChaosKube). The pod listed
// ended is read once more, however fresh the last read.
func TestOutputOfAPodListedEnded(t *testing.T) {
	cs := fake.NewClientset()
	var log atomic.Value
	log.Store("declare successfully\ntask 7 repo is o/r\n")
	cs.PrependReactor("get", "pods/log", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, &runtime.Unknown{Raw: []byte(log.Load().(string))}, nil
	})
	p, err := New(Options{Client: kubeclienttest.FromClientset(cs), Namespace: "ns", Manager: "m1", Pool: "cpu", LogInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	ctx := context.Background()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "m1-cpu-1-bcdfg", Namespace: "ns", UID: "uid-1",
			Labels: map[string]string{LabelManager: "m1", LabelPool: "cpu", LabelRunner: "cpu-1"}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{
			{Name: agentContainer, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}},
	}
	if _, err := cs.CoreV1().Pods("ns").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	running := provider.Instance{Name: "cpu-1", ID: "uid-1", State: provider.StateRunning}
	eventually(t, "output of the running pod", func() bool { return read(t, p, running) != "" })

	// The job ends and the pod with it; the handler has not run yet.
	log.Store("declare successfully\ntask 7 repo is o/r\nrunner: cpu-1 shutdown initiated\n")
	if got := read(t, p, running); got == log.Load() {
		t.Fatalf("a running pod's log was read again within LogInterval")
	}
	ended := running
	ended.State = provider.StateExited
	if got, want := read(t, p, ended), log.Load().(string); got != want {
		t.Errorf("output of a pod listed ended = %q, want its last log %q", got, want)
	}
	// That read was the last: the log is not read again.
	log.Store("never read")
	if got := read(t, p, ended); got == "never read" {
		t.Errorf("an ended pod's log was read again after its final read")
	}
}

func read(t *testing.T, p *Provider, inst provider.Instance) string {
	t.Helper()
	r, err := p.Output(context.Background(), inst, 1<<20)
	if err == provider.ErrNoOutput {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b, _ := io.ReadAll(r)
	return string(b)
}

// The apiserver's answers that no retry changes halt the pool
// (provider.ErrRejected); an exceeded quota does only while none of the
// pool's pods holds quota that its end would free. The messages are the
// apiserver's (staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota
// "exceeded quota: %s, requested: %s, used: %s, limited: %s"; RBAC's
// forbidden).
func TestCreateRefusals(t *testing.T) {
	quota := apierrors.NewForbidden(corev1.Resource("pods"), "m1-cpu-2-bcdfg",
		errors.New("exceeded quota: ci, requested: pods=1, used: pods=1, limited: pods=1"))
	for _, tc := range []struct {
		name     string
		err      error
		running  bool
		rejected bool
	}{
		{"forbidden", apierrors.NewForbidden(corev1.Resource("pods"), "", errors.New(`User "system:serviceaccount:ci:runfleet" cannot create resource "pods" in API group "" in the namespace "ci"`)), false, true},
		{"invalid", apierrors.NewInvalid(corev1.SchemeGroupVersion.WithKind("Pod").GroupKind(), "x", nil), false, true},
		{"no namespace", apierrors.NewNotFound(corev1.Resource("namespaces"), "ci"), false, true},
		{"quota, nothing of ours", quota, false, true},
		{"quota, a pod of ours holds it", quota, true, false},
		{"server timeout", apierrors.NewServerTimeout(corev1.Resource("pods"), "create", 1), false, false},
		{"too many requests", apierrors.NewTooManyRequests("slow down", 1), false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := fake.NewClientset()
			if tc.running {
				cs = fake.NewClientset(&corev1.Pod{
					ObjectMeta: metav1.ObjectMeta{Name: "m1-cpu-1-bcdfg", Namespace: "ns", UID: "uid-1",
						Labels: map[string]string{LabelManager: "m1", LabelPool: "cpu", LabelRunner: "cpu-1"}},
					Status: corev1.PodStatus{Phase: corev1.PodRunning}})
			}
			cs.PrependReactor("create", "pods", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
			p, err := New(Options{Client: kubeclienttest.FromClientset(cs), Namespace: "ns", Manager: "m1", Pool: "cpu", Section: Section{Image: "r", Workdir: DefaultWorkdir}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			_, err = p.Create(context.Background(), provider.Spec{Name: "cpu-2", Manager: "m1", Pool: "cpu", Command: "agent"})
			if err == nil || errors.Is(err, provider.ErrRejected) != tc.rejected {
				t.Errorf("error %v: rejected %v, want %v", err, errors.Is(err, provider.ErrRejected), tc.rejected)
			}
		})
	}
}
