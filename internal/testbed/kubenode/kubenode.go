// Package kubenode stands in for a Kubernetes node's kubelet, following the
// Pod and Node API of the Kubernetes API reference. It registers a Node,
// runs the pods bound to it as containers on the local Docker engine
// (their image, command, environment with Secret references resolved,
// Secret, emptyDir and hostPath volumes, read-only where asked, their
// files root's with the pod's fsGroup applied; the user of the image or
// of the security context, with fsGroup among its groups), writes
// their status back to the apiserver, serves their logs on the kubelet's
// endpoint (the apiserver's pods/log asks it), and finishes the deletion
// of a pod once its containers are gone, as a kubelet does.
//
// It is hand-written for what the real kubelet (peers.StartKubelet) cannot
// do here: give pods a network of their own that reaches the host's
// services (no CNI plugin can be had; a pod on the real kubelet uses the
// host's network), and start in a second. The tests that check what a pod
// holds (its files, its user, its credential) run on both.
package kubenode

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/moby/moby/client"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"

	"github.com/runfleet/runfleet/sysinfo"
)

// LabelNode is on every container the node runs, with the node's name.
const (
	LabelNode = "kubenode.node"
	LabelPod  = "kubenode.pod"
)

// Options configure Start.
type Options struct {
	Name   string
	Client kubernetes.Interface
	Docker *client.Client
	// Dir holds the pods' volumes and logs.
	Dir string
	// Cert is the kubelet endpoint's TLS certificate (for 127.0.0.1).
	Cert   tls.Certificate
	Labels map[string]string
	// Capacity adds to the node's (32 CPUs, 64Gi, 110 pods).
	Capacity corev1.ResourceList
	Logger   *slog.Logger
}

// Node is a running node agent.
type Node struct {
	opt    Options
	cs     kubernetes.Interface
	docker *client.Client
	log    *slog.Logger
	srv    *http.Server
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu   sync.Mutex
	pods map[types.UID]*run
	// finishing holds the pods whose deletion is being finished: a
	// terminating pod's every update would start another.
	finishing map[types.UID]bool
}

// Start registers the node and begins running the pods bound to it.
func Start(ctx context.Context, opt Options) (*Node, error) {
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	n := &Node{opt: opt, cs: opt.Client, docker: opt.Docker, log: opt.Logger.With("node", opt.Name), pods: map[types.UID]*run{}, finishing: map[types.UID]bool{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	n.srv = &http.Server{Handler: http.HandlerFunc(n.serveLogs), TLSConfig: &tls.Config{Certificates: []tls.Certificate{opt.Cert}}}
	go func() { _ = n.srv.ServeTLS(ln, "", "") }()
	if err := n.register(ctx, ln.Addr().(*net.TCPAddr).Port); err != nil {
		n.srv.Close()
		return nil, err
	}
	bg, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	factory := informers.NewSharedInformerFactoryWithOptions(opt.Client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", opt.Name).String()
		}))
	inf := factory.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { n.sync(bg, obj) },
		UpdateFunc: func(_, obj any) { n.sync(bg, obj) },
	}); err != nil {
		cancel()
		return nil, err
	}
	n.wg.Add(1)
	go func() { defer n.wg.Done(); inf.RunWithContext(bg) }()
	return n, nil
}

// nodeInfo is the node's system as a kubelet reports it: this host's OS
// image and kernel, and the container runtime it runs pods with, Docker
// here (kubernetes/kubernetes, pkg/kubelet/nodestatus/setters.go:
// MachineInfo and VersionInfo; the runtime as "<name>://<version>").
func (n *Node) nodeInfo(ctx context.Context) corev1.NodeSystemInfo {
	sys := sysinfo.Local()
	info := corev1.NodeSystemInfo{KubeletVersion: "kubenode", OperatingSystem: "linux", Architecture: runtime.GOARCH,
		OSImage: sys.OS, KernelVersion: sys.Kernel}
	if res, err := n.docker.Info(ctx, client.InfoOptions{}); err == nil {
		info.ContainerRuntimeVersion = "docker://" + res.Info.ServerVersion
	}
	return info
}

// register creates (or takes over) the Node object, ready, untainted,
// with the kubelet endpoint on port.
func (n *Node) register(ctx context.Context, port int) error {
	capacity := corev1.ResourceList{}
	for r, q := range map[corev1.ResourceName]string{"cpu": "32", "memory": "64Gi", "pods": "110"} {
		capacity[r] = resource.MustParse(q)
	}
	for r, q := range n.opt.Capacity {
		capacity[r] = q
	}
	nodes := n.cs.CoreV1().Nodes()
	_ = nodes.Delete(ctx, n.opt.Name, metav1.DeleteOptions{}) // a node left by an earlier run
	node, err := nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.opt.Name, Labels: n.opt.Labels}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("register node %s: %w", n.opt.Name, err)
	}
	// The apiserver taints a new node not-ready; no controller-manager
	// runs here to lift it.
	node.Spec.Taints = nil
	if node, err = nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		return err
	}
	now := metav1.Now()
	node.Status = corev1.NodeStatus{
		Capacity: capacity, Allocatable: capacity,
		Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: now, LastTransitionTime: now}},
		Addresses:       []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}, {Type: corev1.NodeHostName, Address: n.opt.Name}},
		DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: int32(port)}},
		NodeInfo:        n.nodeInfo(ctx),
	}
	_, err = nodes.UpdateStatus(ctx, node, metav1.UpdateOptions{})
	return err
}

