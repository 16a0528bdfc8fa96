package pool

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/placement"
)

func TestDemandGrowsPoolAndIdleShrinksIt(t *testing.T) {
	var queued atomic.Int64
	h := newHarness(t, Config{Size: 0, Max: 4, IdleTimeout: time.Minute, Demand: func([]int64) int { return int(queued.Load()) }})
	h.settle()
	if n := len(h.prov.running()); n != 0 {
		t.Fatalf("%d runners with no demand and size 0", n)
	}
	queued.Store(6)
	h.settle()
	if n := len(h.prov.running()); n != 4 {
		t.Fatalf("%d runners for 6 queued jobs with max 4", n)
	}
	// Two take jobs; the rest of the queue is served elsewhere.
	h.online()
	h.forge.set("gpu-1", forge.StatusBusy)
	h.forge.set("gpu-2", forge.StatusBusy)
	queued.Store(0)
	h.settle()
	if n := len(h.prov.running()); n != 4 {
		t.Fatalf("idle runners removed before idle_timeout: %d left", n)
	}
	h.clk.Add(2 * time.Minute)
	h.settle()
	if got := sorted(h.prov.running()); fmt.Sprint(got) != "[gpu-1 gpu-2]" {
		t.Fatalf("after idle_timeout: %v, want only the two busy runners", got)
	}
	h.forge.finish("gpu-1", h.prov)
	h.forge.finish("gpu-2", h.prov)
	h.settle()
	if n := len(h.prov.running()); n != 0 {
		t.Fatalf("%d runners left at size 0 with no demand", n)
	}
}

// raceForge is an in-memory forge whose jobs are taken by idle runners at
// random moments, as agents polling a real forge do, concurrently with the
// pool's passes. Assignment and removal are atomic under one lock, as at
// a forge: a runner that took a job cannot be removed.
type raceForge struct {
	*fakeForge
	prov *fakeProvider
	// machines deleted while their runner ran a job: must stay zero.
	violations atomic.Int64
	jobs       atomic.Int64
}

func (f *raceForge) assign(rng *rand.Rand) {
	running := map[string]bool{}
	for _, n := range f.prov.running() {
		running[n] = true
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var idle []*forge.Runner
	for _, r := range f.runners {
		if r.Status == forge.StatusIdle && running[r.Name] {
			idle = append(idle, r)
		}
	}
	if len(idle) > 0 {
		idle[rng.IntN(len(idle))].Status = forge.StatusBusy
		f.jobs.Add(1)
	}
}

func (f *raceForge) busy(name string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.runners {
		if r.Name == name && r.Status == forge.StatusBusy {
			return true
		}
	}
	return false
}

// checkingProvider fails the test's count when a machine is deleted while
// its runner runs a job.
type checkingProvider struct {
	*fakeProvider
	f *raceForge
}

func (p checkingProvider) Delete(ctx context.Context, name string) error {
	if p.f.busy(name) {
		p.f.violations.Add(1)
	}
	return p.fakeProvider.Delete(ctx, name)
}

// TestScaleDownNeverRemovesBusyRunner runs 1,000 randomized interleavings
// of scale-down (demand that rises and falls, an idle timeout of zero)
// with job assignment (idle runners taking jobs at random moments, in a
// goroutine of their own) and job completion, and counts machines deleted
// while their runner ran a job.
func TestScaleDownNeverRemovesBusyRunner(t *testing.T) {
	const runs = 1000
	var jobs, removed int64
	for seed := range uint64(runs) {
		rng := rand.New(rand.NewPCG(seed, 42))
		clk := &clock{t: time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)}
		fp := newFakeProvider(clk.Now)
		rf := &raceForge{fakeForge: newFakeForge(), prov: fp}
		var demand atomic.Int64
		p := New(Config{
			Name: "gpu", Manager: "m1", Runners: placement.Runners{Labels: []string{"gpu"}}, Size: rng.IntN(2), Max: 2 + rng.IntN(4),
			IdleTimeout: 0, BootstrapTimeout: time.Hour, OrphanGrace: time.Hour,
			Demand: func([]int64) int { return int(demand.Load()) },
		}, rf, checkingProvider{fp, rf}, fakeAgent{}, WithClock(clk.Now), WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))

		var wg sync.WaitGroup
		stop := make(chan struct{})
		// Agents: come online, take jobs, finish them.
		wg.Go(func() {
			r := rand.New(rand.NewPCG(seed, 7))
			for {
				select {
				case <-stop:
					return
				default:
				}
				switch r.IntN(4) {
				case 0:
					rf.mu.Lock()
					for _, x := range rf.runners {
						if x.Status == forge.StatusOffline {
							x.Status = forge.StatusIdle
						}
					}
					rf.mu.Unlock()
				case 1, 2:
					rf.assign(r)
				case 3:
					rf.mu.Lock()
					var busy []string
					for _, x := range rf.runners {
						if x.Status == forge.StatusBusy {
							busy = append(busy, x.Name)
						}
					}
					rf.mu.Unlock()
					if len(busy) > 0 {
						rf.finish(busy[r.IntN(len(busy))], fp)
					}
				}
				if r.IntN(3) == 0 {
					time.Sleep(time.Duration(r.IntN(50)) * time.Microsecond)
				}
			}
		})
		// The pool: passes while demand rises and falls.
		for range 30 {
			demand.Store(int64(rng.IntN(6)))
			if err := p.Reconcile(context.Background()); err != nil {
				t.Fatal(err)
			}
			if rng.IntN(2) == 0 {
				p.Wait()
			}
			clk.Add(time.Duration(rng.IntN(3)) * time.Second)
		}
		close(stop)
		wg.Wait()
		p.Wait()
		jobs += rf.jobs.Load()
		removed += int64(len(fp.deleted))
		if v := rf.violations.Load(); v != 0 {
			t.Fatalf("seed %d: %d machines deleted while their runner ran a job", seed, v)
		}
	}
	t.Logf("%d interleavings: %d jobs assigned, %d machines removed, 0 busy runners removed", runs, jobs, removed)
}

// TestTookJobOutlivesItsJob: a runner that takes a queued job and finishes
// it before the forge reports the job leaving the queue (Gitea's webhooks
// lag behind one-second jobs) still accounts for that job, so the pool
// only refills to its size and starts no runner for a job already run.
func TestTookJobOutlivesItsJob(t *testing.T) {
	var queued atomic.Int64 // what the forge has reported: never updated here
	h := newHarness(t, Config{Size: 1, Max: 4, Demand: func(took []int64) int { return int(queued.Load()) - len(took) }})
	h.settle()
	h.online()
	h.settle()
	// gpu-1 takes the job as it is queued.
	queued.Store(1)
	h.forge.set("gpu-1", forge.StatusBusy)
	h.settle()
	h.online()
	if got := sorted(h.prov.running()); fmt.Sprint(got) != "[gpu-1 gpu-2]" {
		t.Fatalf("with gpu-1 busy: %v, want gpu-1 and one idle runner", got)
	}
	// Its job ends before the forge's report of the job arrives.
	h.forge.finish("gpu-1", h.prov)
	h.settle()
	if got := sorted(h.prov.running()); fmt.Sprint(got) != "[gpu-2]" {
		t.Fatalf("after gpu-1's job ended unreported: %v, want only gpu-2 (the job was run)", got)
	}
	// Past the window the report is taken as lost no more: the queue
	// counts again.
	h.clk.Add(2 * time.Minute)
	h.settle()
	if n := len(h.prov.running()); n != 2 {
		t.Fatalf("%d runners after the window with a job still reported queued, want 2", n)
	}
}
