package kubenode

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/distribution/reference"
	"github.com/moby/moby/api/pkg/stdcopy"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// run is one pod on the node.
type run struct {
	n         *Node
	ns, name  string
	uid       types.UID
	pod       *corev1.Pod
	dir       string
	stopping  chan struct{}
	stopOnce  sync.Once
	done      chan struct{}
	mu        sync.Mutex
	running   map[string]string // the containers running now, by name
	deadlined bool
}

func (n *Node) newRun(pod *corev1.Pod) *run {
	return &run{
		n: n, ns: pod.Namespace, name: pod.Name, uid: pod.UID, pod: pod.DeepCopy(),
		dir:      filepath.Join(n.opt.Dir, string(pod.UID)),
		stopping: make(chan struct{}), done: make(chan struct{}), running: map[string]string{},
	}
}

func (r *run) logFile(ctr string) string { return filepath.Join(r.dir, "logs", ctr+".log") }

// stop ends the pod's containers: SIGTERM, then SIGKILL after its grace
// period (at most 10 s here).
func (r *run) stop() {
	r.stopOnce.Do(func() {
		close(r.stopping)
		r.mu.Lock()
		ids := slices.Collect(maps.Values(r.running))
		r.mu.Unlock()
		var wg sync.WaitGroup
		for _, id := range ids {
			wg.Go(func() { r.stopContainer(id) })
		}
		wg.Wait()
	})
}

// stopContainer ends one container within the pod's grace period.
func (r *run) stopContainer(id string) {
	grace := 10
	if g := r.pod.Spec.TerminationGracePeriodSeconds; g != nil && int(*g) < grace {
		grace = int(*g)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(grace+10)*time.Second)
	defer cancel()
	_, _ = r.n.docker.ContainerStop(ctx, id, client.ContainerStopOptions{Timeout: &grace})
}

func (r *run) stopped() bool {
	select {
	case <-r.stopping:
		return true
	default:
		return false
	}
}

// run runs the pod: volumes, init containers in turn, then the
// containers, reporting each phase.
func (r *run) run(ctx context.Context) {
	defer close(r.done)
	secrets, err := r.secrets(ctx)
	if err != nil {
		r.end(ctx, corev1.PodFailed, "CreateContainerConfigError", err.Error(), nil)
		return
	}
	vols, err := r.volumes(secrets)
	if err != nil {
		r.end(ctx, corev1.PodFailed, "CreateContainerConfigError", err.Error(), nil)
		return
	}
	if !r.waitImages(ctx) {
		return
	}
	sidecars := r.sidecars()
	defer sidecars.end()
	for _, c := range r.pod.Spec.InitContainers {
		if !r.allowed(ctx, true, c) {
			return
		}
		if isSidecar(c) {
			if !sidecars.start(ctx, c, vols, secrets) {
				return
			}
			continue
		}
		code, err := r.container(ctx, c, vols, secrets)
		if r.stopped() {
			return
		}
		if err != nil || code != 0 {
			if err != nil {
				r.end(ctx, corev1.PodFailed, "", fmt.Sprintf("init container %s: %v", c.Name, err), nil)
				return
			}
			r.endInit(ctx, c, code)
			return
		}
	}
	if r.stopped() {
		return
	}
	for _, c := range r.pod.Spec.Containers {
		if !r.allowed(ctx, false, c) {
			return
		}
	}
	r.setRunning(ctx)
	if d := r.pod.Spec.ActiveDeadlineSeconds; d != nil {
		t := time.AfterFunc(time.Duration(*d)*time.Second, func() {
			r.mu.Lock()
			r.deadlined = true
			r.mu.Unlock()
			r.stop()
		})
		defer t.Stop()
	}
	codes := map[string]int{}
	phase := corev1.PodSucceeded
	for _, c := range r.pod.Spec.Containers {
		code, err := r.container(ctx, c, vols, secrets)
		if err != nil {
			code = 128
		}
		codes[c.Name] = code
		if code != 0 {
			phase = corev1.PodFailed
		}
	}
	// The agent is done: the sidecars are stopped, and the pod's phase
	// is its containers' alone (pkg/kubelet/kubelet_pods.go,
	// getPhase, which leaves restartable init containers out).
	sidecars.end()
	r.mu.Lock()
	deadlined := r.deadlined
	r.mu.Unlock()
	switch {
	case deadlined:
		r.end(ctx, corev1.PodFailed, "DeadlineExceeded", "Pod was active on the node longer than the specified deadline", codes)
	case r.stopped():
		// Being deleted: its status no longer matters.
	default:
		r.end(ctx, phase, "", "", codes)
	}
}

