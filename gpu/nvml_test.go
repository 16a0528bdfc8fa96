//go:build nvml && cgo

package gpu

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// h200 is go-nvml's DGX H200 mock, whose GPUs are in the given
// virtualization modes (none unless given): the mock leaves the call
// unset.
func h200(modes map[int]nvml.GpuVirtualizationMode) *server.Server {
	s := dgxh200.New()
	for i, d := range s.Devices {
		mode := modes[i]
		d.(*server.Device).GetVirtualizationModeFunc = func() (nvml.GpuVirtualizationMode, nvml.Return) { return mode, nvml.SUCCESS }
	}
	return s
}

// GPUs a hypervisor shares with its VMs (Host VGPU) are not handed out,
// and the inventory says why, unless the config opts in.
func TestNVMLHostVGPUSkipped(t *testing.T) {
	inv, err := FromNVML(h200(map[int]nvml.GpuVirtualizationMode{1: nvml.GPU_VIRTUALIZATION_MODE_HOST_VGPU, 2: nvml.GPU_VIRTUALIZATION_MODE_PASSTHROUGH}))
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Units()) != 7 || slices.Contains(IDs(inv.Units()), inv.GPUs[1].UUID) {
		t.Fatalf("units %v, want all but GPU 1", IDs(inv.Units()))
	}
	if why := inv.Skipped[inv.GPUs[1].UUID]; !strings.Contains(why, "Host VGPU") || inv.GPUs[2].Virtualization != "Pass-Through" {
		t.Fatalf("skipped %v, GPU 2 %+v", inv.Skipped, inv.GPUs[2])
	}
	inv.ShareVMGPUs = true
	if len(inv.Units()) != 8 {
		t.Fatalf("units %v with sharing allowed, want 8", IDs(inv.Units()))
	}
}

func TestNVMLDGXH200(t *testing.T) {
	inv, err := FromNVML(h200(nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("source %s, driver %s, CUDA %s, %d GPUs, first %+v", inv.Source, inv.Driver, inv.CUDA, len(inv.GPUs), inv.GPUs[0])
	if inv.Source != "nvml" || inv.Driver != "550.54.15" || inv.CUDA != (Version{12, 4}) || len(inv.GPUs) != 8 {
		t.Fatalf("inventory %+v, want nvml, driver 550.54.15, CUDA 12.4, 8 GPUs", inv)
	}
	seen := map[string]bool{}
	for i, d := range inv.GPUs {
		if d.Index != i || d.Name != "NVIDIA H200 141GB HBM3e" || d.MemoryMiB != 144384 || d.MIG || seen[d.UUID] || d.UUID == "" {
			t.Errorf("GPU %d: %+v", i, d)
		}
		seen[d.UUID] = true
	}
	units := inv.Units()
	if len(units) != 8 || units[3].ID != inv.GPUs[3].UUID {
		t.Fatalf("units %v", IDs(units))
	}
	if got := Labels(units[:1], inv.CUDA); fmt.Sprint(got) != "[gpu gpu-h200 gpus-1 cuda-12.4]" {
		t.Errorf("labels %v", got)
	}
}

// TestNVMLDGXH200MIG puts GPU 0 of the mock in MIG mode with two 1g.18gb
// GPU instances, made through the mock's own MIG calls, and reads them
// back as MIG devices.
func TestNVMLDGXH200MIG(t *testing.T) {
	s := h200(nil)
	dev := s.Devices[0].(*server.Device)
	if ret, _ := dev.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	info, ret := dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	var migs []nvml.Device
	for k := range 2 {
		gi, ret := dev.CreateGpuInstance(&info)
		if ret != nvml.SUCCESS {
			t.Fatal(ret)
		}
		giInfo, _ := gi.GetInfo()
		uuid := fmt.Sprintf("MIG-00000000-0000-5000-8000-00000000000%d", k)
		migs = append(migs, &mock.Device{
			GetUUIDFunc:              func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
			GetGpuInstanceIdFunc:     func() (int, nvml.Return) { return int(giInfo.Id), nvml.SUCCESS },
			GetComputeInstanceIdFunc: func() (int, nvml.Return) { return 0, nvml.SUCCESS },
			GetAttributesFunc: func() (nvml.DeviceAttributes, nvml.Return) {
				return nvml.DeviceAttributes{
					GpuInstanceSliceCount: info.SliceCount, ComputeInstanceSliceCount: info.SliceCount,
					MultiprocessorCount: info.MultiprocessorCount, MemorySizeMB: info.MemorySizeMB,
				}, nvml.SUCCESS
			},
		})
	}
	// The mock leaves MIG device handles to the test; NVML gives up to
	// seven on an H200, with the unused ones not found.
	dev.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	dev.GetMigDeviceHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		if i < len(migs) {
			return migs[i], nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}

	inv, err := FromNVML(s)
	if err != nil {
		t.Fatal(err)
	}
	g := inv.GPUs[0]
	t.Logf("GPU 0: MIG %v, devices %+v", g.MIG, g.MIGDevices)
	if !g.MIG || len(g.MIGDevices) != 2 || g.MIGDevices[1].Profile != "1g.18gb" || g.MIGDevices[1].MemoryMiB != 18432 {
		t.Fatalf("GPU 0 = %+v, want MIG with two 1g.18gb devices", g)
	}
	units := inv.Units()
	if len(units) != 9 || units[0].ID != "MIG-00000000-0000-5000-8000-000000000000" || units[2].ID != inv.GPUs[1].UUID {
		t.Fatalf("units %v, want 2 MIG devices then 7 GPUs", IDs(units))
	}
	if got := Labels(units[:1], inv.CUDA); fmt.Sprint(got) != "[gpu gpu-h200 gpus-1 cuda-12.4 mig mig-1g.18gb]" {
		t.Errorf("labels %v", got)
	}
}

// TestNVMLWithoutDriver loads the real library, which this test machine
// does not have: an empty inventory and ErrNoNVML, which Detect answers by
// asking nvidia-smi.
func TestNVMLWithoutDriver(t *testing.T) {
	inv, err := FromNVML(nvml.New())
	if err == nil && len(inv.GPUs) > 0 {
		t.Skipf("this host has NVIDIA GPUs: %d", len(inv.GPUs))
	}
	if !errors.Is(err, ErrNoNVML) || inv.Reason == "" || len(inv.GPUs) != 0 {
		t.Fatalf("err %v, inventory %+v; want ErrNoNVML with a reason", err, inv)
	}
	t.Logf("reason: %s", inv.Reason)
}
