// Package kubernetes runs runners as Kubernetes pods, through client-go:
// one pod per runner (restartPolicy Never), labelled with the manager id,
// pool and runner name, its credential in a Secret of its own that the
// pod owns, watched through an informer.
package kubernetes

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/watch"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/runfleet/runfleet/kubeclient"
	"github.com/runfleet/runfleet/provider"
)

// Options configure New.
type Options struct {
	Client    kubeclient.Interface
	Namespace string
	Manager   string
	Pool      string
	Section   Section
	// GPUs is the number of GPUs each runner asks for (gpus_per_runner).
	GPUs int
	// MaxLifetime sets each pod's activeDeadlineSeconds (see deadline).
	MaxLifetime time.Duration
	// CallTimeout bounds each API call; DefaultCallTimeout when 0.
	CallTimeout time.Duration
	// LogInterval is how long a running pod's output, once read, is
	// reused; DefaultLogInterval when 0. A pod that ended is read once
	// more, and its output kept until it is gone.
	LogInterval time.Duration
	Logger      *slog.Logger
	// Calls, when set, counts the requests sent to the apiserver.
	Calls *atomic.Int64

	volumes []Volume
}

// Defaults of Options.
const (
	DefaultCallTimeout = 30 * time.Second
	DefaultLogInterval = 10 * time.Second
)

// orphanSecretAge is how old a Secret without its pod must be before it
// is swept: its pod may still be on its way into the cache.
var orphanSecretAge = time.Minute

// goneKeep is how long the output of a pod that is gone stays readable:
// the pool reads a runner's last output after its machine went.
const goneKeep = 2 * time.Minute

// Provider runs one pool's runners as pods.
type Provider struct {
	opt     Options
	cs      kubeclient.Interface
	log     *slog.Logger
	pods    listersv1.PodLister
	synced  cache.InformerSynced
	stop    context.CancelFunc
	stopped chan struct{}
	// nodes are the systems of the nodes the pods ran on (nodes.go).
	nodes provider.NodeSystems

	mu sync.Mutex
	// creating holds pods created and not yet seen by the informer, by
	// runner name, so that Create stays idempotent and List complete.
	creating map[string]*corev1.Pod
	// deleted holds the pods this provider deleted: they are going,
	// and no longer listed.
	deleted  map[types.UID]bool
	outputs  map[types.UID]*output
	noticed  map[types.UID]bool
	watchers map[int]func(string)
	noticers map[int]func(provider.Notice)
	nextID   int
	swept    time.Time
}

