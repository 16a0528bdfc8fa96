package leader

import (
	"context"
	"errors"
	"flag"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/kubeclient"
)

// The elections run against a real kube-apiserver and etcd (built on first
// use and cached; see internal/testbed/peers).
var (
	kube    *peers.Kube
	kubeErr error
	// clients are the ones a manager makes (kubeclient.New).
	clients kubeclient.Interface
)

func TestMain(m *testing.M) {
	code := func() int {
		flag.Parse()
		if testing.Short() {
			return m.Run()
		}
		kube, kubeErr = peers.StartKube(context.Background(), peers.KubeOptions{Progress: os.Stderr, NoScheduler: true})
		if kube != nil {
			defer kube.Stop()
			clients, kubeErr = kubeclient.New(kube.Config) // needKube says why, if it failed
		}
		return m.Run()
	}()
	os.Exit(code)
}

func needKube(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("cluster test: skipped with -short")
	}
	peers.Need(t, "the Kubernetes control plane", kubeErr)
}

func options(id, lease string) Options {
	return Options{Client: clients, Namespace: "default", Lease: lease, Identity: id,
		LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 300 * time.Millisecond}
}

// candidate runs an election in the background and records when it
// acts.
type candidate struct {
	mu      sync.Mutex
	acting  bool
	started time.Time
	stop    context.CancelFunc
	err     chan error
	lost    chan struct{}
}

func run(o Options, overlap *atomic.Bool, others ...*candidate) *candidate {
	ctx, cancel := context.WithCancel(context.Background())
	c := &candidate{stop: cancel, err: make(chan error, 1), lost: make(chan struct{})}
	go func() {
		c.err <- Run(ctx, o, func(ctx context.Context, lost <-chan struct{}) {
			for _, other := range others {
				if other.isActing() {
					overlap.Store(true)
				}
			}
			c.mu.Lock()
			c.acting, c.started = true, time.Now()
			c.mu.Unlock()
			select {
			case <-ctx.Done():
			case <-lost:
				close(c.lost)
			}
			c.mu.Lock()
			c.acting = false
			c.mu.Unlock()
		})
	}()
	return c
}

func (c *candidate) isActing() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.acting
}

func waitActing(t *testing.T, c *candidate, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !c.isActing() {
		if time.Now().After(deadline) {
			t.Fatalf("not acting within %s", within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// One of two candidates acts; the other waits, and takes over as soon as
// the first gives the lease up (not a lease duration later).
func TestOneLeaderThenHandOver(t *testing.T) {
	needKube(t)
	var overlap atomic.Bool
	a := run(options("a", "handover"), &overlap)
	waitActing(t, a, 10*time.Second)
	var b *candidate
	b = run(options("b", "handover"), &overlap, a)
	time.Sleep(2 * time.Second)
	if b.isActing() {
		t.Fatal("two candidates act at once")
	}
	a.stop()
	if err := <-a.err; err != nil {
		t.Fatalf("leader's Run: %v", err)
	}
	gaveUp := time.Now()
	waitActing(t, b, 3*time.Second)
	t.Logf("b acted %s after a gave the lease up", time.Since(gaveUp).Round(10*time.Millisecond))
	if overlap.Load() {
		t.Error("b acted while a still did")
	}
	b.stop()
	if err := <-b.err; err != nil {
		t.Fatal(err)
	}
}

// A leader whose lease is taken (it could not renew) stops acting and
// Run says so; a standby that is stopped just returns.
func TestLostLeaseStopsActing(t *testing.T) {
	needKube(t)
	var overlap atomic.Bool
	a := run(options("a", "lost"), &overlap)
	waitActing(t, a, 10*time.Second)
	standby := run(options("s", "lost"), &overlap, a)
	ctx := context.Background()
	leases := kube.Client.CoordinationV1().Leases("default")
	// Another holder writes itself into the lease, as after a partition.
	l, err := leases.Get(ctx, "lost", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	intruder := "intruder"
	now := metav1.NewMicroTime(time.Now().Add(time.Hour))
	l.Spec.HolderIdentity, l.Spec.RenewTime = &intruder, &now
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.lost:
	case <-time.After(10 * time.Second):
		t.Fatal("the leader did not notice the lease was lost")
	}
	if err := <-a.err; !errors.Is(err, ErrLost) {
		t.Fatalf("Run = %v, want ErrLost", err)
	}
	if standby.isActing() {
		t.Error("the standby acts while the lease is someone else's")
	}
	standby.stop()
	select {
	case err := <-standby.err:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a stopped standby did not return")
	}
}

// A Lease whose holder stopped renewing is taken once it has not changed
// for its lease duration, counted on the candidate's clock: the times
// written in it (here a renewal an hour ahead, as from a skewed clock)
// are not trusted. The new holder counts a transition and says on the
// Lease's events that it leads.
func TestTakesAbandonedLease(t *testing.T) {
	needKube(t)
	ctx := context.Background()
	ghost, secs, turns := "ghost", int32(3), int32(4)
	ahead := metav1.NewMicroTime(time.Now().Add(time.Hour))
	_, err := clients.Leases("default").Create(ctx, &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: "abandoned", Namespace: "default"},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: &ghost, LeaseDurationSeconds: &secs,
			AcquireTime: &ahead, RenewTime: &ahead, LeaseTransitions: &turns},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var overlap atomic.Bool
	c := run(options("heir", "abandoned"), &overlap)
	waitActing(t, c, 10*time.Second)
	if waited := time.Since(start); waited < 3*time.Second {
		t.Errorf("took the lease after %s, before its holder's 3s ran out", waited.Round(time.Millisecond))
	}
	l, err := clients.Leases("default").Get(ctx, "abandoned", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := l.Spec.HolderIdentity; h == nil || *h != "heir" || l.Spec.LeaseTransitions == nil || *l.Spec.LeaseTransitions != 5 {
		t.Errorf("lease spec after the takeover: %+v", l.Spec)
	}
	c.stop()
	if err := <-c.err; err != nil {
		t.Fatal(err)
	}
	evs, err := kube.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=abandoned"})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []string
	for _, e := range evs.Items {
		msgs = append(msgs, e.Message)
	}
	if !slices.Contains(msgs, "heir became leader") || !slices.Contains(msgs, "heir stopped leading") {
		t.Errorf("events on the lease: %q", msgs)
	}
	// Given up: no holder, so that a successor need not wait.
	l, err = clients.Leases("default").Get(ctx, "abandoned", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := l.Spec.HolderIdentity; h != nil && *h != "" {
		t.Errorf("holder after stopping: %q", *h)
	}
}

// Timings an election cannot keep are refused before anything is called:
// a renewal must fit in the lease, and a retry in the renewal deadline.
func TestRunRefusesTimings(t *testing.T) {
	o := Options{Client: noClient{}, Namespace: "default", Lease: "x", Identity: "a",
		LeaseDuration: 3 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: time.Second}
	err := Run(context.Background(), o, func(context.Context, <-chan struct{}) { t.Error("acted") })
	if err == nil || !strings.Contains(err.Error(), "renew deadline (3s)") {
		t.Errorf("Run with a renew deadline as long as the lease = %v", err)
	}
}

// noClient is a client that must not be called: its methods panic.
type noClient struct{ kubeclient.Interface }
