// Package leader lets several managers with the same id share one fleet:
// they take part in an election on a coordination.k8s.io Lease (client-go's
// algorithm, see elector), and only the holder acts. It works whatever the
// pools' providers are; the cluster holds only the Lease.
package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/runfleet/runfleet/kubeclient"
)

// Options configure an election.
type Options struct {
	Client    kubeclient.Interface
	Namespace string
	Lease     string // the Lease's name
	Identity  string // this manager's, unique among the candidates
	// LeaseDuration is how long a lease not renewed stays taken: a dead
	// leader's successor waits this long. RenewDeadline is how long the
	// leader tries to renew before it stands down; RetryPeriod is the
	// pace of both.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// Advertise, when set, is written on the Lease while this manager
	// leads (AnnotationWebhooks, with AnnotationHolder): where the others
	// forward the webhooks they receive.
	Advertise string
	Logger    *slog.Logger
}

// The Lease's annotations that say where its holder takes webhooks. The
// holder's identity is written with the address, so that a leader's
// address is not taken for its successor's before that one writes its
// own.
const (
	AnnotationWebhooks = "runfleet.dev/webhooks"
	AnnotationHolder   = "runfleet.dev/webhooks-holder"
)

// ErrLost is returned by Run when the lease was lost while leading: the
// manager stopped acting, and should exit.
var ErrLost = errors.New("leader election: lost the lease")

// Identity is a default identity: the host's name and the process id.
func Identity() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s_%d", host, os.Getpid())
}

// Run takes part in the election until ctx ends. While this manager holds
// the lease, act runs with ctx and a channel that is closed when the
// lease is lost; act returns when ctx ends (after a drain, which holds
// the lease) or at once when the lease is lost. The lease is given up
// when act returns, so that a successor need not wait for it to expire.
// Run returns ErrLost when the lease was lost, nil otherwise.
func Run(ctx context.Context, o Options, act func(ctx context.Context, lost <-chan struct{})) error {
	if o.Client == nil || o.Namespace == "" || o.Lease == "" || o.Identity == "" {
		return errors.New("leader election: a client, a namespace, a lease and an identity are required")
	}
	// client-go's elector's bounds: a renewal must fit, with its jitter.
	if o.LeaseDuration <= o.RenewDeadline || float64(o.RenewDeadline) <= 1.2*float64(o.RetryPeriod) || o.RetryPeriod <= 0 {
		return fmt.Errorf("leader election: want lease duration (%s) > renew deadline (%s) > 1.2 × retry period (%s) > 0",
			o.LeaseDuration, o.RenewDeadline, o.RetryPeriod)
	}
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("lease", o.Namespace+"/"+o.Lease, "identity", o.Identity)
	e := &elector{o: o, leases: o.Client.Leases(o.Namespace), log: log, newLeader: func(id string) {
		if id != o.Identity {
			log.Info("leader election: another manager leads; waiting", "leader", id)
		}
	}}
	// The election outlives ctx while act drains: the lease is kept
	// until act is done. A standby just leaves when ctx ends.
	elect, resign := context.WithCancel(context.WithoutCancel(ctx))
	defer resign()
	defer e.events.Wait()
	standby := context.AfterFunc(ctx, resign)
	log.Info("leader election: waiting for the lease")
	if !e.acquire(elect) {
		return nil
	}
	standby()
	log.Info("leader election: this manager leads; acting")
	e.event(ctx, o.Client, "became leader")
	lead, stop := context.WithCancel(elect)
	gone, acted := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(acted)
		defer resign()
		if o.Advertise != "" {
			advertise(lead, o, log)
		}
		act(ctx, gone)
	}()
	err := e.renew(elect)
	stop()
	if err != nil {
		log.Error("leader election: lost the lease; stopping at once", "err", err)
		close(gone)
	}
	<-acted
	e.event(ctx, o.Client, "stopped leading")
	if err != nil {
		return ErrLost
	}
	e.release()
	log.Info("leader election: gave up the lease")
	return nil
}

// advertise writes where this leader takes webhooks on the Lease's
// annotations, with get and update (the verbs the election needs: no
// patch right), again on a conflict with a renewal; a renewal keeps
// annotations it did not write. A failure is logged: standbys then answer
// webhooks 503 instead of forwarding them.
func advertise(ctx context.Context, o Options, log *slog.Logger) {
	leases := o.Client.Leases(o.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		l, err := leases.Get(ctx, o.Lease, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if l.Annotations == nil {
			l.Annotations = map[string]string{}
		}
		l.Annotations[AnnotationWebhooks], l.Annotations[AnnotationHolder] = o.Advertise, o.Identity
		_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		log.Error("leader election: could not advertise this manager's webhook listener on the Lease; standbys will refuse webhooks", "err", err)
	}
}

// Advertised returns where the Lease's holder takes webhooks, "" when it
// says nothing (or only its predecessor's address).
func Advertised(ctx context.Context, client kubeclient.Interface, namespace, lease string) (string, error) {
	l, err := client.Leases(namespace).Get(ctx, lease, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("leader election: read the Lease: %w", err)
	}
	if l.Spec.HolderIdentity == nil || l.Annotations[AnnotationHolder] != *l.Spec.HolderIdentity {
		return "", nil
	}
	return l.Annotations[AnnotationWebhooks], nil
}