// waitImages holds the pod Pending while an image of its is not on the
// engine, as a kubelet does whose runtime cannot pull it (no registry can
// be reached here), in the kubelet's words
// (pkg/kubelet/images/image_manager.go, EnsureImageExists and
// evalCRIPullErr): InvalidImageName for a name that does not parse;
// else ErrImagePull with the runtime's error, then ImagePullBackOff,
// "Back-off pulling image %q" with that error. The runtime's error is
// containerd's (core/remotes/docker/resolver.go): the registry's
// "repository does not exist" for an image of a registry that answers,
// a failed lookup for one of a host named *.invalid. It reports whether
// the images are there; false when the pod is stopped first.
func (r *run) waitImages(ctx context.Context) bool {
	pulled := map[string]string{}
	for {
		missing, init := "", false
		for i, c := range append(append([]corev1.Container{}, r.pod.Spec.InitContainers...), r.pod.Spec.Containers...) {
			if _, err := r.n.docker.ImageInspect(ctx, c.Image); cerrdefs.IsNotFound(err) {
				missing, init = c.Image, i < len(r.pod.Spec.InitContainers)
				break
			}
		}
		if missing == "" {
			return true
		}
		reason, msg := pullFailure(missing)
		if last, tried := pulled[missing]; tried && reason == "ErrImagePull" {
			reason, msg = "ImagePullBackOff", fmt.Sprintf("Back-off pulling image %q: ErrImagePull: %s", missing, last)
		} else {
			pulled[missing] = msg
		}
		if !r.hold(ctx, init, reason, msg) {
			return false
		}
	}
}

// pullFailure is what a kubelet with containerd says of an image it
// cannot pull.
func pullFailure(image string) (reason, msg string) {
	named, err := reference.ParseNormalizedNamed(image)
	if err != nil {
		return "InvalidImageName", fmt.Sprintf("Failed to apply default image tag %q: couldn't parse image name %q: %v", image, image, err)
	}
	ref := reference.TagNameOnly(named).String()
	cause := "pull access denied, repository does not exist or may require authorization: server message: insufficient_scope: authorization failed"
	if host := reference.Domain(named); strings.HasSuffix(host, ".invalid") {
		cause = fmt.Sprintf("failed to do request: Head \"https://%s/v2/\": dial tcp: lookup %s: no such host", host, host)
	}
	return "ErrImagePull", fmt.Sprintf("failed to pull and unpack image %q: failed to resolve reference %q: %s", ref, ref, cause)
}