// New starts watching the pool's pods; it creates none.
func New(opt Options) (*Provider, error) {
	if opt.Client == nil || opt.Namespace == "" {
		return nil, errors.New("kubernetes: a client and a namespace are required")
	}
	for field, v := range map[string]string{"id": opt.Manager, "pool": opt.Pool} {
		if msgs := validation.IsValidLabelValue(v); len(msgs) > 0 || v == "" {
			return nil, fmt.Errorf("kubernetes: the %s %q cannot label pods: %s", field, v, strings.Join(msgs, "; "))
		}
	}
	for _, v := range opt.Section.Volumes {
		vol, err := ParseVolume(v)
		if err != nil {
			return nil, fmt.Errorf("kubernetes.volumes: %w", err)
		}
		opt.volumes = append(opt.volumes, vol)
	}
	if opt.CallTimeout <= 0 {
		opt.CallTimeout = DefaultCallTimeout
	}
	if opt.LogInterval <= 0 {
		opt.LogInterval = DefaultLogInterval
	}
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	p := &Provider{
		opt: opt, cs: opt.Client, log: opt.Logger,
		creating: map[string]*corev1.Pod{}, deleted: map[types.UID]bool{},
		outputs: map[types.UID]*output{}, noticed: map[types.UID]bool{},
		watchers: map[int]func(string){}, noticers: map[int]func(provider.Notice){},
		stopped: make(chan struct{}),
	}
	sel := labels.SelectorFromSet(labels.Set{LabelManager: opt.Manager, LabelPool: opt.Pool}).String()
	// One informer for the pool's pods, as client-go's generated pod
	// informer makes it (informers/core/v1), without the informer
	// factory, which links every API group's informers.
	podsAPI := opt.Client.Pods(opt.Namespace)
	informer := cache.NewSharedIndexInformerWithOptions(cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = sel
			return podsAPI.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = sel
			return podsAPI.Watch(ctx, o)
		},
	}, podsAPI), &corev1.Pod{}, cache.SharedIndexInformerOptions{
		Indexers: cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc},
	})
	// The cache keeps what the provider reads, not the managed fields.
	_ = informer.SetTransform(func(obj any) (any, error) {
		if m, ok := obj.(metav1.Object); ok {
			m.SetManagedFields(nil)
		}
		return obj, nil
	})
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.changed(nil, obj) },
		UpdateFunc: p.changed,
		DeleteFunc: p.gone,
	}); err != nil {
		return nil, fmt.Errorf("kubernetes: watch pods: %w", err)
	}
	p.pods, p.synced = listersv1.NewPodLister(informer.GetIndexer()), informer.HasSynced
	ctx, cancel := context.WithCancel(context.Background())
	p.stop = cancel
	p.nodes = provider.NodeSystems{Read: p.readNode, Denied: apierrors.IsForbidden, Log: opt.Logger}
	go func() {
		defer close(p.stopped)
		informer.RunWithContext(ctx)
	}()
	return p, nil
}

// Close stops watching; the pods keep running. Secrets left without a pod
// are deleted first, whatever their age: the periodic sweep leaves young
// ones, which a manager that stops soon after it started (a drain after a
// crash) would otherwise leave behind.
func (p *Provider) Close() error {
	p.sweepOrphans()
	p.stop()
	p.nodes.Close()
	<-p.stopped
	return nil
}

// sweepOrphans deletes the pool's Secrets that no pod of the same name has,
// as the apiserver lists them now, unless a create is under way.
func (p *Provider) sweepOrphans() {
	p.mu.Lock()
	busy := len(p.creating) > 0
	p.mu.Unlock()
	if busy {
		return
	}
	ctx, cancel := p.call(context.Background())
	defer cancel()
	sel := labels.SelectorFromSet(labels.Set{LabelManager: p.opt.Manager, LabelPool: p.opt.Pool}).String()
	// Secrets first: a pod is made before its Secret, so every Secret
	// listed has its pod in the later list unless it is an orphan, even
	// while another manager of the same id (a new leader) makes runners.
	secrets, err := p.cs.Secrets(p.opt.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return
	}
	pods, err := p.cs.Pods(p.opt.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return
	}
	have := map[string]bool{}
	for _, pod := range pods.Items {
		have[pod.Name] = true
	}
	for _, s := range secrets.Items {
		if have[s.Name] {
			continue
		}
		if err := p.cs.Secrets(p.opt.Namespace).Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			p.log.Warn("delete secret without a pod", "secret", s.Name, "err", err)
		}
	}
}

// Traits: pods come with their image and may be evicted or preempted,
// and get GPUs of their nodes (gpu_resource, gpus_per_runner of them),
// never this host's.
func (p *Provider) Traits() provider.Traits {
	return provider.Traits{Preemptible: true, SchedulesGPUs: true}
}

// Calls is the number of requests sent to the apiserver, when Options
// counted them.
func (p *Provider) Calls() int64 {
	if p.opt.Calls == nil {
		return 0
	}
	return p.opt.Calls.Load()
}

func (p *Provider) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, p.opt.CallTimeout)
}

// wait blocks until the informer has listed the pods once.
func (p *Provider) wait(ctx context.Context) error {
	if p.synced() {
		return nil
	}
	if !cache.WaitForCacheSync(ctx.Done(), p.synced) {
		return fmt.Errorf("kubernetes: pods of pool %s not listed: %w", p.opt.Pool, context.Cause(ctx))
	}
	return nil
}

