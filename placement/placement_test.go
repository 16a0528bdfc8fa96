package placement

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
)

// fakeProvider is a provider with traits, hardware labels and honoured
// keys; its other methods are never called here.
type fakeProvider struct {
	provider.Provider
	traits  provider.Traits
	labels  []string
	honours []string
}

func (p fakeProvider) Traits() provider.Traits { return p.traits }

type labeled struct{ fakeProvider }

func (p labeled) HardwareLabels() []string { return p.labels }

type shaper struct{ fakeProvider }

func (p shaper) Honours() []string { return p.honours }

var (
	docker = fakeProvider{traits: provider.Traits{HostGPUs: true}}
	slurm  = labeled{fakeProvider{traits: provider.Traits{SchedulesGPUs: true}, labels: []string{"gpu", "gpu-a100", "gpus-1"}}}
)

// hostOf is a host whose GPUs were read: those units, CUDA 12.4.
func hostOf(units ...gpu.Unit) *Host {
	h := &Host{Log: slog.New(slog.DiscardHandler)}
	h.inv = &gpu.Inventory{CUDA: gpu.Version{Major: 12, Minor: 4}, Driver: "550.54.15"}
	h.alloc = gpu.NewAllocator(units)
	return h
}

func gpus(model string, n int) []gpu.Unit {
	var out []gpu.Unit
	for i := range n {
		out = append(out, gpu.Unit{ID: fmt.Sprintf("GPU-%s-%d", model, i), Device: gpu.Device{Index: i, Name: "NVIDIA " + model}})
	}
	return out
}

func migs(n int) []gpu.Unit {
	var out []gpu.Unit
	for i := range n {
		out = append(out, gpu.Unit{ID: fmt.Sprintf("MIG-%d", i), Device: gpu.Device{Index: 0, Name: "NVIDIA A100-SXM4-80GB"}, MIG: &gpu.MIGDevice{Index: i, Profile: "1g.10gb"}})
	}
	return out
}

// Every label a runner of a pool registers with is among those demand
// matches the pool on, and every one of those is on some runner the pool
// can make: a job matched to the pool has a runner that can take it.
func TestLabelsCover(t *testing.T) {
	mixed := append(gpus("H100 80GB HBM3", 2), gpus("A100-SXM4-80GB", 2)...)
	tests := []struct {
		name   string
		host   *Host
		want   Want
		prov   provider.Provider
		shapes []string
	}{
		{name: "one each", host: hostOf(gpus("H100 80GB HBM3", 4)...), want: Want{Labels: []string{"linux"}, GPUsPerRunner: 1, HardwareLabels: true, Size: 4, Max: 4}, prov: docker},
		{name: "pairs", host: hostOf(gpus("H100 80GB HBM3", 4)...), want: Want{Labels: []string{"linux"}, GPUsPerRunner: 2, HardwareLabels: true, Size: 2, Max: 2}, prov: docker},
		{name: "all", host: hostOf(gpus("H200 141GB HBM3e", 8)...), want: Want{GPUsPerRunner: -1, HardwareLabels: true, Size: 1, Max: 1}, prov: docker},
		{name: "mixed models", host: hostOf(mixed...), want: Want{GPUsPerRunner: 1, HardwareLabels: true, Size: 4, Max: 4}, prov: docker},
		{name: "mig", host: hostOf(migs(3)...), want: Want{GPUsPerRunner: 1, HardwareLabels: true, Size: 3, Max: 3}, prov: docker},
		{name: "no hardware labels", host: hostOf(gpus("H100 80GB HBM3", 2)...), want: Want{Labels: []string{"gpu"}, GPUsPerRunner: 1, Size: 2, Max: 2}, prov: docker},
		{name: "cpu only", host: &Host{}, want: Want{Labels: []string{"cpu"}, Size: 2, Max: 2}, prov: docker},
		{name: "slurm", host: hostOf(gpus("H100 80GB HBM3", 4)...), want: Want{Labels: []string{"hpc"}, GPUsPerRunner: 1, HardwareLabels: true, Max: 2}, prov: slurm},
		{name: "dynamic", host: hostOf(mixed...), prov: docker,
			want:   Want{GPUsPerRunner: 1, HardwareLabels: true, Max: 4, Dynamic: &dynamic.Limits{GPUs: []int{1, 2}, GPU: []string{"h100", "a100"}}},
			shapes: []string{"gpus=2", "gpu=a100", "gpu=h100,gpus=2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			plan, err := For(tt.host, tt.want, tt.prov)
			if err != nil {
				t.Fatal(err)
			}
			r := plan.Runners
			matched := r.DemandLabels()
			seen := map[string]bool{}
			for _, shape := range append([]string{""}, tt.shapes...) {
				req, err := resolve(tt.want.Dynamic, shape)
				if err != nil {
					t.Fatal(err)
				}
				// Runners of this shape until the GPUs run out.
				for i := range plan.Max + 1 {
					name := fmt.Sprintf("r-%d", i)
					units, err := r.Take(name, req)
					if err != nil {
						break
					}
					plain, _ := dynamic.Split(r.LabelsFor(units, shape))
					for _, l := range plain {
						seen[l] = true
						if !slices.Contains(matched, l) {
							t.Errorf("shape %q: a runner with %v registers with %q, which demand does not match the pool on (%v)", shape, gpu.IDs(units), l, matched)
						}
					}
				}
				if r.GPUs != nil {
					for runner := range r.GPUs.Holders() {
						r.Release(runner)
					}
				}
			}
			for _, l := range matched {
				if !seen[l] {
					t.Errorf("demand matches the pool on %q, which none of its runners registers with", l)
				}
			}
		})
	}
}

