package peers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/moby/moby/client"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// KubeletBinary returns the path of a kubelet build, from the same module
// as kube-apiserver (a minute or two after it).
func KubeletBinary(ctx context.Context, w io.Writer) (string, error) {
	return kubeBinary(ctx, w, "kubelet")
}

// Kubelet is a real kubelet (k8s.io/kubernetes at KubeVersion) on this
// host, registered as a node of the control plane, with a containerd of
// its own (Debian's, with runc) as its runtime. What it takes to run in
// this sandbox, each found by trying:
//   - failCgroupV1: false: the hosts mount cgroup v1, which kubelets from
//     1.35 refuse by default;
//   - cgroupsPerQOS off and no node allocatable enforced: the sandbox's
//     cgroup tree is not the kubelet's to arrange;
//   - containerd's restrict_oom_score_adj: a pod sandbox asks for
//     oom_score_adj -998, which needs CAP_SYS_RESOURCE; without it runc
//     fails with "can't get final child's PID from pipe: EOF";
//   - the native snapshotter (no overlay mount here) and a pause image of
//     the tests' own (no registry to pull one from);
//   - no CNI plugin (a config the runtime loads, and no plugin to run):
//     its pods must use the host's network (hostNetwork).
type Kubelet struct {
	Name  string
	dir   string
	sock  string
	procs []*exec.Cmd
	kube  *Kube
}

// KubeletOptions configure StartKubelet.
type KubeletOptions struct {
	Name   string
	Labels map[string]string
	// Images are the local Docker engine's images to give containerd
	// (no registry can be reached): the pods' own. Base is one with a
	// sleep program, from which the pause image is made.
	Images []string
	Base   string
	Docker *client.Client
	// Progress receives the build's output on first use.
	Progress io.Writer
}

// StartKubelet starts containerd and a kubelet registered as node
// opt.Name, and waits for the node to be Ready.
func (k *Kube) StartKubelet(ctx context.Context, opt KubeletOptions) (_ *Kubelet, err error) {
	if _, err := exec.LookPath("containerd"); err != nil {
		return nil, fmt.Errorf("kubelet: containerd: %w (install Debian's containerd)", err)
	}
	bin, err := KubeletBinary(ctx, cmpWriter(opt.Progress))
	if err != nil {
		return nil, err
	}
	// A short path: containerd's socket must fit a sockaddr.
	dir, err := os.MkdirTemp("", "rfkl-")
	if err != nil {
		return nil, err
	}
	kl := &Kubelet{Name: opt.Name, dir: dir, sock: filepath.Join(dir, "c.sock"), kube: k}
	defer func() {
		if err != nil {
			kl.Stop()
		}
	}()
	const pause = "runfleet.test/pause:1"
	conf := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[4]q
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[5]q
    conf_dir = %[5]q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), kl.sock, pause, filepath.Join(dir, "cni"))
	// The runtime's network counts as ready once a CNI config loads; no
	// plugin of it ever runs, since every pod here uses the host's
	// network.
	if err := os.MkdirAll(filepath.Join(dir, "cni"), 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "cni", "10-host.conflist"), []byte(`{"cniVersion": "1.0.0", "name": "host", "plugins": [{"type": "loopback"}]}`), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "containerd.toml"), []byte(conf), 0o644); err != nil {
		return nil, err
	}
	if err := kl.start("containerd", "containerd", "--config", filepath.Join(dir, "containerd.toml")); err != nil {
		return nil, err
	}
	if err := waitFile(ctx, kl.sock); err != nil {
		return nil, fmt.Errorf("kubelet: containerd did not start: %w\n%s", err, kl.logTail("containerd"))
	}
	if _, err := DeriveImage(ctx, opt.Docker, opt.Base, pause, "CMD [\"/bin/sleep\", \"2147483647\"]\n"); err != nil {
		return nil, fmt.Errorf("kubelet: pause image: %w", err)
	}
	if err := kl.importImages(ctx, opt.Docker, append([]string{pause}, opt.Images...)); err != nil {
		return nil, err
	}
	var labels []string
	for key, v := range opt.Labels {
		labels = append(labels, key+"="+v)
	}
	ports, err := FreePorts(1)
	if err != nil {
		return nil, err
	}
	// A node's IP may not be loopback: the host's own, where the
	// apiserver reaches the kubelet for pods' logs.
	ip, err := hostIP()
	if err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
