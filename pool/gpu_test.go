package pool

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/placement"
	"github.com/runfleet/runfleet/provider"
)

func h100s(n int) *gpu.Allocator {
	var units []gpu.Unit
	for i := range n {
		units = append(units, gpu.Unit{ID: fmt.Sprintf("GPU-%d", i), Device: gpu.Device{Index: i, Name: "NVIDIA H100 80GB HBM3"}})
	}
	return gpu.NewAllocator(units)
}

// held maps each live machine to its GPUs, failing on a GPU given twice.
func (h *harness) held() map[string][]string {
	h.t.Helper()
	out := map[string][]string{}
	owner := map[string]string{}
	h.prov.mu.Lock()
	defer h.prov.mu.Unlock()
	for name, in := range h.prov.insts {
		for _, id := range in.GPUs {
			if o, ok := owner[id]; ok {
				h.t.Fatalf("%s is given to %s and %s", id, o, name)
			}
			owner[id] = name
		}
		out[name] = in.GPUs
	}
	return out
}

func TestGPUsOnePerRunnerFreedWhenItEnds(t *testing.T) {
	h := newHarness(t, Config{Size: 6, Runners: placement.Runners{Labels: []string{"gpu"}, GPUs: h100s(4), PerRunner: 1, CUDA: gpu.Version{Major: 12, Minor: 4}, HardwareLabels: true}})
	h.settle()
	held := h.held()
	if len(held) != 4 {
		t.Fatalf("%d runners for 4 GPUs, one each: %v", len(held), held)
	}
	for name, ids := range held {
		if len(ids) != 1 {
			t.Errorf("%s got %v", name, ids)
		}
	}
	r := h.forge.byName("gpu-1")
	if want := []string{"gpu", "gpu-h100", "gpus-1", "cuda-12.4"}; !slices.Equal(r.Labels, want) {
		t.Errorf("labels %v, want %v (the pool's label gpu is not repeated)", r.Labels, want)
	}
	if env := h.prov.specs["gpu-1"].GPUs; len(env) != 1 {
		t.Errorf("spec GPUs %v", env)
	}

	freed := held["gpu-3"][0]
	h.online()
	h.forge.set("gpu-3", forge.StatusBusy)
	h.forge.finish("gpu-3", h.prov)
	h.settle()
	after := h.held()
	if len(after) != 4 || !slices.Equal(after["gpu-3"], []string{freed}) {
		t.Fatalf("after gpu-3 ended: %v; want its replacement to hold the freed %s", after, freed)
	}
}

func TestGPUsTwoPerRunnerAndAll(t *testing.T) {
	h := newHarness(t, Config{Size: 3, Runners: placement.Runners{Labels: []string{"gpu"}, GPUs: h100s(4), PerRunner: 2}})
	h.settle()
	held := h.held()
	if len(held) != 2 || len(held["gpu-1"]) != 2 || len(held["gpu-2"]) != 2 {
		t.Fatalf("held %v, want two runners with a pair each", held)
	}
	if h.forge.byName("gpu-1").Labels[0] != "gpu" || len(h.forge.byName("gpu-1").Labels) != 1 {
		t.Errorf("labels %v: hardware labels are off", h.forge.byName("gpu-1").Labels)
	}

	all := newHarness(t, Config{Size: 2, Runners: placement.Runners{Labels: []string{"gpu"}, GPUs: h100s(4), PerRunner: -1}})
	all.settle()
	if held := all.held(); len(held) != 1 || len(held["gpu-1"]) != 4 {
		t.Fatalf("all: %v", held)
	}
}

