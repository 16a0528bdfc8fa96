package azure

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/provider"
)

// A dynamic pool's job that asks for GPUs, CPUs or memory gets the
// smallest of the pool's VM sizes that has them, from what the resource
// SKUs of its first location say of each (read once), the GPU model from
// the size's name; with no capacity there, the next that fits; one asking
// for nothing the pool's first size; one that no size fits is refused,
// naming what each has.
func TestJobsChooseTheirVMSize(t *testing.T) {
	p, sim := newProvider(t, subnets("eastus", "westus2")+"vm_sizes: [Standard_NC64as_T4_v3, Standard_NC6s_v3, Standard_D2s_v5, Standard_NC4as_T4_v3]\n")
	for _, c := range []struct {
		name string
		req  dynamic.Request
		want string
	}{
		{"gpu-1", dynamic.Request{GPUs: 1}, "Standard_NC4as_T4_v3"},
		{"gpu-2", dynamic.Request{GPUs: 4}, "Standard_NC64as_T4_v3"},
		{"gpu-3", dynamic.Request{}, "Standard_NC64as_T4_v3"},
		{"gpu-4", dynamic.Request{CPUs: 2, Memory: 4 << 30}, "Standard_D2s_v5"},
		{"gpu-5", dynamic.Request{GPU: "v100"}, "Standard_NC6s_v3"},
		{"gpu-6", dynamic.Request{GPU: "t4", CPUs: 8}, "Standard_NC64as_T4_v3"},
	} {
		s := spec(c.name)
		s.Request = c.req
		inst, err := p.Create(context.Background(), s)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := sizeOfVM(sim, inst.ID); got != c.want {
			t.Errorf("%s asking %+v got %s, want %s", c.name, c.req, got, c.want)
		}
	}
	sim.NoCapacity("Regular", "Standard_NC4as_T4_v3", "")
	s := spec("gpu-7")
	s.Request = dynamic.Request{GPUs: 1}
	inst, err := p.Create(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if got := sizeOfVM(sim, inst.ID); got != "Standard_NC6s_v3" {
		t.Errorf("with no Standard_NC4as_T4_v3 capacity, a 1-GPU job got %s, want Standard_NC6s_v3", got)
	}
	s = spec("gpu-8")
	s.Request = dynamic.Request{GPUs: 8}
	if _, err := p.Create(context.Background(), s); !errors.Is(err, provider.ErrRejected) ||
		!strings.Contains(err.Error(), "it has Standard_NC64as_T4_v3 (64 CPUs, 440g, 4 t4), Standard_NC6s_v3 (6 CPUs, 112g, 1 v100), Standard_D2s_v5 (2 CPUs, 8g)") {
		t.Errorf("8 GPUs: %v", err)
	}
	if n := sim.Calls()["ResourceSKUsClient.NewListPager"]; n != 1 {
		t.Errorf("%d resource SKU lists, want 1", n)
	}
	if err := p.CheckShapes(context.Background(), mustLimits(t, `{"gpus":[1,4,8]}`)); err == nil || !strings.Contains(err.Error(), "a job may ask gpus=8") {
		t.Errorf("CheckShapes of gpus up to 8: %v", err)
	}
	if err := p.CheckShapes(context.Background(), mustLimits(t, `{"gpus":[1,4],"gpu":["t4","v100"]}`)); err != nil {
		t.Errorf("CheckShapes of what the sizes have: %v", err)
	}
	if !slices.Contains(p.Honours(), "gpus") || !slices.Contains(p.Honours(), "mem") {
		t.Errorf("Honours %v", p.Honours())
	}

	// A size the subscription may not deploy in the first location is
	// read in the next; one offered in none is refused, naming it.
	q, qsim := newProvider(t, subnets("eastus", "westus2")+"vm_sizes: [Standard_NC24ads_A100_v4]\n")
	qsim.NoSKU("Standard_NC24ads_A100_v4", "eastus")
	if err := q.CheckShapes(context.Background(), mustLimits(t, `{"gpu":["a100"]}`)); err != nil {
		t.Errorf("an A100 size offered in westus2: %v", err)
	}
	if n := qsim.Calls()["ResourceSKUsClient.NewListPager"]; n != 2 {
		t.Errorf("%d resource SKU lists, want 2 (eastus, then westus2)", n)
	}
	r, rsim := newProvider(t, subnets("eastus")+"vm_sizes: [Standard_NC24ads_A100_v4]\n")
	rsim.NoSKU("Standard_NC24ads_A100_v4", "eastus")
	s = spec("gpu-9")
	s.Request = dynamic.Request{GPUs: 1}
	if _, err := r.Create(context.Background(), s); !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "Azure offers Standard_NC24ads_A100_v4 in none of the locations eastus") {
		t.Errorf("a size offered in no location of the pool: %v", err)
	}
}

func TestGPUOf(t *testing.T) {
	for size, want := range map[string]string{
		"Standard_NC4as_T4_v3": "t4", "Standard_NC24ads_A100_v4": "a100", "Standard_NC40ads_H100_v5": "h100",
		"Standard_ND96isr_H100_v5": "h100", "Standard_NV36ads_A10_v5": "a10", "Standard_NC6s_v3": "v100",
		"Standard_NC24": "k80", "Standard_ND96asr_v4": "a100", "Standard_ND40rs_v2": "v100", "Standard_NC6s_v2": "p100",
		"Standard_D2s_v5": "",
	} {
		if got := gpuOf(size); got != want {
			t.Errorf("gpuOf(%s) = %q, want %q", size, got, want)
		}
	}
}

func sizeOfVM(sim *armsim.Server, name string) string {
	for _, v := range sim.VMs() {
		if v.Name == name {
			return v.Size
		}
	}
	return ""
}

func mustLimits(t *testing.T, raw string) dynamic.Limits {
	t.Helper()
	l, err := dynamic.Decode([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	return l
}