// podName is a new, unique name for a runner's pod and its Secret: a
// slot's next pod may start while its last one is still terminating.
func podName(manager, runner string) string {
	base := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '-':
			return r
		case r >= 'A' && r <= 'Z':
			return r - 'A' + 'a'
		}
		return '-'
	}, manager+"-"+runner)
	if len(base) > 57 {
		base = base[:57]
	}
	const alphabet = "bcdfghjklmnpqrstvwxz2456789" // as the apiserver's generateName
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return strings.Trim(base, "-") + "-" + string(b)
}

// Create starts a runner's pod and its Secret. A runner with a live pod
// gets that pod back.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if err := p.wait(ctx); err != nil {
		return provider.Instance{}, err
	}
	if pod := p.live(spec.Name); pod != nil {
		return p.instance(pod), nil
	}
	spec = p.withRecord(spec)
	var created *corev1.Pod
	for attempt := 0; ; attempt++ {
		name := podName(spec.Manager, spec.Name)
		pod, err := p.podFor(name, spec)
		if err != nil {
			return provider.Instance{}, fmt.Errorf("pod for %s: %w", spec.Name, err)
		}
		pod.Namespace = p.opt.Namespace
		cctx, cancel := p.call(ctx)
		created, err = p.cs.Pods(p.opt.Namespace).Create(cctx, pod, metav1.CreateOptions{})
		cancel()
		if apierrors.IsAlreadyExists(err) && attempt == 0 {
			continue // the random suffix was taken
		}
		if err != nil {
			return provider.Instance{}, p.refusal(fmt.Errorf("create pod for %s in %s: %w", spec.Name, p.opt.Namespace, err))
		}
		break
	}
	if why := sidecarsDropped(created); why != "" {
		p.deletePod(context.WithoutCancel(ctx), created)
		return provider.Instance{}, fmt.Errorf("%w: pod for %s: %s", provider.ErrRejected, spec.Name, why)
	}
	p.mu.Lock()
	p.creating[spec.Name] = created
	p.mu.Unlock()
	// The Secret comes second, owned by the pod so that it goes with
	// it: the pod waits for it before it starts.
	sec := runnerSecret(created.Name, spec)
	ownedBy(sec, created)
	cctx, cancel := p.call(ctx)
	_, err := p.cs.Secrets(p.opt.Namespace).Create(cctx, sec, metav1.CreateOptions{})
	cancel()
	if err != nil && !apierrors.IsAlreadyExists(err) {
		p.deletePod(context.WithoutCancel(ctx), created)
		return provider.Instance{}, p.refusal(fmt.Errorf("create secret for %s in %s: %w", spec.Name, p.opt.Namespace, err))
	}
	return p.instance(created), nil
}

// refusal marks an apiserver's answer that no retry of the same request
// can change as provider.ErrRejected, so that the pool halts and says why
// rather than retrying for ever: Forbidden (the manager's role lacks a
// right, an admission policy refuses the pod), Invalid (the pod or Secret
// as the pool makes it), BadRequest, a namespace that does not exist. An
// exceeded ResourceQuota (also a 403) is one only while no pod of the
// pool's holds quota that its end would free; otherwise the pool backs
// off until one ends.
func (p *Provider) refusal(err error) error {
	var status apierrors.APIStatus
	switch {
	case !errors.As(err, &status):
		return err
	case apierrors.IsForbidden(err) && strings.Contains(status.Status().Message, "exceeded quota"):
		if p.holdsPods() {
			return err
		}
	case apierrors.IsNotFound(err) && status.Status().Details != nil && status.Status().Details.Kind != "namespaces":
		return err
	case apierrors.IsForbidden(err), apierrors.IsInvalid(err), apierrors.IsBadRequest(err), apierrors.IsNotFound(err):
	default:
		return err
	}
	return provider.Rejected(err)
}