func TestGPUsRebuiltAfterRestart(t *testing.T) {
	h := newHarness(t, Config{Size: 3, Runners: placement.Runners{Labels: []string{"gpu"}, GPUs: h100s(4), PerRunner: 1}})
	// Left running by the previous manager: gpu-2 holds GPU-0, and its
	// registration is busy.
	h.prov.add(provider.Instance{Name: "gpu-2", Manager: "m1", Pool: "gpu", State: provider.StateRunning, Created: h.clk.Now(), ID: "x", GPUs: []string{"GPU-0"}})
	h.forge.mu.Lock()
	h.forge.nextID++
	h.forge.runners[h.forge.nextID] = &forge.Runner{ID: h.forge.nextID, Name: "gpu-2", Status: forge.StatusBusy}
	h.forge.mu.Unlock()
	h.settle()
	held := h.held()
	if len(held) != 3 || !slices.Equal(held["gpu-2"], []string{"GPU-0"}) {
		t.Fatalf("held %v", held)
	}
	if h.pool.cfg.Runners.GPUs.Free() != 1 {
		t.Fatalf("free %d, want 1", h.pool.cfg.Runners.GPUs.Free())
	}
}

func TestGPUsSharedByTwoPools(t *testing.T) {
	alloc := h100s(4)
	clk := &clock{t: time.Date(2026, 11, 20, 12, 0, 0, 0, time.UTC)}
	f, prov := newFakeForge(), newFakeProvider(clk.Now)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	a := New(Config{Name: "a", Manager: "m1", Size: 3, Runners: placement.Runners{Labels: []string{"a"}, GPUs: alloc, PerRunner: 1}}, f, prov, fakeAgent{}, WithClock(clk.Now), WithLogger(log))
	b := New(Config{Name: "b", Manager: "m1", Size: 3, Runners: placement.Runners{Labels: []string{"b"}, GPUs: alloc, PerRunner: 1}}, f, prov, fakeAgent{}, WithClock(clk.Now), WithLogger(log))
	for range 4 {
		for _, p := range []*Pool{a, b} {
			if err := p.Reconcile(context.Background()); err != nil {
				t.Fatal(err)
			}
			p.Wait()
		}
	}
	h := &harness{t: t, prov: prov}
	if held := h.held(); len(held) != 4 {
		t.Fatalf("held %v: two pools share 4 GPUs", held)
	}
}

// TestGPUsNeverSharedUnderChurn runs passes while runners take jobs, end,
// crash and fail to start, in random order, and checks after every step
// that no GPU is held by two live machines and that none leaks.
func TestGPUsNeverSharedUnderChurn(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		h := newHarness(t, Config{Size: 3, Max: 5, Runners: placement.Runners{Labels: []string{"gpu"}, GPUs: h100s(5), PerRunner: 1 + int(seed%2)}})
		for step := range 200 {
			switch rng.IntN(6) {
			case 0:
				h.online()
			case 1, 2:
				if names := h.prov.running(); len(names) > 0 {
					n := names[rng.IntN(len(names))]
					h.forge.set(n, forge.StatusBusy)
					if rng.IntN(2) == 0 {
						h.forge.finish(n, h.prov)
					}
				}
			case 3:
				if names := h.prov.running(); len(names) > 0 {
					h.prov.exit(names[rng.IntN(len(names))]) // crashed
				}
			case 4:
				h.prov.mu.Lock()
				h.prov.failNext = fmt.Errorf("engine said no")
				h.prov.mu.Unlock()
			}
			if err := h.pool.Reconcile(context.Background()); err != nil {
				t.Fatal(err)
			}
			if rng.IntN(3) == 0 {
				h.pool.Wait()
			}
			h.held()
			h.clk.Add(time.Duration(rng.Int64N(int64(3 * time.Second))))
			_ = step
		}
		h.pool.Wait()
		h.settle()
		held := h.held()
		n := 0
		for _, ids := range held {
			n += len(ids)
		}
		if free := h.pool.cfg.Runners.GPUs.Free(); free+n != 5 {
			t.Fatalf("seed %d: %d free + %d held != 5: %v, holders %v", seed, free, n, held, h.pool.cfg.Runners.GPUs.Holders())
		}
	}
}
