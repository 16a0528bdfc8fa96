// Package kubeclienttest adapts client-go's clientset, the fake one above
// all, to kubeclient.Interface, for tests: runfleet itself calls the
// cluster through kubeclient.New, and importing the clientset outside
// tests would link every API group's clients into the binary.
package kubeclienttest

import (
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/util/watchlist"

	"github.com/runfleet/runfleet/kubeclient"
)

// FromClientset returns cs's typed clients as a kubeclient.Interface.
func FromClientset(cs kubernetes.Interface) kubeclient.Interface { return clientset{cs} }

type clientset struct{ cs kubernetes.Interface }

func (c clientset) Pods(ns string) kubeclient.Pods {
	return pods{c.cs.CoreV1().Pods(ns), watchlist.DoesClientNotSupportWatchListSemantics(c.cs)}
}
func (c clientset) Secrets(ns string) kubeclient.Secrets { return c.cs.CoreV1().Secrets(ns) }
func (c clientset) Nodes() kubeclient.Nodes              { return c.cs.CoreV1().Nodes() }
func (c clientset) Events(ns string) kubeclient.Events   { return c.cs.CoreV1().Events(ns) }
func (c clientset) Leases(ns string) kubeclient.Leases   { return c.cs.CoordinationV1().Leases(ns) }

// pods carries the clientset's word on watch lists to an informer over
// them: the fake clientset's watches never send the bookmark a watch list
// waits for, and it says so on the clientset, not on its typed clients
// (kubernetes/fake/clientset_generated.go, IsWatchListSemanticsUnSupported;
// util/watchlist asks the client it is given, as the generated informers
// hand it the clientset).
type pods struct {
	typedcorev1.PodInterface
	noWatchList bool
}

func (p pods) IsWatchListSemanticsUnSupported() bool { return p.noWatchList }
