// Package kubeclient makes client-go configurations the way runfleet's
// users name a cluster: a kubeconfig file (or $KUBECONFIG, ~/.kube/config),
// a kubeconfig's contents (CML's KUBERNETES_CONFIGURATION), a context, or
// the service account of the pod runfleet runs in. The Kubernetes provider
// and leader election share it.
package kubeclient

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync/atomic"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/runfleet/runfleet/secret"
	"github.com/runfleet/runfleet/version"
)

// Options name a cluster and a namespace.
type Options struct {
	// Kubeconfig is a kubeconfig file; empty for the default loading
	// rules ($KUBECONFIG, ~/.kube/config, then in-cluster).
	Kubeconfig string
	// Data is a kubeconfig's contents, instead of a file.
	Data      secret.String
	Context   string
	InCluster bool
	// Namespace overrides the context's (or the pod's) namespace.
	Namespace string
	// Field prefixes errors: the config section the options came from.
	Field string
	// QPS and Burst are client-side rate limits; client-go's (5, 10)
	// when zero.
	QPS   float32
	Burst int
	// Calls, when set, counts the requests sent.
	Calls *atomic.Int64
}

// Config returns the client configuration and the namespace to use: the
// options', the context's, the pod's, or "default".
func Config(o Options) (*rest.Config, string, error) {
	field := o.Field
	if field != "" {
		field += "."
	}
	var cc clientcmd.ClientConfig
	over := &clientcmd.ConfigOverrides{CurrentContext: o.Context}
	switch {
	case o.InCluster:
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, "", fmt.Errorf("%sin_cluster: %w", field, err)
		}
		return finish(cfg, o, podNamespace())
	case o.Data != "":
		raw, err := clientcmd.Load([]byte(o.Data.Reveal()))
		if err != nil {
			// The contents are credentials: never quote them.
			return nil, "", fmt.Errorf("%skubeconfig_data: not a kubeconfig", field)
		}
		cc = clientcmd.NewDefaultClientConfig(*raw, over)
	default:
		rules := clientcmd.NewDefaultClientConfigLoadingRules()
		rules.ExplicitPath = o.Kubeconfig
		cc = clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, over)
	}
	cfg, err := cc.ClientConfig()
	if err != nil {
		what := "kubeconfig"
		if o.Data != "" {
			what = "kubeconfig_data"
		}
		if clientcmd.IsEmptyConfig(err) {
			err = errors.New("no cluster configured: set kubeconfig, or run in a cluster")
		}
		return nil, "", fmt.Errorf("%s%s: %w", field, what, err)
	}
	ns, _, err := cc.Namespace()
	if err != nil {
		ns = ""
	}
	return finish(cfg, o, ns)
}

func finish(cfg *rest.Config, o Options, fallback string) (*rest.Config, string, error) {
	if o.QPS > 0 {
		cfg.QPS, cfg.Burst = o.QPS, o.Burst
	}
	cfg.UserAgent = version.UserAgent()
	if o.Calls != nil {
		calls := o.Calls
		cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return counter{rt, calls} })
	}
	ns := o.Namespace
	if ns == "" {
		ns = fallback
	}
	if ns == "" {
		ns = "default"
	}
	return cfg, ns, nil
}

func podNamespace() string {
	b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// counter counts the requests sent to the apiserver.
type counter struct {
	next  http.RoundTripper
	calls *atomic.Int64
}

func (c counter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.calls.Add(1)
	return c.next.RoundTrip(r)
}
