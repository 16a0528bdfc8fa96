package gcp_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/provider"
)

// A dynamic pool's job that asks for GPUs, CPUs or memory gets the
// smallest of the pool's machine types that has them, from what Compute
// Engine says of each (machineTypes.get, read once per type, in the first
// zone that offers it); with no capacity there, the next that fits; one
// asking for nothing the pool's first type; one that no type fits is
// refused, naming what each has. An N1 type has the pool's accelerator,
// and a type with GPUs of its own is given no other.
func TestJobsChooseTheirMachineType(t *testing.T) {
	p, sim := newProvider(t, "zones: [us-east1-c, us-central1-a]\nmachine_types: [g2-standard-48, n1-standard-8, custom-2-4096, a2-highgpu-1g, g2-standard-4]\naccelerator: {type: nvidia-tesla-t4}\n")
	for _, c := range []struct {
		name       string
		req        dynamic.Request
		want, zone string
		accel      int
	}{
		{"gpu-1", dynamic.Request{GPUs: 1}, "custom-2-4096", "us-east1-c", 1},
		{"gpu-2", dynamic.Request{GPUs: 4}, "g2-standard-48", "us-east1-c", 0},
		{"gpu-3", dynamic.Request{}, "g2-standard-48", "us-east1-c", 0},
		{"gpu-4", dynamic.Request{CPUs: 2, Memory: 4 << 30}, "custom-2-4096", "us-east1-c", 1},
		{"gpu-5", dynamic.Request{GPU: "l4"}, "g2-standard-4", "us-east1-c", 0},
		{"gpu-6", dynamic.Request{GPU: "t4", CPUs: 6}, "n1-standard-8", "us-east1-c", 1},
		// Not offered in us-east1-c: refused there, made in the next zone.
		{"gpu-7", dynamic.Request{GPU: "a100"}, "a2-highgpu-1g", "us-central1-a", 0},
	} {
		s := spec(c.name)
		s.Request = c.req
		inst, err := p.Create(context.Background(), s)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := instanceOf(sim, inst.ID); got.Type != c.want || got.Zone != c.zone || got.Accelerators != c.accel {
			t.Errorf("%s asking %+v got %s in %s with %d accelerators, want %s in %s with %d", c.name, c.req, got.Type, got.Zone, got.Accelerators, c.want, c.zone, c.accel)
		}
	}
	sim.NoCapacity("STANDARD", "g2-standard-4", "")
	s := spec("gpu-8")
	s.Request = dynamic.Request{GPU: "l4"}
	inst, err := p.Create(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if got := instanceOf(sim, inst.ID).Type; got != "g2-standard-48" {
		t.Errorf("with no g2-standard-4 capacity, an l4 job got %s, want g2-standard-48", got)
	}
	s = spec("gpu-9")
	s.Request = dynamic.Request{GPUs: 8}
	if _, err := p.Create(context.Background(), s); !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "it has g2-standard-48 (48 CPUs, 192g, 4 l4), n1-standard-8 (8 CPUs, 30g, 1 t4), custom-2-4096 (2 CPUs, 4g, 1 t4), a2-highgpu-1g (12 CPUs, 85g, 1 a100)") {
		t.Errorf("8 GPUs: %v", err)
	}
	// us-east1-c offers no A100 (the stand-in's gpuZones): asked there
	// first, then in us-central1-a; custom types are read from their name.
	if n := sim.Calls()["machineTypes.get"]; n != 5 {
		t.Errorf("%d machineTypes.get calls, want 5 (each of 4 types once, one of them in a second zone)", n)
	}
	if err := p.CheckShapes(context.Background(), mustLimits(t, `{"gpus":[1,4,8]}`)); err == nil || !strings.Contains(err.Error(), "a job may ask gpus=8") {
		t.Errorf("CheckShapes of gpus up to 8: %v", err)
	}
	if err := p.CheckShapes(context.Background(), mustLimits(t, `{"gpus":[1,4],"gpu":["t4","l4","a100"]}`)); err != nil {
		t.Errorf("CheckShapes of what the types have: %v", err)
	}
	if !slices.Contains(p.Honours(), "gpus") || !slices.Contains(p.Honours(), "mem") {
		t.Errorf("Honours %v", p.Honours())
	}
	// A type no zone of the pool offers is refused, naming it.
	q, _ := newProvider(t, "zones: [us-east1-c]\nmachine_types: [a2-highgpu-1g]\n")
	s = spec("gpu-10")
	s.Request = dynamic.Request{GPUs: 1}
	if _, err := q.Create(context.Background(), s); !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "machine type a2-highgpu-1g is offered in none of the zones us-east1-c") {
		t.Errorf("a type offered in no zone of the pool: %v", err)
	}
}

func instanceOf(sim *gcesim.Server, name string) gcesim.Instance {
	for _, in := range sim.Instances() {
		if in.Name == name {
			return in
		}
	}
	return gcesim.Instance{}
}

func mustLimits(t *testing.T, raw string) dynamic.Limits {
	t.Helper()
	l, err := dynamic.Decode([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	return l
}
