package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/internal/kubenode"
	"github.com/runfleet/runfleet/internal/peers"
	kube "github.com/runfleet/runfleet/provider/kubernetes"
)

// The Kubernetes tests run a real control plane (etcd, kube-apiserver,
// kube-scheduler), one node played by kubenode on the local Docker engine,
// and runfleet's own manifests from deploy/kubernetes: the managers act
// as the runfleet service account, with exactly the RBAC those grant.
const (
	kubeNamespace = "runfleet"
	kubeNodeLabel = "runfleet.dev/test-node"
)

var (
	kubeOnce       sync.Once
	kubeCP         *peers.Kube
	kubeNode       *kubenode.Node
	kubeconfigPath string // the runfleet service account's
	kubeErr        error
)

// needKube starts the control plane and the node on first use, and
// returns the runner image.
func needKube(t testing.TB) string {
	t.Helper()
	img := needDocker(t)
	kubeOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		kubeCP, kubeErr = peers.StartKube(ctx, peers.KubeOptions{Progress: os.Stderr})
		if kubeErr != nil {
			return
		}
		for _, f := range []string{"namespace.yaml", "rbac.yaml"} {
			b, err := os.ReadFile(filepath.Join(repoRoot(), "deploy", "kubernetes", f))
			if err == nil {
				err = kubeCP.Apply(ctx, b)
			}
			if err != nil {
				kubeErr = err
				return
			}
		}
		if kubeErr = kubeCP.Namespace(ctx, kubeNamespace); kubeErr != nil {
			return
		}
		if kubeconfigPath, kubeErr = kubeCP.TokenKubeconfig(ctx, kubeNamespace, "runfleet"); kubeErr != nil {
			return
		}
		cert, err := kubeCP.ServingCert("e2e-node")
		if err != nil {
			kubeErr = err
			return
		}
		kubeNode, kubeErr = kubenode.Start(ctx, kubenode.Options{
			Name: "e2e-node", Client: kubeCP.Client, Docker: dockerCli, Dir: filepath.Join(kubeCP.Dir, "node"),
			Cert: cert, Labels: map[string]string{kubeNodeLabel: "docker"},
		})
		if kubeErr != nil {
			return
		}
		// kwok plays nodes whose pods run without containers: for
		// scheduling, pending and scale.
		if kubeErr = kubeCP.StartKwok(ctx); kubeErr == nil {
			kubeErr = kubeCP.FakeNode(ctx, "kwok-1", nil, map[string]string{kubeNodeLabel: "kwok"})
		}
	})
	peers.Need(t, "the Kubernetes control plane", kubeErr)
	return img
}

func stopKube() {
	if kubeNode != nil {
		kubeNode.Stop()
	}
	if kubeCP != nil {
		kubeCP.Stop()
	}
}

// repoRoot is the module's root, where deploy/ is.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// kubeSection is a pool's kubernetes section for the test node.
func kubeSection(img string, extra string) string {
	return "      kubeconfig: " + kubeconfigPath + "\n" +
		"      namespace: " + kubeNamespace + "\n" +
		"      image: " + img + "\n" +
		"      node_selector: {" + kubeNodeLabel + ": docker}\n" + extra
}

func (f *fleet) kubeSelector() string { return kube.LabelManager + "=e2e-" + f.repo }

// pods lists this fleet's pods.
func (f *fleet) pods() []corev1.Pod {
	l, err := kubeCP.Client.CoreV1().Pods(kubeNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: f.kubeSelector()})
	if err != nil {
		f.t.Fatalf("list pods: %v", err)
	}
	return l.Items
}

// livePods counts this fleet's pods that are not being deleted.
func (f *fleet) livePods() int {
	n := 0
	for _, p := range f.pods() {
		if p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			n++
		}
	}
	return n
}

func (f *fleet) kubeSecrets() []corev1.Secret {
	l, err := kubeCP.Client.CoreV1().Secrets(kubeNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: f.kubeSelector()})
	if err != nil {
		f.t.Fatalf("list secrets: %v", err)
	}
	return l.Items
}

// kubeLeavesNothing waits for the pods and Secrets of the fleet to go.
func (f *fleet) kubeLeavesNothing() {
	f.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for len(f.pods())+len(f.kubeSecrets()) > 0 {
		if time.Now().After(deadline) {
			f.t.Errorf("left after shutdown: %d pods, %d secrets", len(f.pods()), len(f.kubeSecrets()))
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// removePods deletes what a failed test left.
func (f *fleet) removePods() {
	ctx := context.Background()
	zero := int64(0)
	_ = kubeCP.Client.CoreV1().Pods(kubeNamespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{LabelSelector: f.kubeSelector()})
	_ = kubeCP.Client.CoreV1().Secrets(kubeNamespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: f.kubeSelector()})
}

// podLog reads a pod's agent log through the apiserver.
func podLog(name string) string {
	b, _ := kubeCP.Client.CoreV1().Pods(kubeNamespace).GetLogs(name, &corev1.PodLogOptions{Container: "runner"}).DoRaw(context.Background())
	return string(b)
}

// checkNoTokenInCluster fails when the forge token shows in any pod's
// spec, any Secret of the namespace or any pod's log.
func (f *fleet) checkNoTokenInCluster() {
	f.t.Helper()
	ctx := context.Background()
	pods, err := kubeCP.Client.CoreV1().Pods(kubeNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, p := range pods.Items {
		b, _ := json.Marshal(p)
		if strings.Contains(string(b), gitea.Token) {
			f.t.Errorf("pod %s shows the forge token", p.Name)
		}
		if strings.Contains(podLog(p.Name), gitea.Token) {
			f.t.Errorf("pod %s's log shows the forge token", p.Name)
		}
	}
	secrets, err := kubeCP.Client.CoreV1().Secrets(kubeNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, s := range secrets.Items {
		for k, v := range s.Data {
			if strings.Contains(string(v), gitea.Token) {
				f.t.Errorf("secret %s key %s holds the forge token", s.Name, k)
			}
		}
	}
	f.t.Logf("checked %d pods (specs and logs) and %d secrets: no forge token", len(pods.Items), len(secrets.Items))
}
