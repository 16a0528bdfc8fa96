package kubernetes

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// instance is the provider's record of a pod. A Pending pod that waits on
// its cluster (for a node, which a cluster autoscaler may be adding, or
// for its image) is queued within the pool's pending_timeout: it holds
// its slot and its registration, and the bootstrap timeout counts from
// its first container's start. One that no wait will run is refused.
func (p *Provider) instance(pod *corev1.Pod) provider.Instance {
	in := provider.Instance{
		Name:    pod.Labels[LabelRunner],
		Manager: pod.Labels[LabelManager],
		Pool:    pod.Labels[LabelPool],
		State:   stateOf(pod),
		Created: pod.CreationTimestamp.Time,
		Started: startedAt(pod),
		ID:      string(pod.UID),
		Reason:  reasonOf(pod),
		Machine: record.Machine{ID: pod.Name, Node: pod.Spec.NodeName, ImageDigest: imageDigest(pod)},
		System:  p.nodes.Of(pod.Spec.NodeName),
	}
	if in.State != provider.StateCreated {
		return in
	}
	now := time.Now()
	in.Refused = refused(pod, now)
	pending := now.Sub(in.Created)
	switch limit := cmp.Or(p.opt.Section.PendingTimeout.Duration, DefaultPendingTimeout); {
	case in.Refused != "" || !in.Started.IsZero():
	case pending > limit:
		in.Reason = join(fmt.Sprintf("Pending longer than pending_timeout %s", limit), in.Reason)
	default:
		in.Queued = true
	}
	return in
}

// startedAt is when the pod's first container (its init container, which
// copies the runner's files) started: its node was found and its image
// pulled. Zero before.
func startedAt(pod *corev1.Pod) time.Time {
	var first time.Time
	for _, list := range [][]corev1.ContainerStatus{pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses} {
		for _, cs := range list {
			for _, st := range []corev1.ContainerState{cs.State, cs.LastTerminationState} {
				var t time.Time
				switch {
				case st.Running != nil:
					t = st.Running.StartedAt.Time
				case st.Terminated != nil:
					t = st.Terminated.StartedAt.Time
				}
				if !t.IsZero() && (first.IsZero() || t.Before(first)) {
					first = t
				}
			}
		}
	}
	return first
}

// pullGiveUp is how long a pod's image may fail to pull, from the pod's
// scheduling, before it counts as one that will never be pulled: the
// kubelet retries at 10 s doubling to 5 minutes (pkg/kubelet/kubelet.go,
// imageBackOffPeriod and MaxImageBackOff), so about six tries.
const pullGiveUp = 10 * time.Minute

// refused says why a Pending pod will never run as asked, in the
// kubelet's words; "" while it may yet. The kubelet's waiting reasons
// are pkg/kubelet/images/types.go's and kuberuntime's: a name that does
// not parse, an image that a Never policy forbids pulling, a signature
// that does not verify, an image its registry says it does not have (or
// not for these credentials), one that fails to pull for pullGiveUp, a
// user that runAsNonRoot forbids.
func refused(pod *corev1.Pod, now time.Time) string {
	var scheduled time.Time
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionTrue {
			scheduled = c.LastTransitionTime.Time
		}
	}
	for _, list := range [][]corev1.ContainerStatus{pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses} {
		for _, cs := range list {
			w := cs.State.Waiting
			if w == nil {
				continue
			}
			why := cs.Name + " " + join(w.Reason, w.Message)
			switch w.Reason {
			case "InvalidImageName", "ErrImageNeverPull", "SignatureValidationFailed":
				return why
			case "ErrImagePull", "ImagePullBackOff", "RegistryUnavailable":
				if missingImage(w.Message) {
					return why
				}
				if !scheduled.IsZero() && now.Sub(scheduled) > pullGiveUp {
					return fmt.Sprintf("%s (failing for over %s)", why, pullGiveUp)
				}
			case "CreateContainerConfigError":
				if strings.Contains(w.Message, "runAsNonRoot") || strings.Contains(w.Message, "non-root policy") {
					return why + "; an image that must run as root needs kubernetes.security_context.runAsUser: 0"
				}
			}
		}
	}
	return ""
}

