package kubeclient

import (
	"context"
	"fmt"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/gentype"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// Interface is the part of the Kubernetes API runfleet calls: pods, their
// Secrets, nodes and events (core/v1), and Leases (coordination.k8s.io/v1).
//
// client-go's clientset has all of it, but importing any of its typed
// clients registers every API group's types at start (k8s.io/client-go/
// kubernetes/scheme): some 20 MiB more resident in every runfleet process,
// whatever its pools. New makes these clients from client-go's gentype
// over a scheme of the two groups used; kubeclienttest adapts a clientset
// (the fake one, in tests) to it. The method sets are the typed clients'
// own, so that both fit.
type Interface interface {
	Pods(namespace string) Pods
	Secrets(namespace string) Secrets
	Nodes() Nodes
	Events(namespace string) Events
	Leases(namespace string) Leases
}

// Pods are a namespace's pods.
type Pods interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
	Create(ctx context.Context, pod *corev1.Pod, opts metav1.CreateOptions) (*corev1.Pod, error)
	Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error
	GetLogs(name string, opts *corev1.PodLogOptions) *rest.Request
}

// Secrets are a namespace's Secrets.
type Secrets interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.SecretList, error)
	Create(ctx context.Context, secret *corev1.Secret, opts metav1.CreateOptions) (*corev1.Secret, error)
	Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error
}

// Nodes are the cluster's nodes.
type Nodes interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Node, error)
}

// Events are a namespace's events.
type Events interface {
	Create(ctx context.Context, event *corev1.Event, opts metav1.CreateOptions) (*corev1.Event, error)
}

// Leases are a namespace's Leases.
type Leases interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*coordinationv1.Lease, error)
	Create(ctx context.Context, lease *coordinationv1.Lease, opts metav1.CreateOptions) (*coordinationv1.Lease, error)
	Update(ctx context.Context, lease *coordinationv1.Lease, opts metav1.UpdateOptions) (*coordinationv1.Lease, error)
}

// clients implements Interface with one REST client per API group, sharing
// a connection pool and a rate limiter as the clientset's do.
type clients struct {
	core, coordination rest.Interface
	params             runtime.ParameterCodec
}

// New makes the clients for cfg (see Config). The scheme is made here,
// not at package init: a binary that opens no cluster pays nothing.
func New(cfg *rest.Config) (Interface, error) {
	scheme := runtime.NewScheme()
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, coordinationv1.AddToScheme} {
		if err := add(scheme); err != nil {
			return nil, fmt.Errorf("kubernetes client: %w", err)
		}
	}
	c := rest.CopyConfig(cfg)
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	if c.RateLimiter == nil && c.QPS > 0 {
		if c.Burst <= 0 {
			return nil, fmt.Errorf("kubernetes client: a burst is needed with a QPS of %v", c.QPS)
		}
		c.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(c.QPS, c.Burst)
	}
	hc, err := rest.HTTPClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	codecs := rest.CodecFactoryForGeneratedClient(scheme, serializer.NewCodecFactory(scheme)).WithoutConversion()
	restFor := func(gv schema.GroupVersion, path string) (rest.Interface, error) {
		gc := rest.CopyConfig(c)
		gc.GroupVersion, gc.APIPath, gc.NegotiatedSerializer = &gv, path, codecs
		rc, err := rest.RESTClientForConfigAndClient(gc, hc)
		if err != nil {
			return nil, fmt.Errorf("kubernetes client for %s: %w", gv, err)
		}
		return rc, nil
	}
	cl := &clients{params: runtime.NewParameterCodec(scheme)}
	if cl.core, err = restFor(corev1.SchemeGroupVersion, "/api"); err != nil {
		return nil, err
	}
	if cl.coordination, err = restFor(coordinationv1.SchemeGroupVersion, "/apis"); err != nil {
		return nil, err
	}
	return cl, nil
}

func (c *clients) Pods(namespace string) Pods {
	return pods{gentype.NewClientWithList("pods", c.core, c.params, namespace,
		func() *corev1.Pod { return &corev1.Pod{} }, func() *corev1.PodList { return &corev1.PodList{} },
		gentype.PrefersProtobuf[*corev1.Pod]()), c.params}
}

func (c *clients) Secrets(namespace string) Secrets {
	return gentype.NewClientWithList("secrets", c.core, c.params, namespace,
		func() *corev1.Secret { return &corev1.Secret{} }, func() *corev1.SecretList { return &corev1.SecretList{} },
		gentype.PrefersProtobuf[*corev1.Secret]())
}

func (c *clients) Nodes() Nodes {
	return gentype.NewClient("nodes", c.core, c.params, "",
		func() *corev1.Node { return &corev1.Node{} }, gentype.PrefersProtobuf[*corev1.Node]())
}

func (c *clients) Events(namespace string) Events {
	return gentype.NewClient("events", c.core, c.params, namespace,
		func() *corev1.Event { return &corev1.Event{} }, gentype.PrefersProtobuf[*corev1.Event]())
}

func (c *clients) Leases(namespace string) Leases {
	return gentype.NewClient("leases", c.coordination, c.params, namespace,
		func() *coordinationv1.Lease { return &coordinationv1.Lease{} }, gentype.PrefersProtobuf[*coordinationv1.Lease]())
}

// pods adds the log subresource, as the typed client's expansion does.
type pods struct {
	*gentype.ClientWithList[*corev1.Pod, *corev1.PodList]
	params runtime.ParameterCodec
}

func (p pods) GetLogs(name string, opts *corev1.PodLogOptions) *rest.Request {
	return p.GetClient().Get().Namespace(p.GetNamespace()).Name(name).Resource("pods").SubResource("log").VersionedParams(opts, p.params)
}
