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
	Logger                                    *slog.Logger
}

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
