package leader

import (
	"context"
	"errors"
	"flag"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// The elections run against a real kube-apiserver and etcd (built on first
// use and cached; see internal/testbed/peers).
var (
	kube    *peers.Kube
	kubeErr error
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
	return Options{Client: kube.Client, Namespace: "default", Lease: lease, Identity: id,
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