// missingImage says whether a pull error is the registry's answer that
// it has no such image, or none for these credentials: containerd's and
// CRI-O's words for a 404 or a 401/403 of the registry (containerd
// core/remotes/docker/resolver.go and errors.go; distribution's error
// codes MANIFEST_UNKNOWN, NAME_UNKNOWN, UNAUTHORIZED, DENIED).
func missingImage(msg string) bool {
	msg = strings.ToLower(msg)
	for _, s := range []string{": not found", "manifest unknown", "name unknown", "repository does not exist", "pull access denied", "unauthorized", "denied: "} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// imageDigest is the agent container's image as the kubelet resolved it
// (its imageID: a registry digest, or the runtime's image id), once it
// started.
func imageDigest(pod *corev1.Pod) string {
	for _, c := range pod.Status.ContainerStatuses {
		if c.Name == agentContainer && c.ImageID != "" {
			if _, d, ok := strings.Cut(c.ImageID, "@"); ok {
				return d
			}
			return strings.TrimPrefix(c.ImageID, "docker://")
		}
	}
	return ""
}

// stateOf maps a pod's phase: a pod not yet running is one coming up, and
// a pod that is being deleted (by someone else: this provider does not
// list the ones it deleted) is one whose agent is ending.
func stateOf(pod *corev1.Pod) provider.State {
	switch {
	case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		return provider.StateExited
	case pod.DeletionTimestamp != nil:
		return provider.StateExited
	case pod.Status.Phase == corev1.PodRunning:
		return provider.StateRunning
	}
	return provider.StateCreated
}

// reasonOf says, in Kubernetes' words, why a pod is not running: not
// scheduled, an image that cannot be pulled, evicted.
func reasonOf(pod *corev1.Pod) string {
	if pod.Status.Reason != "" {
		return join(pod.Status.Reason, pod.Status.Message)
	}
	if pod.Status.Phase == corev1.PodRunning || pod.Status.Phase == corev1.PodSucceeded {
		return ""
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason != "" {
			return join(c.Reason, c.Message)
		}
	}
	for _, list := range [][]corev1.ContainerStatus{pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses} {
		for _, cs := range list {
			if w := cs.State.Waiting; w != nil && w.Reason != "" && w.Reason != "PodInitializing" {
				return join(w.Reason, w.Message)
			}
			if t := cs.State.Terminated; t != nil && t.ExitCode != 0 && pod.Status.Phase == corev1.PodFailed {
				msg := fmt.Sprintf("exit code %d", t.ExitCode)
				if last := lastLine(t.Message); last != "" {
					msg += ": " + last
				}
				return join(cs.Name+" "+t.Reason, msg)
			}
		}
	}
	return ""
}

// lastLine is a termination message's last line that says something: the
// kubelet gives a failed container's last log lines as its message where
// its terminationMessagePolicy is FallbackToLogsOnError.
func lastLine(msg string) string {
	lines := strings.Split(strings.TrimSpace(msg), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

func join(reason, msg string) string {
	if msg == "" {
		return reason
	}
	return reason + ": " + msg
}

// disruption says whether a pod is being taken back: evicted (by the
// node or the eviction API), preempted by a pod of higher priority, or
// deleted by someone other than this provider.
func disruption(pod *corev1.Pod) (string, bool) {
	if pod.Status.Phase == corev1.PodSucceeded {
		return "", false
	}
	switch pod.Status.Reason {
	case "Evicted", "Preempting", "Terminated", "NodeLost", "Shutdown":
		return join(pod.Status.Reason, pod.Status.Message), true
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.DisruptionTarget && c.Status == corev1.ConditionTrue {
			return join(c.Reason, c.Message), true
		}
	}
	if pod.DeletionTimestamp != nil {
		return "pod deleted", true
	}
	return "", false
}

// changed is the informer's add and update handler.
func (p *Provider) changed(old, obj any) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	runner := pod.Labels[LabelRunner]
	p.mu.Lock()
	p.forgetCreating(runner, pod.UID)
	o := p.outputs[pod.UID]
	if o == nil {
		o = &output{pod: pod.Name}
		p.outputs[pod.UID] = o
	}
	o.started = agentStarted(pod)
	o.ended = stateOf(pod) == provider.StateExited
	var notice *provider.Notice
	if why, ok := disruption(pod); ok && !p.deleted[pod.UID] && !p.noticed[pod.UID] {
		p.noticed[pod.UID] = true
		notice = &provider.Notice{Name: runner, ID: string(pod.UID), Reason: why}
		if pod.DeletionTimestamp != nil {
			notice.At = pod.DeletionTimestamp.Time
		}
	}
	watchers, noticers := slices.Collect(maps.Values(p.watchers)), slices.Collect(maps.Values(p.noticers))
	p.mu.Unlock()
	if notice != nil {
		p.log.Warn("pod is being taken back", "runner", runner, "pod", pod.Name, "reason", notice.Reason)
		for _, f := range noticers {
			f(*notice)
		}
	}
	if prev, ok := old.(*corev1.Pod); ok && !moved(prev, pod) {
		return
	}
	for _, f := range watchers {
		f(runner)
	}
}

// moved reports a change the pool acts on: the phase, a deletion, a
// reason, the agent's start.
func moved(a, b *corev1.Pod) bool {
	return a.Status.Phase != b.Status.Phase || (a.DeletionTimestamp == nil) != (b.DeletionTimestamp == nil) ||
		reasonOf(a) != reasonOf(b) || agentStarted(a) != agentStarted(b)
}

func agentStarted(pod *corev1.Pod) bool {
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == agentContainer && (cs.State.Running != nil || cs.State.Terminated != nil) {
			return true
		}
	}
	return false
}

// gone is the informer's delete handler.
func (p *Provider) gone(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	runner := pod.Labels[LabelRunner]
	p.mu.Lock()
	delete(p.deleted, pod.UID)
	delete(p.noticed, pod.UID)
	p.forgetCreating(runner, pod.UID)
	if o := p.outputs[pod.UID]; o != nil {
		o.ended, o.goneAt = true, time.Now()
	}
	for uid, o := range p.outputs {
		if !o.goneAt.IsZero() && time.Since(o.goneAt) > goneKeep {
			delete(p.outputs, uid)
		}
	}
	watchers := slices.Collect(maps.Values(p.watchers))
	p.mu.Unlock()
	for _, f := range watchers {
		f(runner)
	}
}

// Watch calls changed with a runner's name when its pod changes phase,
// is deleted, or gets a reason, until ctx ends. It returns at once.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) {
	subscribe(ctx, p, p.watchers, changed)
}