// hold writes the pod Pending, with every container (of the init
// containers or the others) waiting for reason, and waits a while, as a
// kubelet retries at its next sync. It reports false when the pod or the
// node is stopped first.
func (r *run) hold(ctx context.Context, init bool, reason, msg string) bool {
	err := r.n.setStatus(ctx, r.ns, r.name, r.uid, func(s *corev1.PodStatus) {
		s.Phase = corev1.PodPending
		waiting := func(cs []corev1.Container) []corev1.ContainerStatus {
			var out []corev1.ContainerStatus
			for _, c := range cs {
				out = append(out, corev1.ContainerStatus{Name: c.Name, Image: c.Image,
					State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason, Message: msg}}})
			}
			return out
		}
		if init {
			s.InitContainerStatuses, s.ContainerStatuses = waiting(r.pod.Spec.InitContainers), nil
		} else {
			s.ContainerStatuses = waiting(r.pod.Spec.Containers)
		}
	})
	if err != nil && !errors.Is(err, context.Canceled) {
		r.n.log.Warn("pod status", "pod", r.name, "err", err)
	}
	select {
	case <-r.stopping:
		return false
	case <-ctx.Done(): // the node stops
		return false
	case <-time.After(2 * time.Second):
		return true
	}
}

// nonRoot refuses a container that runAsNonRoot forbids, in the kubelet's
// words (pkg/kubelet/kuberuntime/security_context_others.go,
// verifyRunAsNonRoot): its runAsUser is 0, or without one, the image's
// user is root or a name, which cannot be checked. The kubelet holds such
// a container waiting in CreateContainerConfigError.
func (r *run) nonRoot(ctx context.Context, c corev1.Container) error {
	var uid *int64
	var want *bool
	if psc := r.pod.Spec.SecurityContext; psc != nil {
		uid, want = psc.RunAsUser, psc.RunAsNonRoot
	}
	if sc := c.SecurityContext; sc != nil {
		uid, want = cmp.Or(sc.RunAsUser, uid), cmp.Or(sc.RunAsNonRoot, want)
	}
	if want == nil || !*want {
		return nil
	}
	pod := fmt.Sprintf("%s_%s(%s)", r.name, r.ns, r.uid)
	if uid != nil {
		if *uid == 0 {
			return fmt.Errorf("container's runAsUser breaks non-root policy (pod: %q, container: %s)", pod, c.Name)
		}
		return nil
	}
	img, err := r.n.docker.ImageInspect(ctx, c.Image)
	if err != nil {
		return err
	}
	user := ""
	if img.Config != nil {
		user, _, _ = strings.Cut(img.Config.User, ":")
	}
	n, err := strconv.ParseInt(user, 10, 64)
	switch {
	case user == "" || user == "root" || (err == nil && n == 0):
		return fmt.Errorf("container has runAsNonRoot and image will run as root (pod: %q, container: %s)", pod, c.Name)
	case err != nil:
		return fmt.Errorf("container has runAsNonRoot and image has non-numeric user (%s), cannot verify user is non-root (pod: %q, container: %s)", user, pod, c.Name)
	}
	return nil
}

// allowed holds the pod while a container of its breaks runAsNonRoot, as
// the kubelet does (the spec cannot change, so until it is deleted). It
// reports false when the pod is stopped.
func (r *run) allowed(ctx context.Context, init bool, c corev1.Container) bool {
	for {
		err := r.nonRoot(ctx, c)
		if err == nil {
			return true
		}
		if !r.hold(ctx, init, "CreateContainerConfigError", err.Error()) {
			return false
		}
	}
}

