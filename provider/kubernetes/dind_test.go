package kubernetes

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/runfleet/runfleet/kubeclient/kubeclienttest"
	"github.com/runfleet/runfleet/provider"
)

// docker: dind gives the pod a Docker daemon as a native sidecar that
// starts after the runner's files are copied and before the agent, runs
// privileged as root in a pod of a non-root agent, shares with the agent
// its socket and, at the same paths, the work directory, the datasets
// and the shared paths, and never the credential's volume.
func TestDindPod(t *testing.T) {
	s := decode(t, `
image: runner:1
volumes: ["host:/models:/models"]
docker: dind
dind: {shared_paths: [/home/runner/_work], storage_size_limit: 50Gi}
security_context: {fsGroup: 2000}
`, 0)
	p, err := New(Options{Client: kubeclienttest.FromClientset(fake.NewClientset()), Namespace: "ns", Manager: "m", Pool: "r", Section: s})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	pod, err := p.podFor("m-r-1", provider.Spec{Name: "r-1", Command: "agent", Env: map[string]string{"TOKEN": "t"}, Files: map[string][]byte{".runner": []byte("x")}})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range pod.Spec.InitContainers {
		names = append(names, c.Name)
	}
	if !slices.Equal(names, []string{filesContainer, dindContainer}) {
		t.Fatalf("init containers %v, want files then dind", names)
	}
	d := pod.Spec.InitContainers[1]
	if d.RestartPolicy == nil || *d.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("dind restartPolicy %v, want Always (a native sidecar)", d.RestartPolicy)
	}
	if d.Image != DefaultDindImage || !slices.Equal(d.Args, []string{"dockerd", "--host=unix:///var/run/docker.sock", "--group=2000"}) {
		t.Errorf("dind image %s, args %v", d.Image, d.Args)
	}
	sc := d.SecurityContext
	if sc == nil || !*sc.Privileged || *sc.RunAsUser != 0 || *sc.RunAsNonRoot {
		t.Errorf("dind security context %+v", sc)
	}
	if d.StartupProbe == nil || d.StartupProbe.Exec == nil || !slices.Equal(d.StartupProbe.Exec.Command, []string{"docker", "info"}) {
		t.Errorf("dind startup probe %+v", d.StartupProbe)
	}
	if ps := pod.Spec.SecurityContext; !*ps.RunAsNonRoot || *ps.RunAsUser != DefaultRunAsUser {
		t.Errorf("the pod's security context %+v: the agent is no longer non-root", ps)
	}
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range d.VolumeMounts {
		mounts[m.Name] = m
	}
	for name, at := range map[string]string{dindSocket: "/var/run", dindStorage: "/var/lib/docker", workVolume: DefaultWorkdir,
		dataVolume(0): "/models", sharedVolume(0): "/home/runner/_work"} {
		if mounts[name].MountPath != at {
			t.Errorf("dind mounts %s at %q, want %s", name, mounts[name].MountPath, at)
		}
	}
	if !mounts[dataVolume(0)].ReadOnly {
		t.Error("dind mounts the dataset read-write")
	}
	if _, ok := mounts[filesVolume]; ok || len(d.EnvFrom) > 0 || slices.ContainsFunc(d.Env, func(e corev1.EnvVar) bool { return e.ValueFrom != nil }) {
		t.Error("dind sees the runner's credential")
	}
	agent := pod.Spec.Containers[0]
	if !slices.Contains(agent.Env, corev1.EnvVar{Name: "DOCKER_HOST", Value: "unix:///var/run/docker.sock"}) {
		t.Errorf("agent env %v: no DOCKER_HOST", agent.Env)
	}
	for _, name := range []string{dindSocket, sharedVolume(0)} {
		if !slices.ContainsFunc(agent.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == name && m.MountPath == mounts[name].MountPath }) {
			t.Errorf("agent does not mount %s where dind does", name)
		}
	}
	for _, v := range pod.Spec.Volumes {
		if v.Name == dindStorage && (v.EmptyDir == nil || v.EmptyDir.SizeLimit.String() != "50Gi") {
			t.Errorf("dind storage %+v", v.VolumeSource)
		}
	}

	// Without docker: dind, no sidecar and no DOCKER_HOST.
	p = &Provider{opt: Options{Section: decode(t, "{image: runner:1}", 0)}}
	pod, err = p.podFor("m-r-1", provider.Spec{Name: "r-1", Command: "agent"})
	if err != nil {
		t.Fatal(err)
	}
	if len(pod.Spec.InitContainers) != 1 || slices.ContainsFunc(pod.Spec.Containers[0].Env, func(e corev1.EnvVar) bool { return e.Name == "DOCKER_HOST" }) {
		t.Errorf("a pool without docker has %d init containers, env %v", len(pod.Spec.InitContainers), pod.Spec.Containers[0].Env)
	}
}