// Stop stops watching, removes the node's containers and the Node.
func (n *Node) Stop() {
	n.cancel()
	n.wg.Wait()
	n.mu.Lock()
	runs := make([]*run, 0, len(n.pods))
	for _, r := range n.pods {
		runs = append(runs, r)
	}
	n.mu.Unlock()
	for _, r := range runs {
		r.stop()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, _ := n.docker.ContainerList(ctx, client.ContainerListOptions{All: true, Filters: make(client.Filters).Add("label", LabelNode+"="+n.opt.Name)})
	for _, c := range res.Items {
		_, _ = n.docker.ContainerRemove(ctx, c.ID, client.ContainerRemoveOptions{Force: true})
	}
	_ = n.cs.CoreV1().Nodes().Delete(ctx, n.opt.Name, metav1.DeleteOptions{})
	n.srv.Close()
}

// Containers is how many containers of the node's pods the engine holds.
func (n *Node) Containers(ctx context.Context) (int, error) {
	res, err := n.docker.ContainerList(ctx, client.ContainerListOptions{All: true, Filters: make(client.Filters).Add("label", LabelNode+"="+n.opt.Name)})
	return len(res.Items), err
}

// sync acts on a pod bound to the node: starts what is new, stops what
// is being deleted, and finishes deleting what has stopped.
func (n *Node) sync(ctx context.Context, obj any) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	n.mu.Lock()
	r := n.pods[pod.UID]
	terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	if r == nil && pod.DeletionTimestamp == nil && !terminal {
		r = n.newRun(pod)
		n.pods[pod.UID] = r
		n.wg.Add(1)
		go func() { defer n.wg.Done(); r.run(ctx) }()
	}
	finish := pod.DeletionTimestamp != nil && !n.finishing[pod.UID]
	if finish {
		n.finishing[pod.UID] = true
	}
	n.mu.Unlock()
	if !finish {
		return
	}
	if r != nil {
		r.stop()
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		if r != nil {
			<-r.done
		}
		n.finish(ctx, pod)
	}()
}

// finish deletes a stopped pod for good, as the kubelet does once its
// containers are gone, and forgets it.
func (n *Node) finish(ctx context.Context, pod *corev1.Pod) {
	uid := pod.UID
	err := n.cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: new(int64(0)), Preconditions: &metav1.Preconditions{UID: &uid},
	})
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.finishing, uid) // after a failure, the pod's next update tries again
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) && ctx.Err() == nil {
		n.log.Warn("finish deleting pod", "pod", pod.Name, "err", err)
		return
	}
	if r := n.pods[uid]; r != nil {
		_ = os.RemoveAll(r.dir)
		delete(n.pods, uid)
	}
}

// setStatus changes a pod's status, on its latest version.
func (n *Node) setStatus(ctx context.Context, ns, name string, uid types.UID, change func(*corev1.PodStatus)) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := n.cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pod.UID != uid {
			return apierrors.NewNotFound(corev1.Resource("pods"), name)
		}
		change(&pod.Status)
		_, err = n.cs.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		return err
	})
}

// serveLogs answers the apiserver's /containerLogs/{ns}/{pod}/{container}
// with tailLines and limitBytes; follow is not offered.
func (n *Node) serveLogs(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if len(parts) != 4 || parts[0] != "containerLogs" {
		http.NotFound(w, r)
		return
	}
	ns, name, ctr := parts[1], parts[2], parts[3]
	n.mu.Lock()
	var file string
	for _, run := range n.pods {
		if run.ns == ns && run.name == name {
			file = run.logFile(ctr)
		}
	}
	n.mu.Unlock()
	b, err := os.ReadFile(file)
	if file == "" || errors.Is(err, os.ErrNotExist) {
		http.Error(w, "container not found", http.StatusNotFound)
		return
	}
	if v := r.URL.Query().Get("tailLines"); v != "" {
		if lines, err := strconv.Atoi(v); err == nil {
			b = tailLines(b, lines)
		}
	}
	if v := r.URL.Query().Get("limitBytes"); v != "" {
		if limit, err := strconv.Atoi(v); err == nil && limit < len(b) {
			b = b[:limit]
		}
	}
	w.Header().Set("Content-Type", "text/plain")
	_, _ = w.Write(b)
}

func tailLines(b []byte, n int) []byte {
	if n < 0 {
		return b
	}
	end := len(b)
	if end > 0 && b[end-1] == '\n' {
		end--
	}
	for i := end - 1; i >= 0; i-- {
		if b[i] == '\n' {
			if n--; n == 0 {
				return b[i+1:]
			}
		}
	}
	return b
}