// holdsPods says whether the pool has a pod that is not over.
func (p *Provider) holdsPods() bool {
	pods, _ := p.pods.Pods(p.opt.Namespace).List(labels.Everything())
	return slices.ContainsFunc(pods, func(pod *corev1.Pod) bool { return stateOf(pod) != provider.StateExited })
}

// live returns the runner's newest pod that is neither going nor ended:
// the one a Create finds. nil if none.
func (p *Provider) live(runner string) *corev1.Pod {
	pods, _ := p.pods.Pods(p.opt.Namespace).List(labels.SelectorFromSet(labels.Set{LabelRunner: runner}))
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.newest(pods, runner, false)
}

// newest picks, among a runner's pods and the one being created, the
// newest of this manager that this provider has not deleted; one that
// has ended only if withEnded. Called with p.mu held.
func (p *Provider) newest(pods []*corev1.Pod, runner string, withEnded bool) *corev1.Pod {
	var best *corev1.Pod
	for _, pod := range p.candidates(pods, runner) {
		if !withEnded && stateOf(pod) == provider.StateExited {
			continue
		}
		if best == nil || pod.CreationTimestamp.After(best.CreationTimestamp.Time) {
			best = pod
		}
	}
	return best
}

// candidates are a runner's pods, with the one being created, that are
// this manager's and that this provider has not deleted. Called with p.mu
// held.
func (p *Provider) candidates(pods []*corev1.Pod, runner string) []*corev1.Pod {
	if c := p.creating[runner]; c != nil {
		pods = append(pods, c)
	}
	return slices.DeleteFunc(pods, func(pod *corev1.Pod) bool {
		return pod.Labels[LabelManager] != p.opt.Manager || p.deleted[pod.UID]
	})
}

// forgetCreating drops the pod being created for a runner once the
// informer has it, or it is deleted. Called with p.mu held.
func (p *Provider) forgetCreating(runner string, uid types.UID) {
	if c := p.creating[runner]; c != nil && c.UID == uid {
		delete(p.creating, runner)
	}
}

// Delete deletes every pod of a runner and their Secrets.
func (p *Provider) Delete(ctx context.Context, name string) error {
	if err := p.wait(ctx); err != nil {
		return err
	}
	pods, _ := p.pods.Pods(p.opt.Namespace).List(labels.SelectorFromSet(labels.Set{LabelRunner: name}))
	p.mu.Lock()
	todo := p.candidates(pods, name)
	p.mu.Unlock()
	var errs []error
	for _, pod := range todo {
		errs = append(errs, p.deletePod(ctx, pod))
	}
	return errors.Join(errs...)
}

// deletePod deletes a pod (that pod, not a later one of the same name)
// and its Secret, which the garbage collector would also remove.
func (p *Provider) deletePod(ctx context.Context, pod *corev1.Pod) error {
	cctx, cancel := p.call(ctx)
	defer cancel()
	uid := pod.UID
	// Marked first: the informer may report the deletion before the
	// call returns, and it is no eviction.
	p.mu.Lock()
	p.deleted[uid] = true
	p.mu.Unlock()
	err := p.cs.Pods(p.opt.Namespace).Delete(cctx, pod.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &uid},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		p.mu.Lock()
		delete(p.deleted, uid)
		p.mu.Unlock()
		return fmt.Errorf("delete pod %s: %w", pod.Name, err)
	}
	p.mu.Lock()
	p.forgetCreating(pod.Labels[LabelRunner], uid)
	p.mu.Unlock()
	err = p.cs.Secrets(p.opt.Namespace).Delete(cctx, pod.Name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete secret %s: %w", pod.Name, err)
	}
	return nil
}

