package kubenode

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"
	corev1 "k8s.io/api/core/v1"
)

// isSidecar says whether an init container is a native sidecar: one
// that restarts Always (KEP-753, Kubernetes 1.29 and later). The kubelet
// starts it in the init containers' order, goes on to the next once it
// has started (its startup probe passed), restarts it whenever it exits,
// and stops it once the pod's containers have ended.
func isSidecar(c corev1.Container) bool {
	return c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways
}

// sidecarSet is a pod's running sidecars.
type sidecarSet struct {
	r     *run
	names []string
	quit  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup
}

func (r *run) sidecars() *sidecarSet { return &sidecarSet{r: r, quit: make(chan struct{})} }

// start runs c, restarting it when it exits with the kubelet's
// back-off (10 s doubling to 5 minutes: pkg/kubelet/kubelet.go,
// backOffPeriod and MaxContainerBackOff), and waits for it to have
// started. It reports false when the pod is stopped first.
func (s *sidecarSet) start(ctx context.Context, c corev1.Container, vols map[string]string, secrets map[string]*corev1.Secret) bool {
	r := s.r
	s.names = append(s.names, c.Name)
	s.wg.Go(func() {
		backoff := 10 * time.Second
		for {
			code, err := r.container(ctx, c, vols, secrets)
			if s.over(ctx) {
				return
			}
			r.n.log.Info("sidecar exited; restarting", "pod", r.name, "container", c.Name, "code", code, "err", err, "in", backoff)
			select {
			case <-time.After(backoff):
			case <-s.quit:
				return
			case <-r.stopping:
				return
			case <-ctx.Done():
				return
			}
			backoff = min(2*backoff, 5*time.Minute)
		}
	})
	return r.started(ctx, c)
}

func (s *sidecarSet) over(ctx context.Context) bool {
	select {
	case <-s.quit:
		return true
	case <-s.r.stopping:
		return true
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

// end stops the sidecars and waits for them to be gone, as the kubelet
// does once the pod's containers are done.
func (s *sidecarSet) end() {
	s.once.Do(func() {
		close(s.quit)
		done := make(chan struct{})
		go func() { s.wg.Wait(); close(done) }()
		for {
			// A sidecar being restarted has its container made
			// after the first look: look until none is left.
			s.r.mu.Lock()
			var ids []string
			for _, n := range s.names {
				if id := s.r.running[n]; id != "" {
					ids = append(ids, id)
				}
			}
			s.r.mu.Unlock()
			for _, id := range ids {
				s.r.stopContainer(id)
			}
			select {
			case <-done:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	})
}

// started waits for a sidecar to have started: running, and its startup
// probe passed where it has one. A probe that fails failureThreshold
// times in a row has the container killed and restarted
// (pkg/kubelet/prober). Only exec probes are served on this node.
func (r *run) started(ctx context.Context, c corev1.Container) bool {
	p := c.StartupProbe
	period, threshold, timeout := time.Second, 3, time.Second
	if p != nil {
		period = time.Duration(max(p.PeriodSeconds, 1)) * time.Second
		threshold = int(max(p.FailureThreshold, 1))
		timeout = time.Duration(max(p.TimeoutSeconds, 1)) * time.Second
	}
	fails := 0
	for {
		r.mu.Lock()
		id := r.running[c.Name]
		r.mu.Unlock()
		if id != "" {
			if p == nil || p.Exec == nil || r.exec(ctx, id, p.Exec.Command, timeout) == 0 {
				return true
			}
			if fails++; fails >= threshold {
				r.n.log.Info("startup probe failed; restarting", "pod", r.name, "container", c.Name)
				r.stopContainer(id)
				fails = 0
			}
		}
		select {
		case <-r.stopping:
			return false
		case <-ctx.Done():
			return false
		case <-time.After(period):
		}
	}
}

// exec runs a command in a container and returns its exit status, -1
// when it could not be run or outran timeout.
func (r *run) exec(ctx context.Context, id string, cmd []string, timeout time.Duration) int {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	ex, err := r.n.docker.ExecCreate(ctx, id, client.ExecCreateOptions{Cmd: cmd, AttachStdout: true, AttachStderr: true})
	if err != nil {
		return -1
	}
	att, err := r.n.docker.ExecAttach(ctx, ex.ID, client.ExecAttachOptions{})
	if err != nil {
		return -1
	}
	_, _ = io.Copy(io.Discard, att.Reader)
	att.Close()
	in, err := r.n.docker.ExecInspect(ctx, ex.ID, client.ExecInspectOptions{})
	if err != nil || in.Running {
		return -1
	}
	return in.ExitCode
}

// capNames are the kernel's capabilities by number
// (include/uapi/linux/capability.h), up to the last that Docker 20.10
// (Debian's engine here) knows.
var capNames = []string{
	"CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
	"SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
	"IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
	"SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
	"LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
	"WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ",
}

// privileged makes a container what containerd's CRI makes a privileged
// one (containerd pkg/oci/spec_opts.go, WithPrivileged): every
// capability the runtime itself holds (WithAllCurrentCapabilities), no
// seccomp or AppArmor profile, no masked or read-only /proc and /sys
// paths, every device allowed, and a writable cgroup filesystem, which a
// Docker daemon inside needs. Docker's own privileged mode asks for
// every capability the kernel knows instead, which runc cannot apply
// where the node lacks one (this sandbox's bounding set has no
// CAP_SYS_RESOURCE): a kubelet's containerd here would give what the
// node holds, so this does too.
func privileged(h *container.HostConfig) error {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return fmt.Errorf("privileged: %w", err)
	}
	var bnd uint64
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapBnd:"); ok {
			if bnd, err = strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil {
				return fmt.Errorf("privileged: CapBnd %q: %w", v, err)
			}
		}
	}
	h.CapAdd = []string{"ALL"}
	for i, name := range capNames {
		if bnd&(1<<i) == 0 {
			h.CapDrop = append(h.CapDrop, "CAP_"+name)
		}
	}
	h.SecurityOpt = []string{"seccomp=unconfined", "apparmor=unconfined"}
	// Empty, not nil: the engine's defaults apply to a nil list (the
	// CLI's systempaths=unconfined sends these).
	h.MaskedPaths, h.ReadonlyPaths = []string{}, []string{}
	h.DeviceCgroupRules = []string{"a *:* rwm"}
	h.Binds = append(h.Binds, "/sys/fs/cgroup:/sys/fs/cgroup:rw")
	return nil
}
