package placement

import (
	"fmt"
	"slices"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
)

// Runners is what each runner of a pool gets and registers with: the
// pool carries it (pool.Config.Runners), and demand matches the pool on
// what its runners may register with (DemandLabels), computed here beside it so
// that the two cannot drift apart.
type Runners struct {
	// Labels are the labels every runner registers with: the pool's,
	// and its provider's hardware labels.
	Labels []string
	// GPUs hands out this host's GPUs, shared by the pools of one
	// host; nil for a pool whose runners get none of the host's.
	GPUs *gpu.Allocator
	// PerRunner is how many GPUs (or MIG devices) each runner gets; -1
	// is all of them.
	PerRunner int
	// CUDA is the newest CUDA version the driver supports, for labels.
	CUDA gpu.Version
	// HardwareLabels adds labels that describe each runner's GPUs
	// ("gpu", "gpu-h200", "gpus-1", "cuda-12.4").
	HardwareLabels bool
	// ShapeGPUs are the GPU counts a dynamic pool's jobs may ask for.
	ShapeGPUs []int
}

// LabelsFor are the labels a runner registers with, given its GPUs and the
// shape it was made for ("" for the pool's own).
func (r Runners) LabelsFor(units []gpu.Unit, shape string) []string {
	var hw []string
	if r.HardwareLabels {
		hw = gpu.Labels(units, r.CUDA)
	}
	return union(r.Labels, hw, dynamic.Labels(shape))
}

// DemandLabels are the labels the pool's runners may register with, for
// matching queued jobs to the pool: every label of every runner that
// LabelsFor makes (a dynamic pool's requests, key=value, aside), and none
// that no runner of the pool gets, since a job matched to a pool whose
// runners lack its labels waits for ever.
func (r Runners) DemandLabels() []string {
	if r.GPUs == nil || !r.HardwareLabels {
		return slices.Clone(r.Labels)
	}
	units := r.GPUs.Units()
	counts := []int{len(units)}
	if r.PerRunner > 0 {
		counts = []int{r.PerRunner}
	}
	for _, n := range r.ShapeGPUs {
		if !slices.Contains(counts, n) {
			counts = append(counts, n)
		}
	}
	// A unit's labels but its count (gpus-1), which the runner's count
	// replaces.
	var hw []string
	for i := range units {
		for _, l := range gpu.Labels(units[i:i+1], r.CUDA) {
			if l != "gpus-1" {
				hw = append(hw, l)
			}
		}
	}
	for _, n := range counts {
		hw = append(hw, fmt.Sprintf("gpus-%d", n))
	}
	return union(r.Labels, hw)
}

// Take takes the GPUs of a runner about to start: the pool's number, or
// what its job asks for (how many, which model). A pool whose runners
// get none of the host's takes none. It fails when not enough are free.
func (r Runners) Take(runner string, req dynamic.Request) ([]gpu.Unit, error) {
	if r.GPUs == nil {
		return nil, nil
	}
	n := r.PerRunner
	if req.GPUs != 0 {
		n = req.GPUs
	}
	return r.GPUs.TakeModel(runner, n, req.GPU)
}

// Release frees the GPUs of a runner that did not start, or is gone.
func (r Runners) Release(runner string) {
	if r.GPUs != nil {
		r.GPUs.Release(runner)
	}
}

// Sync makes the allocator agree with a pool's machines, by runner the
// GPU ids each running machine was given: a running machine holds its
// GPUs (which, after a restart, is how the allocator learns them), and a
// runner of the pool (mine) whose machine is gone frees its GPUs, unless
// an operation on it is in flight (busy). It returns, by runner, the GPUs
// a machine holds that another runner holds or this host lacks, which
// only a second manager on this host's GPUs, or GPUs gone away, can make.
func (r Runners) Sync(running map[string][]string, mine, busy func(runner string) bool) map[string][]string {
	if r.GPUs == nil {
		return nil
	}
	var conflicts map[string][]string
	for name, ids := range running {
		if len(ids) == 0 {
			continue
		}
		if c := r.GPUs.Hold(name, ids); len(c) > 0 {
			if conflicts == nil {
				conflicts = map[string][]string{}
			}
			conflicts[name] = c
		}
	}
	for holder := range r.GPUs.Holders() {
		if _, ok := running[holder]; ok || !mine(holder) || busy(holder) {
			continue
		}
		r.GPUs.Release(holder)
	}
	return conflicts
}