// secrets reads the Secrets the pod refers to, waiting for them as the
// kubelet does (the pod may be made before its Secret).
func (r *run) secrets(ctx context.Context) (map[string]*corev1.Secret, error) {
	names := map[string]bool{}
	for _, v := range r.pod.Spec.Volumes {
		if v.Secret != nil {
			names[v.Secret.SecretName] = true
		}
	}
	for _, c := range append(append([]corev1.Container{}, r.pod.Spec.InitContainers...), r.pod.Spec.Containers...) {
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				names[e.ValueFrom.SecretKeyRef.Name] = true
			}
		}
	}
	out := map[string]*corev1.Secret{}
	deadline := time.Now().Add(2 * time.Minute)
	for name := range names {
		for {
			s, err := r.n.cs.CoreV1().Secrets(r.ns).Get(ctx, name, metav1.GetOptions{})
			if err == nil {
				out[name] = s
				break
			}
			if !apierrors.IsNotFound(err) || time.Now().After(deadline) || r.stopped() {
				return nil, fmt.Errorf("secret %q: %w", name, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	return out, nil
}

// volumes makes the pod's volumes on the host: emptyDir and Secret
// directories of its own, hostPath as it is. As the kubelet does, the
// files it writes are root's, and a pod's fsGroup becomes their group
// (ownership is set on emptyDir and Secret volumes, never on hostPath).
func (r *run) volumes(secrets map[string]*corev1.Secret) (map[string]string, error) {
	var fsGroup *int64
	if sc := r.pod.Spec.SecurityContext; sc != nil {
		fsGroup = sc.FSGroup
	}
	out := map[string]string{}
	for _, v := range r.pod.Spec.Volumes {
		dir := filepath.Join(r.dir, "volumes", v.Name)
		switch {
		case v.EmptyDir != nil:
			// kubernetes/kubernetes pkg/volume/emptydir/empty_dir.go:
			// the directory is made 0777 (perm), then owned by fsGroup.
			if err := os.MkdirAll(dir, 0o777); err != nil {
				return nil, err
			}
			_ = os.Chmod(dir, 0o777)
			if err := setOwnership(dir, fsGroup, false); err != nil {
				return nil, err
			}
		case v.Secret != nil:
			if err := writeSecret(dir, v.Secret, secrets[v.Secret.SecretName]); err != nil {
				return nil, err
			}
			// pkg/volume/secret/secret.go: a Secret volume's
			// attributes are ReadOnly, so fsGroup adds read only.
			if err := setOwnership(dir, fsGroup, true); err != nil {
				return nil, err
			}
		case v.HostPath != nil:
			dir = v.HostPath.Path
		default:
			return nil, fmt.Errorf("volume %s: only emptyDir, secret and hostPath run on this node", v.Name)
		}
		out[v.Name] = dir
	}
	return out, nil
}

// setOwnership is the kubelet's SetVolumeOwnership
// (kubernetes/kubernetes pkg/volume/volume_linux.go): with an fsGroup,
// every file and directory of the volume gets fsGroup as its group and
// group read (0440, a read-only volume) or read-write (0660) added to its
// mode; directories also get setgid and group search (0110).
func setOwnership(dir string, fsGroup *int64, readOnly bool) error {
	if fsGroup == nil {
		return nil
	}
	return filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if err := os.Lchown(p, -1, int(*fsGroup)); err != nil {
			return fmt.Errorf("fsGroup: %w", err)
		}
		mask := os.FileMode(0o660)
		if readOnly {
			mask = 0o440
		}
		if info.IsDir() {
			mask |= os.ModeSetgid | 0o110
		}
		return os.Chmod(p, info.Mode()|mask)
	})
}

// writeSecret writes a Secret volume's files as the kubelet's atomic
// writer does (pkg/volume/util/atomic_writer.go, pkg/volume/secret/
// secret.go): owned by root, mode the item's, else the volume's
// defaultMode, else 0644 (SecretVolumeSourceDefaultMode).
func writeSecret(dir string, v *corev1.SecretVolumeSource, s *corev1.Secret) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	mode := os.FileMode(corev1.SecretVolumeSourceDefaultMode)
	if v.DefaultMode != nil {
		mode = os.FileMode(*v.DefaultMode)
	}
	items := v.Items
	if len(items) == 0 {
		for k := range s.Data {
			items = append(items, corev1.KeyToPath{Key: k, Path: k})
		}
	}
	for _, it := range items {
		data, ok := s.Data[it.Key]
		if !ok {
			return fmt.Errorf("secret %s has no key %s", s.Name, it.Key)
		}
		m := mode
		if it.Mode != nil {
			m = os.FileMode(*it.Mode)
		}
		p := filepath.Join(dir, filepath.Clean("/"+it.Path))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, data, m); err != nil {
			return err
		}
		// WriteFile's mode is masked by the umask; the kubelet's is not.
		if err := os.Chmod(p, m); err != nil {
			return err
		}
		if err := os.Lchown(p, 0, 0); err != nil && os.Geteuid() == 0 {
			return err
		}
	}
	return nil
}