// List returns the runners' pods: each runner's newest pod that this
// provider has not deleted, ended or not. Another manager's pods are read
// from the apiserver, this one's from the informer's cache.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	if manager != p.opt.Manager {
		return p.listOther(ctx, manager)
	}
	if err := p.wait(ctx); err != nil {
		return nil, err
	}
	pods, err := p.pods.Pods(p.opt.Namespace).List(labels.Everything())
	if err != nil {
		return nil, err
	}
	p.sweepSecrets(ctx)
	byRunner := map[string][]*corev1.Pod{}
	for _, pod := range pods {
		if r := pod.Labels[LabelRunner]; r != "" {
			byRunner[r] = append(byRunner[r], pod)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for runner := range p.creating {
		if _, ok := byRunner[runner]; !ok {
			byRunner[runner] = nil
		}
	}
	out := make([]provider.Instance, 0, len(byRunner))
	for runner, group := range byRunner {
		if best := p.newest(group, runner, true); best != nil {
			out = append(out, p.instance(best))
		}
	}
	return out, nil
}

func (p *Provider) listOther(ctx context.Context, manager string) ([]provider.Instance, error) {
	cctx, cancel := p.call(ctx)
	defer cancel()
	sel := labels.SelectorFromSet(labels.Set{LabelManager: manager, LabelPool: p.opt.Pool}).String()
	list, err := p.cs.Pods(p.opt.Namespace).List(cctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, fmt.Errorf("list pods of manager %s: %w", manager, err)
	}
	var out []provider.Instance
	for i := range list.Items {
		out = append(out, p.instance(&list.Items[i]))
	}
	return out, nil
}

// sweepPodsWithoutSecret deletes the pool's Pending pods older than
// orphanSecretAge that no create is under way for and whose Secret is not
// among have (the Secrets listed just before).
func (p *Provider) sweepPodsWithoutSecret(ctx context.Context, have map[string]bool) {
	pods, _ := p.pods.Pods(p.opt.Namespace).List(labels.Everything())
	for _, pod := range pods {
		if have[pod.Name] || stateOf(pod) != provider.StateCreated || time.Since(pod.CreationTimestamp.Time) < orphanSecretAge ||
			pod.Labels[LabelManager] != p.opt.Manager {
			continue
		}
		p.mu.Lock()
		c := p.creating[pod.Labels[LabelRunner]]
		p.mu.Unlock()
		if c != nil && c.Name == pod.Name {
			continue
		}
		p.log.Warn("deleting a pod whose Secret was never made (its manager stopped between the two)", "pod", pod.Name, "runner", pod.Labels[LabelRunner])
		if err := p.deletePod(ctx, pod); err != nil {
			p.log.Warn("delete pod without its Secret", "pod", pod.Name, "err", err)
		}
	}
}

// sweepSecrets deletes, once a minute, the pool's Secrets whose pod is
// gone (the garbage collector does so where it runs, from the owner
// reference), and the pool's Pending pods whose Secret never came: a
// manager killed between the two creates leaves a pod that would wait for
// it, holding its slot, until pending_timeout.
func (p *Provider) sweepSecrets(ctx context.Context) {
	p.mu.Lock()
	due := time.Since(p.swept) > time.Minute
	if due {
		p.swept = time.Now()
	}
	p.mu.Unlock()
	if !due {
		return
	}
	cctx, cancel := p.call(ctx)
	defer cancel()
	sel := labels.SelectorFromSet(labels.Set{LabelManager: p.opt.Manager, LabelPool: p.opt.Pool}).String()
	list, err := p.cs.Secrets(p.opt.Namespace).List(cctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		p.log.Warn("list secrets", "err", err)
		return
	}
	have := map[string]bool{}
	for _, s := range list.Items {
		have[s.Name] = true
	}
	p.sweepPodsWithoutSecret(cctx, have)
	for _, s := range list.Items {
		if _, err := p.pods.Pods(p.opt.Namespace).Get(s.Name); err == nil || time.Since(s.CreationTimestamp.Time) < orphanSecretAge {
			continue
		}
		p.mu.Lock()
		c := p.creating[s.Labels[LabelRunner]]
		p.mu.Unlock()
		if c != nil && c.Name == s.Name {
			continue
		}
		if err := p.cs.Secrets(p.opt.Namespace).Delete(cctx, s.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			p.log.Warn("delete secret without a pod", "secret", s.Name, "err", err)
		}
	}
}