// The dind keys are checked, and a template may add to the pod but not
// take the daemon, its socket or the agent's DOCKER_HOST away.
func TestDindSectionErrors(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{`{image: x, docker: socket}`, `kubernetes.docker: "socket" is not a Docker mode`},
		{`{image: x, dind: {image: docker:27-dind}}`, `kubernetes.dind: is set but docker is not "dind"`},
		{`{image: x, docker: dind, dind: {shared_paths: [rel]}}`, "kubernetes.dind.shared_paths[0]: \"rel\" must be an absolute path"},
		{`{image: x, docker: dind, dind: {shared_paths: [/var/run]}}`, "is the daemon's own"},
		{`{image: x, docker: dind, dind: {shared_paths: [/runner]}}`, "is the work directory"},
		{`{image: x, docker: dind, dind: {storage_size_limit: lots}}`, "kubernetes.dind.storage_size_limit"},
		{`{image: x, docker: dind, pod_template: {spec: {initContainers: [{name: dind, image: other}]}}}`, `"dind" runs the jobs' Docker daemon`},
		{`{image: x, docker: dind, pod_template: {spec: {volumes: [{name: dind-sock, hostPath: {path: /var/run}}]}}}`, `"dind-sock" is runfleet's`},
		{`{image: x, docker: dind, pod_template: {spec: {containers: [{name: runner, env: [{name: DOCKER_HOST, value: "tcp://elsewhere:2375"}]}]}}}`, "env: DOCKER_HOST"},
	} {
		raw, err := jsonOf(tc.yaml)
		if err != nil {
			t.Fatal(err)
		}
		if _, err = DecodeSection(raw, 0); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
	// A template's own init container runs after the files are copied
	// and before the daemon starts (to fill a shared path).
	s := decode(t, `{image: x, docker: dind, dind: {shared_paths: [/ext]}, pod_template: {spec: {initContainers: [{name: copy, image: x}]}}}`, 0)
	pod, err := (&Provider{opt: Options{Section: s}}).podFor("m-r-1", provider.Spec{Name: "r-1", Command: "agent"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range pod.Spec.InitContainers {
		names = append(names, c.Name)
	}
	if !slices.Equal(names, []string{filesContainer, "copy", dindContainer}) {
		t.Errorf("init containers %v", names)
	}
}

// An apiserver without native sidecars (before 1.29) drops the
// sidecar's restartPolicy, as it drops any field of a disabled feature
// (pkg/api/pod/util.go, dropDisabledFields); such a pod would never leave
// its init phase. Create deletes it and refuses, saying why.
func TestDindWithoutNativeSidecars(t *testing.T) {
	cs := fake.NewClientset()
	cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		pod := a.(k8stesting.CreateAction).GetObject().(*corev1.Pod)
		for i := range pod.Spec.InitContainers {
			pod.Spec.InitContainers[i].RestartPolicy = nil
		}
		return false, nil, nil // the tracker stores it so
	})
	s := decode(t, "{image: x, docker: dind}", 0)
	p, err := New(Options{Client: kubeclienttest.FromClientset(cs), Namespace: "ns", Manager: "m1", Pool: "cpu", Section: s})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	_, err = p.Create(context.Background(), provider.Spec{Name: "cpu-1", Manager: "m1", Pool: "cpu", Command: "agent"})
	if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "Kubernetes 1.29") {
		t.Errorf("create on a cluster without native sidecars: %v", err)
	}
	if l, _ := cs.CoreV1().Pods("ns").List(context.Background(), metav1.ListOptions{}); len(l.Items) != 0 {
		t.Errorf("%d pods left", len(l.Items))
	}
}