// container runs one of the pod's containers to its end and returns its
// exit code; its output goes to its log file.
func (r *run) container(ctx context.Context, c corev1.Container, vols map[string]string, secrets map[string]*corev1.Secret) (int, error) {
	env, err := envOf(c, r.pod, secrets)
	if err != nil {
		return 0, err
	}
	var binds []string
	for _, m := range c.VolumeMounts {
		b := vols[m.Name] + ":" + m.MountPath
		if m.ReadOnly {
			b += ":ro"
		}
		binds = append(binds, b)
	}
	init := true
	cfg := &container.Config{
		Image: c.Image, Entrypoint: c.Command, Cmd: c.Args, Env: env, WorkingDir: c.WorkingDir,
		Hostname: r.name,
		Labels:   map[string]string{LabelNode: r.n.opt.Name, LabelPod: string(r.uid)},
	}
	cfg.User = r.user(c)
	host := &container.HostConfig{Binds: binds, Init: &init, ExtraHosts: []string{"host.docker.internal:host-gateway"}, GroupAdd: r.groups()}
	if sc := c.SecurityContext; sc != nil && sc.Privileged != nil && *sc.Privileged {
		if err := privileged(host); err != nil {
			return 0, fmt.Errorf("container %s: %w", c.Name, err)
		}
	}
	name := fmt.Sprintf("kubenode-%s-%s-%s", r.name, c.Name, string(r.uid)[:8])
	res, err := r.n.docker.ContainerCreate(ctx, client.ContainerCreateOptions{Name: name, Config: cfg, HostConfig: host})
	if err != nil {
		return 0, fmt.Errorf("create container %s: %w", c.Name, err)
	}
	defer func() {
		_, _ = r.n.docker.ContainerRemove(context.WithoutCancel(ctx), res.ID, client.ContainerRemoveOptions{Force: true})
	}()
	wait := r.n.docker.ContainerWait(ctx, res.ID, client.ContainerWaitOptions{Condition: container.WaitConditionNextExit})
	if _, err := r.n.docker.ContainerStart(ctx, res.ID, client.ContainerStartOptions{}); err != nil {
		return 0, fmt.Errorf("start container %s: %w", c.Name, err)
	}
	r.mu.Lock()
	r.running[c.Name] = res.ID
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.running, c.Name)
		r.mu.Unlock()
	}()
	if r.stopped() { // a stop that came before the container ran
		grace := 0
		_, _ = r.n.docker.ContainerStop(ctx, res.ID, client.ContainerStopOptions{Timeout: &grace})
	}
	copied := make(chan struct{})
	go func() { defer close(copied); r.copyLogs(ctx, res.ID, c.Name) }()
	defer func() { <-copied }()
	select {
	case w := <-wait.Result:
		return int(w.StatusCode), nil
	case err := <-wait.Error:
		return 0, err
	}
}