func resolve(l *dynamic.Limits, shape string) (dynamic.Request, error) {
	if shape == "" || l == nil {
		return dynamic.Request{}, nil
	}
	if err := l.Check(); err != nil {
		return dynamic.Request{}, err
	}
	return l.Resolve(shape)
}

func TestFor(t *testing.T) {
	h100 := hostOf(gpus("H100 80GB HBM3", 4)...)
	tests := []struct {
		name      string
		host      *Host
		want      Want
		prov      provider.Provider
		size, max int
		per       int
		err       string
	}{
		{name: "sized by GPUs", host: h100, want: Want{GPUsPerRunner: 1, SizeFromGPUs: true}, prov: docker, size: 4, max: 4, per: 1},
		{name: "pairs, max above", host: h100, want: Want{GPUsPerRunner: 2, SizeFromGPUs: true, Max: 6}, prov: docker, size: 2, max: 6, per: 2},
		{name: "all", host: h100, want: Want{GPUsPerRunner: -1, SizeFromGPUs: true}, prov: docker, size: 1, max: 1, per: -1},
		{name: "size given", host: h100, want: Want{GPUsPerRunner: 1, Size: 2, Max: 2}, prov: docker, size: 2, max: 2, per: 1},
		{name: "more than the host has", host: h100, want: Want{GPUsPerRunner: 5, SizeFromGPUs: true}, prov: docker, err: "gpus_per_runner: 5, and this host has 4 GPUs"},
		{name: "no GPU", host: hostOf(), want: Want{GPUsPerRunner: -1, SizeFromGPUs: true}, prov: docker, err: "gpus_per_runner: all, and this host has no GPU"},
		{name: "provider without host GPUs", host: h100, want: Want{Provider: "aws", GPUsPerRunner: 1, SizeFromGPUs: true}, prov: fakeProvider{}, err: "gpus_per_runner: provider aws cannot give runners this host's GPUs"},
		{name: "slurm sized by GPUs", host: h100, want: Want{GPUsPerRunner: 1, SizeFromGPUs: true, Max: 4}, prov: slurm, size: 0, max: 4},
		{name: "slurm without max", host: h100, want: Want{Provider: "slurm", GPUsPerRunner: 1, SizeFromGPUs: true}, prov: slurm, err: "max: not given, and provider slurm gives runners GPUs of its own nodes"},
		{name: "dynamic key not honoured", host: h100, want: Want{Provider: "process", GPUsPerRunner: 1, Max: 2, Dynamic: &dynamic.Limits{GPUs: []int{1}, Mem: "8g"}}, prov: docker,
			err: "dynamic.mem: provider process cannot give a runner what a job asks for in mem= (it can: gpus, gpu)"},
		{name: "dynamic honoured", host: h100, want: Want{GPUsPerRunner: 1, Max: 2, Dynamic: &dynamic.Limits{GPUs: []int{1, 2}, Mem: "8g"}},
			prov: shaper{fakeProvider{traits: provider.Traits{HostGPUs: true}, honours: []string{dynamic.KeyMem}}}, size: 0, max: 2, per: 1},
		{name: "dynamic on a provider that honours nothing", host: h100, want: Want{Provider: "x", Max: 2, Dynamic: &dynamic.Limits{CPU: 4}}, prov: fakeProvider{},
			err: "dynamic.cpu: provider x cannot give a runner what a job asks for in cpu= (it can: none)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			plan, err := For(tt.host, tt.want, tt.prov)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if plan.Size != tt.size || plan.Max != tt.max || plan.Runners.PerRunner != tt.per {
				t.Errorf("size %d max %d per runner %d, want %d %d %d", plan.Size, plan.Max, plan.Runners.PerRunner, tt.size, tt.max, tt.per)
			}
		})
	}
}

