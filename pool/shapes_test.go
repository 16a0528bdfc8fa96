package pool

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/placement"
	"github.com/runfleet/runfleet/provider"
)

// queue is the demand of a dynamic pool: queued jobs by shape.
type queue struct {
	mu   sync.Mutex
	jobs map[string]int
	hold bool
}

func (q *queue) shapes(took map[string][]int64) map[string]int {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := map[string]int{}
	for s, n := range q.jobs {
		out[s] = max(n-len(took[s]), 0)
	}
	return out
}

func (q *queue) set(shape string, n int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.jobs[shape] = n
}

func dynamicHarness(t *testing.T, q *queue) *harness {
	t.Helper()
	lim, err := dynamic.Decode([]byte(`{"gpus":[1,2],"mem":"8g"}`))
	if err != nil {
		t.Fatal(err)
	}
	return newHarness(t, Config{
		Size: 0, Max: 4, Runners: placement.Runners{Labels: []string{"gpu"}, GPUs: h100s(4), PerRunner: 1}, IdleTimeout: time.Minute,
		Shapes: q.shapes, Resolve: lim.Resolve,
		HoldBack: func([]string, string) (string, bool) {
			q.mu.Lock()
			defer q.mu.Unlock()
			return "job 9", q.hold
		},
	})
}

// TestShapesGetWhatTheyAsk: jobs asking gpus=1 and gpus=2 get runners with
// one and two GPUs of their own and the labels they asked for; a job
// asking for more than the pool allows starts nothing, and the pool says
// why.
func TestShapesGetWhatTheyAsk(t *testing.T) {
	q := &queue{jobs: map[string]int{"gpus=1": 1, "gpus=2,mem=4g": 1, "gpus=4": 1}}
	h := dynamicHarness(t, q)
	h.settle()
	held := h.held()
	if len(held) != 2 {
		t.Fatalf("machines %v, want 2 (gpus=4 refused)", held)
	}
	for name, gpus := range held {
		spec := h.prov.specs[name]
		labels := h.forge.labelsOf(name)
		switch {
		case slices.Contains(labels, "gpus=1"):
			if len(gpus) != 1 || spec.Request.GPUs != 1 {
				t.Errorf("%s (gpus=1) holds %v, request %+v", name, gpus, spec.Request)
			}
		case slices.Contains(labels, "gpus=2") && slices.Contains(labels, "mem=4g"):
			if len(gpus) != 2 || spec.Request.Memory != 4<<30 {
				t.Errorf("%s (gpus=2,mem=4g) holds %v, request %+v", name, gpus, spec.Request)
			}
		default:
			t.Errorf("%s registered with %v", name, labels)
		}
	}
	why := h.pool.Refusals()["gpus=4"]
	if !strings.Contains(why, "gpus=4: the pool allows gpus=1|2") {
		t.Fatalf("refusals %v", h.pool.Refusals())
	}
	// The refused job cancelled: nothing is said of it any more.
	q.set("gpus=4", 0)
	delete(q.jobs, "gpus=4")
	h.settle()
	if len(h.pool.Refusals()) != 0 {
		t.Fatalf("refusals after the job left: %v", h.pool.Refusals())
	}
}

// TestShapeRunnerWaitsForSubsetJob: a runner whose labels a queued job's
// fewer labels match waits until that job is taken.
func TestShapeRunnerWaitsForSubsetJob(t *testing.T) {
	q := &queue{jobs: map[string]int{"gpus=2": 1}, hold: true}
	h := dynamicHarness(t, q)
	h.settle()
	if n := len(h.held()); n != 0 {
		t.Fatalf("%d runners started while a job with fewer labels waited", n)
	}
	q.mu.Lock()
	q.hold = false
	q.mu.Unlock()
	h.clk.Add(time.Second)
	h.settle()
	if n := len(h.held()); n != 1 {
		t.Fatalf("%d runners once the job was taken, want 1", n)
	}
	// Held no longer than holdMax.
	h.online()
	q.set("gpus=1", 1)
	q.mu.Lock()
	q.hold = true
	q.mu.Unlock()
	h.settle()
	if n := len(h.held()); n != 1 {
		t.Fatalf("%d runners, want 1 (gpus=1 held)", n)
	}
	h.clk.Add(holdMax)
	h.settle()
	if n := len(h.held()); n != 2 {
		t.Fatalf("%d runners after holdMax, want 2", n)
	}
}

// TestShapeIdleRunnerRetires: a runner made for a job that another runner
// took goes once idle for the idle timeout; the pool's size of its own
// shape stays.
func TestShapeIdleRunnerRetires(t *testing.T) {
	q := &queue{jobs: map[string]int{"gpus=2": 1}}
	h := dynamicHarness(t, q)
	h.pool.cfg.Size = 1
	h.settle()
	h.online()
	if n := len(h.held()); n != 2 {
		t.Fatalf("%d runners, want 2 (1 of the pool's shape, 1 gpus=2)", n)
	}
	q.set("gpus=2", 0)
	h.clk.Add(time.Second)
	h.settle()
	h.clk.Add(2 * time.Minute)
	h.settle()
	left := h.held()
	if len(left) != 1 {
		t.Fatalf("runners %v, want the pool's own shape only", left)
	}
	for name := range left {
		if slices.ContainsFunc(h.forge.labelsOf(name), func(l string) bool { return strings.Contains(l, "=") }) {
			t.Fatalf("the runner left is %s with %v", name, h.forge.labelsOf(name))
		}
	}
}

// TestShapeThatCannotBePlacedHoldsOnlyItself: a shape whose machine the
// provider refuses (a Slurm gres no node has) or fails to make backs off
// alone, and says why for its jobs, while the pool's other shapes and its
// own keep starting runners; the pool itself is neither halted nor backed
// off.
func TestShapeThatCannotBePlacedHoldsOnlyItself(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		why  string
	}{
		{"refused", fmt.Errorf("sbatch: Requested node configuration is not available: %w", provider.ErrRejected), "Requested node configuration is not available"},
		{"failing", errors.New("image pull failed"), "image pull failed"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			q := &queue{jobs: map[string]int{"gpus=2": 1, "gpus=1": 1}}
			h := dynamicHarness(t, q)
			h.prov.refuse = func(s provider.Spec) error {
				if s.Request.GPUs == 2 {
					return tt.err
				}
				return nil
			}
			h.settle()
			if b := h.pool.Backoff(); b.Halted || b.Failures != 0 {
				t.Fatalf("the pool backs off for one shape: %+v", b)
			}
			if why := h.pool.Refusals()["gpus=2"]; !strings.Contains(why, tt.why) {
				t.Fatalf("refusals %v, want gpus=2's reason", h.pool.Refusals())
			}
			// Another shape's job and the pool's own size start as before.
			h.online()
			q.set("gpus=1", 2)
			h.pool.cfg.Size = 1
			h.clk.Add(time.Second)
			h.settle()
			n := 0
			for name := range h.held() {
				if !slices.Contains(h.forge.labelsOf(name), "gpus=2") {
					n++
				}
			}
			if n != 3 {
				t.Fatalf("%d runners of the other shapes, want 3 (2 gpus=1, 1 of the pool's own): %v", n, h.held())
			}
			// Its jobs gone, nothing is said of the shape any more.
			delete(q.jobs, "gpus=2")
			h.settle()
			if _, ok := h.pool.Refusals()["gpus=2"]; ok {
				t.Fatalf("refusals after its job left: %v", h.pool.Refusals())
			}
		})
	}
}