func (r *run) copyLogs(ctx context.Context, id, ctr string) {
	if err := os.MkdirAll(filepath.Join(r.dir, "logs"), 0o755); err != nil {
		return
	}
	f, err := os.OpenFile(r.logFile(ctr), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	rc, err := r.n.docker.ContainerLogs(ctx, id, client.ContainerLogsOptions{ShowStdout: true, ShowStderr: true, Follow: true})
	if err != nil {
		return
	}
	defer rc.Close()
	_, _ = stdcopy.StdCopy(f, f, rc)
}

// user is the container's user as its security context, else the pod's,
// sets it; "" leaves the image's USER, as the kubelet does
// (pkg/kubelet/kuberuntime/security_context.go,
// determineEffectiveSecurityContext: the container's fields win).
func (r *run) user(c corev1.Container) string {
	var uid, gid *int64
	if psc := r.pod.Spec.SecurityContext; psc != nil {
		uid, gid = psc.RunAsUser, psc.RunAsGroup
	}
	if sc := c.SecurityContext; sc != nil {
		uid, gid = cmp.Or(sc.RunAsUser, uid), cmp.Or(sc.RunAsGroup, gid)
	}
	switch {
	case uid == nil:
		return ""
	case gid == nil:
		return strconv.FormatInt(*uid, 10)
	default:
		return strconv.FormatInt(*uid, 10) + ":" + strconv.FormatInt(*gid, 10)
	}
}

// groups are every container's supplementary groups: the pod's fsGroup
// and supplementalGroups (security_context.go, as above).
func (r *run) groups() []string {
	psc := r.pod.Spec.SecurityContext
	if psc == nil {
		return nil
	}
	var out []string
	if psc.FSGroup != nil {
		out = append(out, strconv.FormatInt(*psc.FSGroup, 10))
	}
	for _, g := range psc.SupplementalGroups {
		out = append(out, strconv.FormatInt(g, 10))
	}
	return out
}

// envOf is a container's environment with Secret references and the
// downward API's pod fields resolved.
func envOf(c corev1.Container, pod *corev1.Pod, secrets map[string]*corev1.Secret) ([]string, error) {
	var env []string
	for _, e := range c.Env {
		v := e.Value
		if ref := e.ValueFrom; ref != nil && ref.FieldRef != nil {
			switch ref.FieldRef.FieldPath {
			case "spec.nodeName":
				v = pod.Spec.NodeName
			case "metadata.name":
				v = pod.Name
			case "metadata.namespace":
				v = pod.Namespace
			default:
				return nil, fmt.Errorf("env %s: field %s is not served on this node", e.Name, ref.FieldRef.FieldPath)
			}
			env = append(env, e.Name+"="+v)
			continue
		}
		if ref := e.ValueFrom; ref != nil {
			if ref.SecretKeyRef == nil {
				return nil, fmt.Errorf("env %s: only secretKeyRef and fieldRef run on this node", e.Name)
			}
			s := secrets[ref.SecretKeyRef.Name]
			b, ok := s.Data[ref.SecretKeyRef.Key]
			if !ok {
				return nil, fmt.Errorf("env %s: secret %s has no key %s", e.Name, ref.SecretKeyRef.Name, ref.SecretKeyRef.Key)
			}
			v = string(b)
		}
		env = append(env, e.Name+"="+v)
	}
	return env, nil
}

// imageID is an image's id as a kubelet reports it: the runtime's
// docker://sha256:..., "" when the engine does not know the image.
func (r *run) imageID(ctx context.Context, image string) string {
	res, err := r.n.docker.ImageInspect(ctx, image)
	if err != nil {
		return ""
	}
	return "docker://" + res.ID
}

// setRunning reports the pod running, its init containers done.
func (r *run) setRunning(ctx context.Context) {
	now := metav1.Now()
	err := r.n.setStatus(ctx, r.ns, r.name, r.uid, func(s *corev1.PodStatus) {
		s.Phase, s.HostIP, s.PodIP, s.StartTime = corev1.PodRunning, "127.0.0.1", "127.0.0.1", &now
		s.InitContainerStatuses = nil
		for _, c := range r.pod.Spec.InitContainers {
			st := corev1.ContainerStatus{Name: c.Name, Image: c.Image, Ready: true,
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{Reason: "Completed", FinishedAt: now}}}
			if isSidecar(c) {
				started := true
				st.Started, st.State = &started, corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}
			}
			s.InitContainerStatuses = append(s.InitContainerStatuses, st)
		}
		s.ContainerStatuses = nil
		for _, c := range r.pod.Spec.Containers {
			started := true
			s.ContainerStatuses = append(s.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, ImageID: r.imageID(ctx, c.Image), Ready: true, Started: &started,
				State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}})
		}
		s.Conditions = []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		}
	})
	if err != nil && !errors.Is(err, context.Canceled) {
		r.n.log.Warn("pod status", "pod", r.name, "err", err)
	}
}