// A pool whose runners get none of this host's GPUs neither reads them
// nor carries their labels, whoever else read them.
func TestClusterGPUsAreNotTheHosts(t *testing.T) {
	h := hostOf(gpus("H100 80GB HBM3", 4)...)
	host, err := For(h, Want{Labels: []string{"local"}, GPUsPerRunner: 1, SizeFromGPUs: true, HardwareLabels: true}, docker)
	if err != nil {
		t.Fatal(err)
	}
	cluster, err := For(h, Want{Labels: []string{"hpc"}, GPUsPerRunner: 1, SizeFromGPUs: true, Max: 3, HardwareLabels: true}, slurm)
	if err != nil {
		t.Fatal(err)
	}
	if got := cluster.Runners.DemandLabels(); slices.Contains(got, "gpu-h100") || !slices.Contains(got, "gpu-a100") {
		t.Errorf("the Slurm pool is matched on %v: its nodes' labels, not this host's", got)
	}
	if !slices.Contains(host.Runners.DemandLabels(), "gpu-h100") {
		t.Errorf("the host's pool is matched on %v", host.Runners.DemandLabels())
	}
	if units, err := cluster.Runners.Take("hpc-1", dynamic.Request{}); err != nil || units != nil {
		t.Errorf("a Slurm runner took %v of this host's GPUs (%v)", units, err)
	}
}

// A host is read once, and only when a pool needs its GPUs.
func TestHostReadOnce(t *testing.T) {
	h := &Host{NvidiaSMI: "/nonexistent/nvidia-smi", Log: slog.New(slog.DiscardHandler)}
	if _, err := For(h, Want{Labels: []string{"cpu"}, Size: 1, Max: 1}, docker); err != nil {
		t.Fatal(err)
	}
	if inv, alloc := h.Read(); inv != nil || alloc != nil {
		t.Fatalf("a CPU-only pool read the GPUs: %+v", inv)
	}
	_ = h.GPUs()
	inv, alloc := h.Read()
	if inv == nil || alloc == nil {
		t.Fatal("GPUs not read")
	}
	_ = h.GPUs()
	if again, againAlloc := h.Read(); again != inv || againAlloc != alloc {
		t.Error("the host was read twice")
	}
}
