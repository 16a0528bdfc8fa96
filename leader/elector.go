package leader

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/kubeclient"
)

// elector takes part in the election on one Lease with the algorithm of
// client-go's tools/leaderelection (LeaseLock, ReleaseOnCancel), which
// this package used until it was seen to link every API group's typed
// clients into the binary (its resourcelock package imports them: some
// 20 MiB more resident in every manager). Hand-written for that reason;
// the rules are client-go's:
//
//   - a candidate tries every RetryPeriod (with 20% jitter) to take the
//     Lease: it creates it when there is none, and takes it when its holder
//     is empty or has not renewed it within its lease duration, counted on
//     this candidate's clock from when it last saw the Lease change (never
//     from the times written in it: clocks differ);
//   - a leader renews every RetryPeriod, and stands down when no renewal
//     succeeded for RenewDeadline;
//   - writes are updates of the Lease as last read (its resourceVersion),
//     so that of two candidates only one takes it; and a renewal keeps what
//     else is on the Lease (the webhook annotations);
//   - a leader that stops gives the Lease up (an empty holder, a lease of
//     one second), so that a successor need not wait.
type elector struct {
	o      Options
	leases kubeclient.Leases
	log    *slog.Logger

	lease *coordinationv1.Lease // as last read or written
	seen  coordinationv1.LeaseSpec
	// seenAt is when the Lease was seen to change, on this clock.
	seenAt time.Time
	// newLeader is told of each holder seen, once each time it changes.
	newLeader func(id string)
	reported  string
	events    sync.WaitGroup // the events being recorded
}

// leading says whether this candidate holds the Lease as last seen.
func (e *elector) leading() bool { return holder(e.seen) == e.o.Identity }

// valid says whether the Lease as last seen is still held at now.
func (e *elector) valid(now time.Time) bool {
	d := time.Duration(0)
	if e.seen.LeaseDurationSeconds != nil {
		d = time.Duration(*e.seen.LeaseDurationSeconds) * time.Second
	}
	return e.seenAt.Add(d).After(now)
}

func holder(s coordinationv1.LeaseSpec) string {
	if s.HolderIdentity == nil {
		return ""
	}
	return *s.HolderIdentity
}

// observe records the Lease as read or written at now.
func (e *elector) observe(l *coordinationv1.Lease, now time.Time) {
	e.lease = l
	if !specEqual(e.seen, l.Spec) || e.seenAt.IsZero() {
		e.seen, e.seenAt = *l.Spec.DeepCopy(), now
	}
	if h := holder(l.Spec); h != e.reported {
		e.reported = h
		if h != "" {
			e.newLeader(h)
		}
	}
}

func specEqual(a, b coordinationv1.LeaseSpec) bool {
	eq := func(x, y *metav1.MicroTime) bool {
		return (x == nil) == (y == nil) && (x == nil || x.Equal(y))
	}
	i32 := func(x, y *int32) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	return holder(a) == holder(b) && i32(a.LeaseDurationSeconds, b.LeaseDurationSeconds) &&
		i32(a.LeaseTransitions, b.LeaseTransitions) && eq(a.AcquireTime, b.AcquireTime) && eq(a.RenewTime, b.RenewTime)
}

// spec is the Lease's spec with this candidate holding it from acquired,
// renewed at now, after transitions changes of holder.
func (e *elector) spec(acquired, now time.Time, transitions int32) coordinationv1.LeaseSpec {
	id := e.o.Identity
	secs := int32(e.o.LeaseDuration / time.Second)
	at, renewed := metav1.NewMicroTime(acquired), metav1.NewMicroTime(now)
	return coordinationv1.LeaseSpec{HolderIdentity: &id, LeaseDurationSeconds: &secs,
		AcquireTime: &at, RenewTime: &renewed, LeaseTransitions: &transitions}
}

// tryAcquireOrRenew makes one attempt to take or keep the Lease.
func (e *elector) tryAcquireOrRenew(ctx context.Context) bool {
	now := time.Now()
	// A leader renews the Lease as it last wrote it: one call, unless
	// someone else wrote it since.
	if e.leading() && e.valid(now) && e.lease != nil {
		l := e.lease.DeepCopy()
		l.Spec = e.spec(timeOf(e.seen.AcquireTime, now), now, transitions(e.seen))
		if e.update(ctx, l, now) {
			return true
		}
	}
	l, err := e.leases.Get(ctx, e.o.Lease, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		l = &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: e.o.Lease, Namespace: e.o.Namespace},
			Spec: e.spec(now, now, 0)}
		made, err := e.leases.Create(ctx, l, metav1.CreateOptions{})
		if err != nil {
			e.log.Debug("leader election: create the Lease", "err", err)
			return false
		}
		e.observe(made, now)
		return true
	case err != nil && ctx.Err() != nil: // stopped, or out of time to renew
		e.log.Debug("leader election: read the Lease", "err", err)
		return false
	case err != nil:
		e.log.Warn("leader election: read the Lease", "err", err)
		return false
	}
	e.observe(l, now)
	if holder(l.Spec) != "" && e.valid(now) && !e.leading() {
		return false
	}
	if e.leading() {
		l.Spec = e.spec(timeOf(l.Spec.AcquireTime, now), now, transitions(l.Spec))
	} else {
		l.Spec = e.spec(now, now, transitions(l.Spec)+1)
	}
	return e.update(ctx, l, now)
}