// end reports the pod ended.
// endInit ends a pod whose init container failed, as the kubelet reports
// it with restartPolicy Never: phase Failed with no reason of the pod's;
// the init container terminated with reason Error and, where its
// terminationMessagePolicy is FallbackToLogsOnError, its log's last lines
// as its message (at most 80 lines and 2 KiB: kubernetes/kubernetes
// pkg/kubelet/kuberuntime/kuberuntime_container.go, getTerminationMessage,
// and pkg/kubelet/container's MaxContainerTerminationMessageLog*); the
// containers still waiting in PodInitializing.
func (r *run) endInit(ctx context.Context, failed corev1.Container, code int) {
	msg := ""
	if failed.TerminationMessagePolicy == corev1.TerminationMessageFallbackToLogsOnError {
		b, _ := os.ReadFile(r.logFile(failed.Name))
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		msg = strings.Join(lines[max(0, len(lines)-80):], "\n")
		if len(msg) > 2048 {
			msg = msg[len(msg)-2048:]
		}
	}
	now := metav1.Now()
	err := r.n.setStatus(ctx, r.ns, r.name, r.uid, func(s *corev1.PodStatus) {
		s.Phase = corev1.PodFailed
		s.InitContainerStatuses, s.ContainerStatuses = nil, nil
		ran := true // the init containers before the failed one completed
		for _, c := range r.pod.Spec.InitContainers {
			st := corev1.ContainerStatus{Name: c.Name, Image: c.Image}
			switch {
			case c.Name == failed.Name:
				st.State.Terminated = &corev1.ContainerStateTerminated{ExitCode: int32(code), Reason: "Error", Message: msg, FinishedAt: now}
				ran = false
			case ran:
				st.State.Terminated = &corev1.ContainerStateTerminated{Reason: "Completed", FinishedAt: now}
			default:
				st.State.Waiting = &corev1.ContainerStateWaiting{Reason: "PodInitializing"}
			}
			s.InitContainerStatuses = append(s.InitContainerStatuses, st)
		}
		for _, c := range r.pod.Spec.Containers {
			s.ContainerStatuses = append(s.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image,
				State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "PodInitializing"}}})
		}
	})
	if err != nil && !apierrors.IsNotFound(err) && !errors.Is(err, context.Canceled) {
		r.n.log.Warn("pod status", "pod", r.name, "err", err)
	}
}

func (r *run) end(ctx context.Context, phase corev1.PodPhase, reason, msg string, codes map[string]int) {
	now := metav1.Now()
	err := r.n.setStatus(ctx, r.ns, r.name, r.uid, func(s *corev1.PodStatus) {
		s.Phase, s.Reason, s.Message = phase, reason, msg
		s.ContainerStatuses = nil
		for _, c := range r.pod.Spec.Containers {
			t := &corev1.ContainerStateTerminated{ExitCode: int32(codes[c.Name]), Reason: "Completed", FinishedAt: now}
			if codes[c.Name] != 0 {
				t.Reason = "Error"
			}
			s.ContainerStatuses = append(s.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, State: corev1.ContainerState{Terminated: t}})
		}
		for i := range s.Conditions {
			if s.Conditions[i].Type == corev1.PodReady || s.Conditions[i].Type == corev1.ContainersReady {
				s.Conditions[i].Status = corev1.ConditionFalse
			}
		}
	})
	if err != nil && !apierrors.IsNotFound(err) && !errors.Is(err, context.Canceled) {
		r.n.log.Warn("pod status", "pod", r.name, "err", err)
	}
}