// WatchPreemption calls notice once for each pod being evicted, preempted
// or deleted by someone else, until ctx ends. It returns at once.
func (p *Provider) WatchPreemption(ctx context.Context, notice func(provider.Notice)) {
	subscribe(ctx, p, p.noticers, notice)
}

// subscribe adds f to the provider's subscribers in m until ctx ends.
func subscribe[T any](ctx context.Context, p *Provider, m map[int]T, f T) {
	p.mu.Lock()
	id := p.nextID
	p.nextID++
	m[id] = f
	p.mu.Unlock()
	go func() {
		<-ctx.Done()
		p.mu.Lock()
		delete(m, id)
		p.mu.Unlock()
	}()
}

// output is what is known of a pod's agent output.
type output struct {
	pod     string
	started bool // the agent container ran: there is a log to read
	ended   bool // the pod ended: one more read gets all there is
	final   bool // read after the pod ended: nothing more will come
	at      time.Time
	data    []byte
	goneAt  time.Time
}

// logTailLines bounds each read of a pod's log: by lines, since a byte
// limit would keep the start of them rather than the end.
const logTailLines = 400

// Output reads the end of the agent container's log, through the
// apiserver (pods/log). A running pod's is read at most once per
// LogInterval; an ended pod's once more, then kept until the pod has
// been gone for a while. The pod counts as ended when inst, read from
// the informer's cache, says so: the cache is updated before the event
// handlers run, so a pass may list a pod ended whose end the handler has
// not yet recorded, and a log read while it ran would tell a job that
// finished as one that died with its agent.
func (p *Provider) Output(ctx context.Context, inst provider.Instance, max int64) (io.ReadCloser, error) {
	uid := types.UID(inst.ID)
	exited := inst.State == provider.StateExited
	p.mu.Lock()
	o := p.outputs[uid]
	if o == nil || !o.started {
		p.mu.Unlock()
		return nil, provider.ErrNoOutput
	}
	name, fresh, final := o.pod, time.Since(o.at) < p.opt.LogInterval, o.final
	ended, data, gone := o.ended || exited, o.data, !o.goneAt.IsZero()
	p.mu.Unlock()
	if final || gone || (fresh && !ended) {
		return tail(data, max)
	}
	cctx, cancel := p.call(ctx)
	defer cancel()
	lines := int64(logTailLines)
	b, err := p.cs.Pods(p.opt.Namespace).GetLogs(name, &corev1.PodLogOptions{
		Container: agentContainer, TailLines: &lines,
	}).DoRaw(cctx)
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case err == nil:
		o.data, o.at, o.final = b, time.Now(), ended
	case apierrors.IsNotFound(err):
		o.final = true
	default:
		o.at = time.Now() // not again at once
		p.log.Debug("read pod log", "pod", name, "err", err)
	}
	return tail(o.data, max)
}

func tail(b []byte, max int64) (io.ReadCloser, error) {
	if len(b) == 0 {
		return nil, provider.ErrNoOutput
	}
	if int64(len(b)) > max {
		b = b[int64(len(b))-max:]
	}
	return io.NopCloser(bytes.NewReader(b)), nil // o.data is replaced, never written to
}
