// Package leader lets several managers with the same id share one fleet:
// they take part in an election on a coordination.k8s.io Lease (client-go's
// leaderelection), and only the holder acts. It works whatever the
// pools' providers are; the cluster holds only the Lease.
package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
)

// Options configure an election.
type Options struct {
	Client    kubernetes.Interface
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
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("lease", o.Namespace+"/"+o.Lease, "identity", o.Identity)
	// The election outlives ctx while act drains: the lease is kept
	// until act is done.
	elect, resign := context.WithCancel(context.WithoutCancel(ctx))
	defer resign()
	var (
		mu      sync.Mutex
		leading bool
		lost    bool
		acted   = make(chan struct{})
	)
	broadcaster := record.NewBroadcaster()
	defer broadcaster.Shutdown()
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: o.Client.CoreV1().Events(o.Namespace)})
	lock := &resourcelock.LeaseLock{
		LeaseMeta: metav1.ObjectMeta{Namespace: o.Namespace, Name: o.Lease},
		Client:    o.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{
			Identity:      o.Identity,
			EventRecorder: broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "runfleet"}),
		},
	}
	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: lock, Name: o.Lease, ReleaseOnCancel: true,
		LeaseDuration: o.LeaseDuration, RenewDeadline: o.RenewDeadline, RetryPeriod: o.RetryPeriod,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(lctx context.Context) {
				mu.Lock()
				leading = true
				mu.Unlock()
				log.Info("leader election: this manager leads; acting")
				if o.Advertise != "" {
					advertise(lctx, o, log)
				}
				gone := make(chan struct{})
				go func() {
					<-lctx.Done()
					if elect.Err() == nil { // not given up: lost
						mu.Lock()
						lost = true
						mu.Unlock()
						close(gone)
					}
				}()
				act(ctx, gone)
				close(acted)
				resign()
			},
			OnStoppedLeading: func() {
				mu.Lock()
				defer mu.Unlock()
				switch {
				case leading && elect.Err() == nil: // not given up
					log.Error("leader election: lost the lease; stopping at once")
				case leading:
					log.Info("leader election: gave up the lease")
				}
			},
			OnNewLeader: func(id string) {
				if id != o.Identity {
					log.Info("leader election: another manager leads; waiting", "leader", id)
				}
			},
		},
	})
	if err != nil {
		return fmt.Errorf("leader election: %w", err)
	}
	log.Info("leader election: waiting for the lease")
	go func() {
		<-ctx.Done()
		mu.Lock()
		l := leading
		mu.Unlock()
		if !l {
			resign() // a standby just leaves
		}
	}()
	elector.Run(elect)
	mu.Lock()
	l := leading
	mu.Unlock()
	if l {
		<-acted
	}
	mu.Lock()
	defer mu.Unlock()
	if lost {
		return ErrLost
	}
	return nil
}

// advertise writes where this leader takes webhooks on the Lease's
// annotations, with get and update (the verbs the election needs: no
// patch right), again on a conflict with a renewal; a renewal keeps
// annotations it did not write. A failure is logged: standbys then answer
// webhooks 503 instead of forwarding them.
func advertise(ctx context.Context, o Options, log *slog.Logger) {
	leases := o.Client.CoordinationV1().Leases(o.Namespace)
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
func Advertised(ctx context.Context, client kubernetes.Interface, namespace, lease string) (string, error) {
	l, err := client.CoordinationV1().Leases(namespace).Get(ctx, lease, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("leader election: read the Lease: %w", err)
	}
	if l.Spec.HolderIdentity == nil || l.Annotations[AnnotationHolder] != *l.Spec.HolderIdentity {
		return "", nil
	}
	return l.Annotations[AnnotationWebhooks], nil
}
