package harness

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/kubenode"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	kube "github.com/runfleet/runfleet/provider/kubernetes"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The Kubernetes tests run a real control plane (etcd, kube-apiserver,
// kube-scheduler), one node played by kubenode on the local Docker engine,
// and runfleet's own manifests from deploy/kubernetes: the managers act
// as the runfleet service account, with exactly the RBAC those grant.
const (
	KubeNamespace       = "runfleet"         // the manager's: its Lease
	KubeRunnerNamespace = "runfleet-runners" // the runner pods' own
	KubeNodeLabel       = "runfleet.dev/test-node"
)

// KubeNode is the name of the node that runs pods on the Docker engine.
var KubeNode string

var (
	kubeOnce       sync.Once
	KubeCP         *peers.Kube
	kubeNode       *kubenode.Node
	KubeconfigPath string // the runfleet service account's
	kubeErr        error
)

// NeedKube starts the control plane and the node on first use, and
// returns the runner image.
func NeedKube(t testing.TB) string {
	t.Helper()
	img := NeedDocker(t)
	kubeOnce.Do(func() {
		// On a cold cache this builds etcd, Kubernetes and kwok one after
		// the other: about 15 minutes on two idle cores, and 16 for
		// Kubernetes alone beside other packages' tests, which a 20-minute
		// budget for all three did not survive. Once cached, seconds.
		ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
		defer cancel()
		KubeCP, kubeErr = peers.StartKube(ctx, peers.KubeOptions{Progress: os.Stderr})
		if kubeErr != nil {
			return
		}
		for _, f := range []string{"namespace.yaml", "rbac.yaml"} {
			b, err := os.ReadFile(filepath.Join(RepoRoot(), "deploy", "kubernetes", f))
			if err == nil {
				err = KubeCP.Apply(ctx, b)
			}
			if err != nil {
				kubeErr = err
				return
			}
		}
		for _, ns := range []string{KubeNamespace, KubeRunnerNamespace} {
			if kubeErr = KubeCP.Namespace(ctx, ns); kubeErr != nil {
				return
			}
		}
		if KubeconfigPath, kubeErr = KubeCP.TokenKubeconfig(ctx, KubeNamespace, "runfleet", KubeRunnerNamespace); kubeErr != nil {
			return
		}
		// A node name of this process's own: kubenode removes every
		// container labelled with its name when it stops, and packages
		// running side by side share the Docker engine.
		nodeName := fmt.Sprintf("e2e-node-%d", os.Getpid())
		KubeNode = nodeName
		cert, err := KubeCP.ServingCert(nodeName)
		if err != nil {
			kubeErr = err
			return
		}
		kubeNode, kubeErr = kubenode.Start(ctx, kubenode.Options{
			Name: nodeName, Client: KubeCP.Client, Docker: DockerCli, Dir: filepath.Join(KubeCP.Dir, "node"),
			// disktype, ram and gpu: the labels of cml.dev's
			// --cloud-kubernetes-node-selector examples (ref/runner.md),
			// gpu's value the model CML infers for k80, whose pods ask
			// for a GPU the node has (the containers get none: no GPU
			// here).
			Cert: cert, Labels: map[string]string{KubeNodeLabel: "docker", "disktype": "ssd", "ram": "huge", "gpu": "nvidia-tesla-k80"},
			Capacity: corev1.ResourceList{kube.DefaultGPUResource: resource.MustParse("2")},
		})
		if kubeErr != nil {
			return
		}
		// kwok plays nodes whose pods run without containers: for
		// scheduling, pending and scale.
		if kubeErr = KubeCP.StartKwok(ctx); kubeErr == nil {
			kubeErr = KubeCP.FakeNode(ctx, "kwok-1", nil, map[string]string{KubeNodeLabel: "kwok"})
		}
	})
	peers.Need(t, "the Kubernetes control plane", kubeErr)
	return kubeImage(t, img)
}

var (
	kubeImageOnce sync.Once
	kubeImageTag  string
	kubeImageErr  error
)

// kubeImage is the runner image that the pods run: the root one made a
// user's, uid 1001 with a home of its own, as the project's own images
// (images/) and GitHub's actions-runner run. A pod reads its credential
// only through its fsGroup, as on a real kubelet.
func kubeImage(t testing.TB, root string) string {
	t.Helper()
	kubeImageOnce.Do(func() {
		kubeImageTag, kubeImageErr = peers.UserImage(context.Background(), DockerCli, root, "", "1001:1001")
	})
	peers.Need(t, "the non-root runner image", kubeImageErr)
	return kubeImageTag
}

func stopKube() {
	if kubeNode != nil {
		kubeNode.Stop()
	}
	if KubeCP != nil {
		KubeCP.Stop()
	}
}

// KubeSection is a pool's kubernetes section for the test node.
func KubeSection(img string, extra string) string {
	return "      kubeconfig: " + KubeconfigPath + "\n" +
		"      namespace: " + KubeRunnerNamespace + "\n" +
		"      image: " + img + "\n" +
		"      node_selector: {" + KubeNodeLabel + ": docker}\n" + extra
}

func (f *Fleet) KubeSelector() string { return kube.LabelManager + "=e2e-" + f.Repo }

// Pods lists this fleet's pods.
func (f *Fleet) Pods() []corev1.Pod {
	l, err := KubeCP.Client.CoreV1().Pods(KubeRunnerNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: f.KubeSelector()})
	if err != nil {
		f.T.Fatalf("list pods: %v", err)
	}
	return l.Items
}