// update writes l, as read with its resourceVersion, and records what the
// apiserver kept; false when it refused (another wrote the Lease since).
func (e *elector) update(ctx context.Context, l *coordinationv1.Lease, now time.Time) bool {
	up, err := e.leases.Update(ctx, l, metav1.UpdateOptions{})
	if err != nil {
		e.log.Debug("leader election: update the Lease", "err", err)
		return false
	}
	e.observe(up, now)
	return true
}

func transitions(s coordinationv1.LeaseSpec) int32 {
	if s.LeaseTransitions == nil {
		return 0
	}
	return *s.LeaseTransitions
}

func timeOf(t *metav1.MicroTime, or time.Time) time.Time {
	if t == nil {
		return or
	}
	return t.Time
}

// acquire tries until it holds the Lease (true) or ctx ends (false).
func (e *elector) acquire(ctx context.Context) bool {
	for {
		if e.tryAcquireOrRenew(ctx) {
			return true
		}
		if !sleep(ctx, jitter(e.o.RetryPeriod)) {
			return false
		}
	}
}

// renew keeps the Lease until ctx ends (nil) or no renewal succeeded for
// RenewDeadline (an error).
func (e *elector) renew(ctx context.Context) error {
	for sleep(ctx, e.o.RetryPeriod) {
		deadline := time.Now().Add(e.o.RenewDeadline)
		for {
			rctx, cancel := context.WithDeadline(ctx, deadline)
			ok := e.tryAcquireOrRenew(rctx)
			cancel()
			if ok {
				break
			}
			if ctx.Err() != nil {
				return nil
			}
			if !time.Now().Add(e.o.RetryPeriod).Before(deadline) {
				return fmt.Errorf("not renewed within %s", e.o.RenewDeadline)
			}
			if !sleep(ctx, e.o.RetryPeriod) {
				return nil
			}
		}
	}
	return nil
}

// release gives the Lease up if this candidate holds it, within
// RenewDeadline, again on a conflict.
func (e *elector) release() {
	ctx, cancel := context.WithTimeout(context.Background(), e.o.RenewDeadline)
	defer cancel()
	for ctx.Err() == nil {
		l, err := e.leases.Get(ctx, e.o.Lease, metav1.GetOptions{})
		if err != nil {
			e.log.Warn("leader election: read the Lease to give it up", "err", err)
			return
		}
		e.observe(l, time.Now())
		if !e.leading() {
			return
		}
		none, one := "", int32(1)
		now := metav1.NewMicroTime(time.Now())
		l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds = &none, &one
		l.Spec.AcquireTime, l.Spec.RenewTime = &now, &now
		up, err := e.leases.Update(ctx, l, metav1.UpdateOptions{})
		if err == nil {
			e.observe(up, time.Now())
			return
		}
		if !apierrors.IsConflict(err) {
			e.log.Warn("leader election: give the Lease up", "err", err)
			return
		}
	}
}

// event records what happened to this candidate on the Lease, as
// client-go's elector does ("<identity> became leader"), for `kubectl
// describe lease`. Best effort, and in the background, so that a slow
// apiserver does not hold up acting: it needs create on events. Run
// waits for the events it started before it returns.
func (e *elector) event(ctx context.Context, client kubeclient.Interface, what string) {
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s.%x", e.o.Lease, now.UnixNano()), Namespace: e.o.Namespace},
		InvolvedObject: corev1.ObjectReference{Kind: "Lease", APIVersion: coordinationv1.SchemeGroupVersion.String(),
			Namespace: e.o.Namespace, Name: e.o.Lease},
		Reason: "LeaderElection", Message: e.o.Identity + " " + what, Type: corev1.EventTypeNormal,
		Source:         corev1.EventSource{Component: "runfleet"},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
	}
	if e.lease != nil {
		ev.InvolvedObject.UID, ev.InvolvedObject.ResourceVersion = e.lease.UID, e.lease.ResourceVersion
	}
	e.events.Go(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if _, err := client.Events(e.o.Namespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
			e.log.Debug("leader election: record an event on the Lease", "err", err)
		}
	})
}

// jitter adds up to 20% to d, as client-go's elector does, so that
// candidates started together do not call together.
func jitter(d time.Duration) time.Duration {
	return d + time.Duration(rand.Int64N(int64(d)/5+1))
}

// sleep waits d, false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