localStorageCapacityIsolation: false
containerRuntimeEndpoint: unix://%s
address: %s
port: %d
readOnlyPort: 0
healthzPort: 0
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
registerNode: true
imageGCHighThresholdPercent: 100
evictionHard: {}
`, kl.sock, ip, ports[0])
	if err := os.WriteFile(filepath.Join(dir, "kubelet.yaml"), []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	if err := kl.start("kubelet", bin, "--config", filepath.Join(dir, "kubelet.yaml"), "--kubeconfig", k.Kubeconfig,
		"--root-dir", filepath.Join(dir, "kubelet"), "--hostname-override", opt.Name,
		"--node-ip", ip, "--node-labels", strings.Join(labels, ",")); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		n, err := k.Client.CoreV1().Nodes().Get(ctx, opt.Name, metav1.GetOptions{})
		if err == nil {
			for _, c := range n.Status.Conditions {
				if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
					// The node's not-ready taint is lifted by the
					// controller-manager's node lifecycle controller,
					// which does not run here.
					n.Spec.Taints = nil
					if _, err := k.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err == nil {
						return kl, nil
					}
				}
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, fmt.Errorf("kubelet: node %s not Ready in 2m\n%s", opt.Name, kl.logTail("kubelet"))
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// importImages gives containerd the engine's images, in the namespace
// the CRI reads (k8s.io).
func (kl *Kubelet) importImages(ctx context.Context, cli *client.Client, images []string) error {
	for _, img := range images {
		rc, err := cli.ImageSave(ctx, []string{img})
		if err != nil {
			return fmt.Errorf("kubelet: save %s: %w", img, err)
		}
		cmd := exec.CommandContext(ctx, "ctr", "--address", kl.sock, "-n", "k8s.io", "images", "import", "-")
		cmd.Stdin = rc
		out, err := cmd.CombinedOutput()
		rc.Close()
		if err != nil {
			return fmt.Errorf("kubelet: import %s: %w: %s", img, err, out)
		}
	}
	return nil
}

func (kl *Kubelet) start(name, bin string, args ...string) error {
	logf, err := os.Create(filepath.Join(kl.dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("kubelet: start %s: %w", name, err)
	}
	kl.procs = append(kl.procs, cmd)
	go func() { _ = cmd.Wait(); logf.Close() }()
	return nil
}

func (kl *Kubelet) logTail(name string) string {
	b, _ := os.ReadFile(filepath.Join(kl.dir, name+".log"))
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}

// Stop stops the kubelet, then the pods' containers (their shims), then
// containerd, and removes what they left.
func (kl *Kubelet) Stop() {
	for i := len(kl.procs) - 1; i >= 0; i-- {
		p := kl.procs[i]
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
		if i == 1 || len(kl.procs) == 1 {
			// The shims outlive the kubelet: they belong to containerd's
			// socket, named on their command line.
			_ = exec.Command("pkill", "-9", "-f", "containerd-shim.*"+kl.sock).Run()
		}
	}
	time.Sleep(500 * time.Millisecond)
	out, _ := exec.Command("sh", "-c", "grep -o ' "+kl.dir+"[^ ]*' /proc/mounts | sort -r").Output()
	for _, m := range strings.Fields(string(out)) {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
	_ = os.RemoveAll(kl.dir)
	// The Node goes too: the test control plane has no node lifecycle
	// controller to mark it NotReady, so the scheduler would go on binding
	// pods to it, and their graceful deletion would wait for ever for a
	// kubelet to confirm it (TestOrphanSecretsSwept, after
	// TestPodOnARealKubelet, failed so in CI).
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = kl.kube.Client.CoreV1().Nodes().Delete(ctx, kl.Name, metav1.DeleteOptions{})
}

// hostIP is this host's first IPv4 address that is not loopback.
func hostIP() (string, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "", err
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			return n.IP.String(), nil
		}
	}
	return "", errors.New("kubelet: no address but loopback for the node")
}

// waitFile waits for a path to exist.
func waitFile(ctx context.Context, path string) error {
	for range 100 {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return errors.New("timed out")
}

func cmpWriter(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}