// LivePods counts this fleet's pods that are not being deleted.
func (f *Fleet) LivePods() int {
	n := 0
	for _, p := range f.Pods() {
		if p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			n++
		}
	}
	return n
}

func (f *Fleet) kubeSecrets() []corev1.Secret {
	l, err := KubeCP.Client.CoreV1().Secrets(KubeRunnerNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: f.KubeSelector()})
	if err != nil {
		f.T.Fatalf("list secrets: %v", err)
	}
	return l.Items
}

// KubeLeavesNothing waits for the pods and Secrets of the fleet to go.
func (f *Fleet) KubeLeavesNothing() {
	f.T.Helper()
	deadline := time.Now().Add(time.Minute)
	for len(f.Pods())+len(f.kubeSecrets()) > 0 {
		if time.Now().After(deadline) {
			f.T.Errorf("left after shutdown: %d pods, %d secrets", len(f.Pods()), len(f.kubeSecrets()))
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// removePods deletes what a failed test left.
func (f *Fleet) removePods() {
	ctx := context.Background()
	zero := int64(0)
	_ = KubeCP.Client.CoreV1().Pods(KubeRunnerNamespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{LabelSelector: f.KubeSelector()})
	_ = KubeCP.Client.CoreV1().Secrets(KubeRunnerNamespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: f.KubeSelector()})
}

// podLog reads a pod's agent log through the apiserver.
func podLog(name string) string {
	b, _ := KubeCP.Client.CoreV1().Pods(KubeRunnerNamespace).GetLogs(name, &corev1.PodLogOptions{Container: "runner"}).DoRaw(context.Background())
	return string(b)
}

// CheckNoTokenInCluster fails when the forge token shows in any pod's
// spec, any Secret of the namespace or any pod's log.
func (f *Fleet) CheckNoTokenInCluster() {
	f.T.Helper()
	ctx := context.Background()
	pods, err := KubeCP.Client.CoreV1().Pods(KubeRunnerNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		f.T.Fatal(err)
	}
	for _, p := range pods.Items {
		b, _ := json.Marshal(p)
		if strings.Contains(string(b), Gitea.Token) {
			f.T.Errorf("pod %s shows the forge token", p.Name)
		}
		if strings.Contains(podLog(p.Name), Gitea.Token) {
			f.T.Errorf("pod %s's log shows the forge token", p.Name)
		}
	}
	secrets, err := KubeCP.Client.CoreV1().Secrets(KubeRunnerNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		f.T.Fatal(err)
	}
	for _, s := range secrets.Items {
		for k, v := range s.Data {
			if strings.Contains(string(v), Gitea.Token) {
				f.T.Errorf("secret %s key %s holds the forge token", s.Name, k)
			}
		}
	}
	f.T.Logf("checked %d pods (specs and logs) and %d secrets: no forge token", len(pods.Items), len(secrets.Items))
}

func HTTPGet(t testing.TB, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func LastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// MetricValue reads one sample of a metric from a Prometheus endpoint.
func MetricValue(t testing.TB, url, name string) float64 {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(HTTPGet(t, url)))
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, name) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			return v
		}
	}
	t.Fatalf("no %s at %s", name, url)
	return 0
}

// RSSMiB is a process's resident set size.
func RSSMiB(pid int) float64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

func LogHas(path, s string) bool {
	b, _ := os.ReadFile(path)
	return strings.Contains(string(b), s)
}

// LogLines returns the lines of a log that contain any of the words (all
// lines for "").
func LogLines(path string, words ...string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		for _, w := range words {
			if strings.Contains(sc.Text(), w) {
				out = append(out, filepath.Base(filepath.Dir(path))+"/"+filepath.Base(path)+": "+sc.Text())
				break
			}
		}
	}
	return out
}

// DindImages are what a pool with docker: dind runs here: the runner
// image with a docker CLI (Agent), the daemon's (Daemon, standing in for
// docker:dind), and the images its jobs use, loaded into the daemon's
// storage as a registry would serve them: a shell (Job) and a web server
// (Service) that serves "hello-from-service".
type DindImages struct{ Agent, Daemon, Job, Service string }

var (
	dindOnce sync.Once
	dindImgs DindImages
	dindErr  error
)

// NeedDind builds the images of a docker: dind pool, once, on the
// Kubernetes test node's engine.
func NeedDind(t testing.TB) DindImages {
	t.Helper()
	agent := NeedKube(t)
	dindOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		dindImgs, dindErr = dindImages(ctx, agent)
	})
	peers.Need(t, "the docker: dind images", dindErr)
	return dindImgs
}

func dindImages(ctx context.Context, agent string) (DindImages, error) {
	var im DindImages
	cliPath, err := staticDockerCLI()
	if err != nil {
		return im, err
	}
	cliBin, err := os.ReadFile(cliPath)
	if err != nil {
		return im, err
	}
	if im.Job, err = peers.RunnerImage(ctx, DockerCli, ""); err != nil {
		return im, err
	}
	if im.Service, err = peers.DeriveImage(ctx, DockerCli, im.Job, "",
		"RUN mkdir -p /www && echo hello-from-service > /www/index.html\nENTRYPOINT [\"/bin/httpd\", \"-f\", \"-p\", \"80\", \"-h\", \"/www\"]\n"); err != nil {
		return im, err
	}
	if im.Daemon, err = peers.DindImage(ctx, DockerCli, cliPath, im.Job, im.Service); err != nil {
		return im, err
	}
	im.Agent, err = peers.DeriveImage(ctx, DockerCli, agent, "", "", peers.ImageFile{Path: "bin/docker", Data: cliBin, Mode: 0o755})
	return im, err
}
