package kubernetes

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/kubenode"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/kubeclient"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// The cluster tests run against a real kube-apiserver, etcd and
// kube-scheduler, with kwok playing the nodes (built on first use and
// cached; see internal/testbed/peers).
var (
	kube     *peers.Kube
	kubeErr  error
	nsSerial atomic.Int64
)

func TestMain(m *testing.M) {
	code := func() int {
		flag.Parse()
		if testing.Short() {
			return m.Run()
		}
		ctx := context.Background()
		kube, kubeErr = peers.StartKube(ctx, peers.KubeOptions{Progress: os.Stderr})
		if kube != nil {
			defer kube.Stop()
		}
		if kubeErr == nil {
			kubeErr = kube.StartKwok(ctx)
		}
		if kubeErr == nil {
			kubeErr = kube.FakeNode(ctx, "kwok-1", nil, map[string]string{"pool": "cpu"})
		}
		return m.Run()
	}()
	os.Exit(code)
}

// needKube skips a test without the cluster, and fails it in CI.
func needKube(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("cluster test: skipped with -short")
	}
	peers.Need(t, "the Kubernetes control plane", kubeErr)
}

// newProvider makes a provider of a fresh namespace.
func newProvider(t *testing.T, manager string, s Section) (*Provider, string) {
	t.Helper()
	needKube(t)
	ns := fmt.Sprintf("test-%d", nsSerial.Add(1))
	if err := kube.Namespace(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return openProvider(t, ns, manager, s), ns
}

func openProvider(t *testing.T, ns, manager string, s Section) *Provider {
	t.Helper()
	if s.Image == "" {
		s.Image = "runner:latest"
	}
	if s.Workdir == "" {
		s.Workdir, s.GPUResource = DefaultWorkdir, DefaultGPUResource
	}
	cs, err := kubeclient.New(kube.Config)
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{Client: cs, Namespace: ns, Manager: manager, Pool: "cpu", Section: s, MaxLifetime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func spec(name string) provider.Spec {
	return provider.Spec{
		Name: name, Manager: "m1", Pool: "cpu",
		Command: "gitea-runner", Args: []string{"daemon", "--config", "runner.yaml"},
		Env:   map[string]string{"PATH": "/bin", "RUNNER_TOKEN": "single-use-credential"},
		Files: map[string][]byte{".runner": []byte(`{"token":"single-use-credential"}`), "runner.yaml": []byte("log: {}")},
	}
}

// waitFor polls the provider's list until ok says yes.
func waitFor(t *testing.T, p *Provider, what string, ok func([]provider.Instance) bool) []provider.Instance {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		list, err := p.List(context.Background(), "m1")
		if err != nil {
			t.Fatal(err)
		}
		if ok(list) {
			return list
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30s; listed %+v", what, list)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func byName(list []provider.Instance, name string) (provider.Instance, bool) {
	for _, i := range list {
		if i.Name == name {
			return i, true
		}
	}
	return provider.Instance{}, false
}

// A runner's pod runs (on a kwok node), is listed with its owner, is
// reported by Watch, has its Secret owned by it, and goes with its Secret
// on Delete; a second Create of the same runner returns the same pod.
func TestPodLifecycle(t *testing.T) {
	p, ns := newProvider(t, "m1", Section{})
	ctx := context.Background()
	var mu sync.Mutex
	events := map[string]int{}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go p.Watch(wctx, func(name string) { mu.Lock(); events[name]++; mu.Unlock() })

	inst, err := p.Create(ctx, spec("cpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := p.Create(ctx, spec("cpu-1"))
	if err != nil || again.ID != inst.ID {
		t.Fatalf("second Create: %v, id %s, want %s", err, again.ID, inst.ID)
	}
	list := waitFor(t, p, "pod running", func(l []provider.Instance) bool {
		i, ok := byName(l, "cpu-1")
		return ok && i.State == provider.StateRunning
	})
	if i, _ := byName(list, "cpu-1"); i.Manager != "m1" || i.Pool != "cpu" || i.ID != inst.ID || len(list) != 1 {
		t.Fatalf("listed %+v", list)
	}
	mu.Lock()
	if events["cpu-1"] == 0 {
		t.Error("Watch reported no change of cpu-1")
	}
	mu.Unlock()

	pods, err := kube.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: LabelRunner + "=cpu-1"})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("pods of cpu-1: %v %d", err, len(pods.Items))
	}
	pod := pods.Items[0]
	sec, err := kube.Client.CoreV1().Secrets(ns).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(sec.OwnerReferences) != 1 || sec.OwnerReferences[0].UID != pod.UID || sec.OwnerReferences[0].Kind != "Pod" {
		t.Errorf("secret owners %+v, want the pod %s", sec.OwnerReferences, pod.UID)
	}
	assertNoCredential(t, &pod)

	if err := p.Delete(ctx, "cpu-1"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, p, "pod gone from the list", func(l []provider.Instance) bool { return len(l) == 0 })
	if _, err := kube.Client.CoreV1().Secrets(ns).Get(ctx, pod.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("secret after Delete: %v, want not found", err)
	}
	if err := p.Delete(ctx, "cpu-1"); err != nil {
		t.Errorf("second Delete: %v", err)
	}
}

// assertNoCredential fails when the pod's spec shows the credential.
func assertNoCredential(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	b, err := pod.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "single-use-credential") {
		t.Errorf("pod %s shows the runner's credential in its spec", pod.Name)
	}
}

// A manager restarted lists the pods its last run made; another
// manager's pods are not its own.
func TestAdoptionByLabel(t *testing.T) {
	p, ns := newProvider(t, "m1", Section{})
	ctx := context.Background()
	first, err := p.Create(ctx, spec("cpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	again := openProvider(t, ns, "m1", Section{})
	list := waitFor(t, again, "adopted", func(l []provider.Instance) bool { return len(l) == 1 })
	if list[0].ID != first.ID {
		t.Fatalf("adopted %+v, want %s", list[0], first.ID)
	}
	other := openProvider(t, ns, "m2", Section{})
	if l, err := other.List(ctx, "m2"); err != nil || len(l) != 0 {
		t.Fatalf("manager m2 lists %+v, %v", l, err)
	}
	if l, err := other.List(ctx, "m1"); err != nil || len(l) != 1 {
		t.Fatalf("manager m2 listing m1's pods: %+v, %v", l, err)
	}
}

// A pod that no node can take stays Pending with the scheduler's reason,
// queued: it waits for a node (within pending_timeout).
func TestUnschedulableReason(t *testing.T) {
	p, _ := newProvider(t, "m1", Section{NodeSelector: map[string]string{"pool": "nowhere"}})
	if _, err := p.Create(context.Background(), spec("cpu-1")); err != nil {
		t.Fatal(err)
	}
	list := waitFor(t, p, "reason", func(l []provider.Instance) bool {
		return len(l) == 1 && l[0].Reason != ""
	})
	if list[0].State != provider.StateCreated || !strings.Contains(list[0].Reason, "Unschedulable") || !list[0].Queued || list[0].Refused != "" {
		t.Fatalf("pending pod listed %+v, want created and Unschedulable", list[0])
	}
	t.Logf("reason: %s", list[0].Reason)
}

// An evicted pod is reported as taken back, once, and listed as exited.
func TestEvictionNotice(t *testing.T) {
	p, ns := newProvider(t, "m1", Section{})
	ctx := context.Background()
	notices := make(chan provider.Notice, 4)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go p.WatchPreemption(wctx, func(n provider.Notice) { notices <- n })
	inst, err := p.Create(ctx, spec("cpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, p, "running", func(l []provider.Instance) bool { return len(l) == 1 && l[0].State == provider.StateRunning })
	pods, _ := kube.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	err = kube.Client.CoreV1().Pods(ns).EvictV1(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: pods.Items[0].Name, Namespace: ns}})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-notices:
		if n.Name != "cpu-1" || n.ID != inst.ID || n.Reason == "" {
			t.Fatalf("notice %+v", n)
		}
		t.Logf("notice: %+v", n)
	case <-time.After(30 * time.Second):
		t.Fatal("no notice of the eviction")
	}
	select {
	case n := <-notices:
		t.Fatalf("a second notice: %+v", n)
	case <-time.After(time.Second):
	}
}

// A pod really runs, on a node agent that runs it in Docker: the init
// container copies the runner's files from the Secret into the work
// directory, the agent sees its environment from the Secret, the dataset
// is read-only, and its output comes back through pods/log, also after
// it ended. The node writes the Secret's files as a kubelet does (root's,
// mode 0400), so an image that runs as a user of its own, as GitHub's
// actions-runner does, reads them only through the pod's fsGroup. A pod
// runs as uid 1001 unless its pool asks for root.
func TestPodRunsOnANode(t *testing.T) {
	needKube(t)
	cli, img := needDocker(t)
	node := startNode(t, cli, "node-docker", "docker")
	runsAsUsers(t, cli, img, "docker", node, nil)
}

// The same pods on a real kubelet (k8s.io/kubernetes at peers.KubeVersion,
// Debian's containerd and runc): the Secret's files as the kubelet itself
// writes them, the user as the runtime sets it. An image that runs as uid
// 1001 reads its credential only through the pod's fsGroup. The pods use
// the host's network (pod_template): no CNI plugin runs here.
func TestPodOnARealKubelet(t *testing.T) {
	needKube(t)
	cli, img := needDocker(t)
	nonRoot, err := peers.UserImage(context.Background(), cli, img, "", "1001:1001")
	if err != nil {
		t.Fatal(err)
	}
	kl, err := kube.StartKubelet(context.Background(), peers.KubeletOptions{Name: "kubelet-1", Labels: map[string]string{"pool": "kubelet"},
		Images: []string{img, nonRoot}, Base: img, Docker: cli, Progress: os.Stderr})
	peers.Need(t, "a real kubelet", err)
	t.Cleanup(kl.Stop)
	runsAsUsers(t, cli, img, "kubelet", nil, json.RawMessage(`{"spec":{"hostNetwork":true}}`))
}

// runsAsUsers runs podRuns on the nodes labelled pool=pool for a root
// image (run as the pods' default user), a uid-1001 image (its own user)
// and a pool that asks for root; tmpl is the pools' pod_template, node
// the kubenode that runs them, if one does.
func runsAsUsers(t *testing.T, cli *client.Client, img, pool string, node *kubenode.Node, tmpl json.RawMessage) {
	ctx := context.Background()
	nonRoot, err := peers.UserImage(ctx, cli, img, "", "1001:1001")
	if err != nil {
		t.Fatal(err)
	}
	data := t.TempDir()
	os.WriteFile(data+"/hello.txt", []byte("dataset-content\n"), 0o644)
	os.Chmod(data, 0o777)
	for _, tc := range []struct {
		name, image, uid string
		sc               *corev1.PodSecurityContext
	}{
		{"root image", img, "1001", nil},
		{"user 1001", nonRoot, "1001", nil},
		{"root pool", img, "0", &corev1.PodSecurityContext{RunAsUser: new(int64(0))}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := fmt.Sprintf("test-%d", nsSerial.Add(1))
			if err := kube.Namespace(ctx, ns); err != nil {
				t.Fatal(err)
			}
			p := openProvider(t, ns, "m1", Section{Image: tc.image, NodeSelector: map[string]string{"pool": pool},
				Volumes: []string{data + ":/data"}, SecurityContext: tc.sc, PodTemplate: tmpl})
			podRuns(t, p, node, ns, tc.uid)
		})
	}
}

// A pool that asks for root and runAsNonRoot at once gets a pod the
// kubelet holds in CreateContainerConfigError: the provider lists it
// refused, with the kubelet's words and what to change.
func TestPodRefusedAsRoot(t *testing.T) {
	needKube(t)
	ctx := context.Background()
	cli, img := needDocker(t)
	startNode(t, cli, "node-nonroot", "nonroot")
	ns := fmt.Sprintf("test-%d", nsSerial.Add(1))
	if err := kube.Namespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	p := openProvider(t, ns, "m1", Section{Image: img, NodeSelector: map[string]string{"pool": "nonroot"},
		SecurityContext: &corev1.PodSecurityContext{RunAsUser: new(int64(0)), RunAsNonRoot: new(true)}})
	if _, err := p.Create(ctx, spec("cpu-1")); err != nil {
		t.Fatal(err)
	}
	list := waitFor(t, p, "refused", func(l []provider.Instance) bool { return len(l) == 1 && l[0].Refused != "" })
	t.Logf("refused: %s", list[0].Refused)
	if !strings.Contains(list[0].Refused, "breaks non-root policy") || !strings.Contains(list[0].Refused, "runAsUser: 0") {
		t.Errorf("refused %q", list[0].Refused)
	}
}

// startNode starts a node agent named name, labelled pool=pool, that runs
// its pods on the local engine, until the test ends.
func startNode(t *testing.T, cli *client.Client, name, pool string) *kubenode.Node {
	t.Helper()
	cert, err := kube.ServingCert(name)
	if err != nil {
		t.Fatal(err)
	}
	node, err := kubenode.Start(context.Background(), kubenode.Options{Name: name, Client: kube.Client, Docker: cli, Dir: t.TempDir(), Cert: cert, Labels: map[string]string{"pool": pool}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(node.Stop)
	return node
}

func podRuns(t *testing.T, p *Provider, node *kubenode.Node, ns, uid string) {
	ctx := context.Background()
	sp := spec("cpu-1")
	sp.Command = "/bin/sh"
	sp.Args = []string{"-c", `cat .runner; echo; echo "token=$RUNNER_TOKEN"; cat /data/hello.txt; if touch /data/x 2>/dev/null; then echo writable; else echo read-only; fi; ls -ln .runner; echo "uid=$(id -u)"`}
	inst, err := p.Create(ctx, sp)
	if err != nil {
		t.Fatal(err)
	}
	list := waitFor(t, p, "pod ended", func(l []provider.Instance) bool { return len(l) == 1 && l[0].State == provider.StateExited })
	if list[0].Reason != "" {
		t.Errorf("ended with reason %q", list[0].Reason)
	}
	r, err := p.Output(ctx, inst, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r)
	out := string(b)
	t.Logf("output:\n%s", out)
	for _, want := range []string{`{"token":"single-use-credential"}`, "token=single-use-credential", "dataset-content", "read-only", "uid=" + uid} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	// The copy is the agent's user's alone.
	if !regexp.MustCompile(`-rw------- +1 +` + uid + ` `).MatchString(out) {
		t.Errorf("the copy of .runner is not %s's, mode 0600", uid)
	}
	if err := p.Delete(ctx, "cpu-1"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, p, "gone", func(l []provider.Instance) bool { return len(l) == 0 })
	// The output outlives the pod, for the pool's last look.
	if r, err := p.Output(ctx, inst, 1<<20); err != nil {
		t.Errorf("output after the pod went: %v", err)
	} else {
		r.Close()
	}
	eventually(t, "pod object gone", func() bool {
		l, _ := kube.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		n := 0
		if node != nil { // kubenode's containers, gone with the pod
			n, _ = node.Containers(ctx)
		}
		return len(l.Items) == 0 && n == 0
	})
}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

var (
	dockerOnce sync.Once
	dockerCli  *client.Client
	dockerImg  string
	dockerErr  error
)

// needDocker returns a client of the local engine and an image with a
// shell and busybox, built FROM scratch on first use.
func needDocker(t *testing.T) (*client.Client, string) {
	t.Helper()
	dockerOnce.Do(func() {
		dockerCli, dockerErr = client.New(client.FromEnv)
		if dockerErr != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if _, dockerErr = dockerCli.Ping(ctx, client.PingOptions{}); dockerErr == nil {
			dockerImg, dockerErr = peers.RunnerImage(ctx, dockerCli, "")
		}
	})
	peers.Need(t, "Docker", dockerErr)
	return dockerCli, dockerImg
}

// The driver connects through a kubeconfig, as `serve` does, and lists.
func TestDriverOpensWithKubeconfig(t *testing.T) {
	needKube(t)
	ctx := context.Background()
	ns := fmt.Sprintf("test-%d", nsSerial.Add(1))
	if err := kube.Namespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	raw := fmt.Appendf(nil, `{"kubeconfig": %q, "namespace": %q, "image": "x"}`, kube.Kubeconfig, ns)
	prov, err := driver{}.Open(t.Context(), provider.PoolConfig{Manager: "m1", Pool: "cpu", Section: raw})
	if err != nil {
		t.Fatal(err)
	}
	defer prov.(*Provider).Close()
	lctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, err := prov.List(lctx, "m1"); err != nil {
		t.Fatal(err)
	}
	if _, err := prov.Create(lctx, spec("cpu-1")); err != nil {
		t.Fatal(err)
	}
	if n := prov.(*Provider).Calls(); n < 3 {
		t.Errorf("%d calls counted", n)
	}
}

// A Secret of the pool whose pod is gone (a cluster without a garbage
// collector) is swept, and so is a pod whose Secret never came (a manager
// killed between the two creates); the Secret of a pod that exists, and
// that pod, are kept.
func TestOrphanSecretsSwept(t *testing.T) {
	defer func(age time.Duration) { orphanSecretAge = age }(orphanSecretAge)
	orphanSecretAge = 0
	p, ns := newProvider(t, "m1", Section{})
	ctx := context.Background()
	if _, err := p.Create(ctx, spec("cpu-1")); err != nil {
		t.Fatal(err)
	}
	// The first provider sweeps (its first List) before the orphans are
	// made, so that the second's sweep is the one tried, whatever the load.
	if _, err := p.List(ctx, "m1"); err != nil {
		t.Fatal(err)
	}
	orphan := runnerSecret("m1-cpu-2-zzzzz", spec("cpu-2"))
	if _, err := kube.Client.CoreV1().Secrets(ns).Create(ctx, orphan, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// And a pod whose Secret never came: it would wait for it. A kubelet
	// keeps such a pod Pending (ContainerCreating, FailedMount "secret not
	// found"): a Secret that cannot be fetched makes it retry running the
	// pod (https://kubernetes.io/docs/concepts/configuration/secret/#using-a-secret);
	// kwok's fast stages run it at once, and a Running pod is not swept:
	// the test failed whenever the second provider's sweep came after
	// that. A node selector no node matches keeps it Pending here as the
	// kubelet would.
	lone, err := p.podFor("m1-cpu-3-zzzzz", p.withRecord(spec("cpu-3")))
	if err != nil {
		t.Fatal(err)
	}
	lone.Spec.NodeSelector = map[string]string{"runfleet-test": "no-such-node"}
	if _, err := kube.Client.CoreV1().Pods(ns).Create(ctx, lone, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, p, "the pod listed", func(l []provider.Instance) bool {
		return slices.ContainsFunc(l, func(i provider.Instance) bool { return i.Name == "cpu-1" })
	})
	again := openProvider(t, ns, "m1", Section{}) // sweeps at its first List
	if _, err := again.List(ctx, "m1"); err != nil {
		t.Fatal(err)
	}
	if names := secretNames(t, ns); len(names) != 1 || !strings.HasPrefix(names[0], "m1-cpu-1-") {
		t.Errorf("secrets after the sweep: %v, want only the pod's", names)
	}
	eventually(t, "the pod without its Secret deleted", func() bool {
		_, err := kube.Client.CoreV1().Pods(ns).Get(ctx, "m1-cpu-3-zzzzz", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if l, _ := kube.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); len(l.Items) != 1 {
		t.Errorf("%d pods after the sweep, want the one with its Secret", len(l.Items))
	}
}

// secretNames lists the Secrets of a namespace.
func secretNames(t *testing.T, ns string) []string {
	t.Helper()
	list, err := kube.Client.CoreV1().Secrets(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range list.Items {
		names = append(names, s.Name)
	}
	return names
}

// Close deletes a Secret without its pod however young: a manager that
// drains soon after it started leaves none behind.
func TestCloseSweepsYoungOrphanSecret(t *testing.T) {
	p, ns := newProvider(t, "m1", Section{})
	ctx := context.Background()
	if _, err := p.Create(ctx, spec("cpu-1")); err != nil {
		t.Fatal(err)
	}
	orphan := runnerSecret("m1-cpu-2-yyyyy", spec("cpu-2"))
	if _, err := kube.Client.CoreV1().Secrets(ns).Create(ctx, orphan, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, p, "the pod listed", func(l []provider.Instance) bool { return len(l) == 1 })
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if names := secretNames(t, ns); len(names) != 1 || !strings.HasPrefix(names[0], "m1-cpu-1-") {
		t.Errorf("secrets after Close: %v, want only the pod's", names)
	}
}

// A stock image without the agent: the init container fetches it from
// the release server, checks its SHA-256 and the agent runs; a file that
// does not match stops the pod before the agent runs, and the pool's
// reason says so.
func TestPodInstallsAgent(t *testing.T) {
	needKube(t)
	ctx := context.Background()
	cli, img := needDocker(t)
	agent := []byte("#!/bin/sh\necho agent-ran-as-$(id -u)\n")
	sum := sha256.Sum256(agent)
	// On every address: the node's containers reach it through the
	// host's gateway (host.docker.internal), as a pod reaches a mirror.
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/agent-linux-amd64" {
			http.NotFound(w, r)
			return
		}
		w.Write(agent)
	})}
	go srv.Serve(ln)
	defer srv.Close()
	url := fmt.Sprintf("http://host.docker.internal:%d/v1/agent-linux-amd64", ln.Addr().(*net.TCPAddr).Port)
	startNode(t, cli, "node-install", "install")
	for _, tc := range []struct {
		name, sha256, want string
	}{
		{"checked", hex.EncodeToString(sum[:]), ""},
		{"mismatch", strings.Repeat("0", 64), "checksum mismatch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := fmt.Sprintf("test-%d", nsSerial.Add(1))
			if err := kube.Namespace(ctx, ns); err != nil {
				t.Fatal(err)
			}
			s := Section{Image: img, NodeSelector: map[string]string{"pool": "install"}, Install: Install{Agent: vm.Download{URL: url, SHA256: tc.sha256}}}
			if err := (vm.Install{Agent: s.Install.Agent}).Check(); err != nil {
				t.Fatal(err)
			}
			p := openProvider(t, ns, "m1", s)
			sp := spec("cpu-1")
			sp.Command, sp.Args = vm.AgentDir+"/agent-linux-amd64", nil
			inst, err := p.Create(ctx, sp)
			if err != nil {
				t.Fatal(err)
			}
			list := waitFor(t, p, "pod ended", func(l []provider.Instance) bool { return len(l) == 1 && l[0].State == provider.StateExited })
			t.Logf("reason: %q", list[0].Reason)
			if tc.want != "" {
				if !strings.Contains(list[0].Reason, tc.want) || !strings.Contains(list[0].Reason, url) {
					t.Errorf("reason %q does not say %q of %s", list[0].Reason, tc.want, url)
				}
				return
			}
			r, err := p.Output(ctx, inst, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(r)
			// The pod's default user runs it, whatever the image's.
			if list[0].Reason != "" || !strings.Contains(string(b), "agent-ran-as-1001") {
				t.Errorf("reason %q, output %q", list[0].Reason, b)
			}
		})
	}
}
