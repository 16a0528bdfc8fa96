//go:build nvml && cgo

package gpu

import (
	"context"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func init() {
	nvmlInventory = func(context.Context) (Inventory, error) { return FromNVML(nvml.New()) }
	nvmlUsage = func(context.Context) (map[string]Usage, error) { return UsageFromNVML(nvml.New()) }
}

// UsageFromNVML reads each GPU's utilisation and memory in use through an
// NVML library, by UUID.
func UsageFromNVML(lib nvml.Interface) (map[string]Usage, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML init: %w", ret)
	}
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML device count: %w", ret)
	}
	out := map[string]Usage{}
	for i := range n {
		dev, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d: %w", i, ret)
		}
		uuid, ret := dev.GetUUID()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d uuid: %w", i, ret)
		}
		u := Usage{Percent: -1}
		// ERROR_NOT_SUPPORTED in MIG mode.
		if r, ret := dev.GetUtilizationRates(); ret == nvml.SUCCESS {
			u.Percent = int(r.Gpu)
		}
		if m, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			u.MemoryUsedMiB, u.MemoryKnown = m.Used>>20, true
		}
		out[uuid] = u
	}
	return out, nil
}

// FromNVML reads the inventory through an NVML library (the host's, or a
// mock). Without the library (no driver) the inventory is empty and
// Reason says so, with ErrNoNVML.
func FromNVML(lib nvml.Interface) (Inventory, error) {
	inv := Inventory{Source: "nvml"}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		inv.Reason = "NVML: " + ret.Error()
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			inv.Reason = "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver on this host"
			return inv, ErrNoNVML
		}
		return inv, fmt.Errorf("NVML init: %w", ret)
	}
	defer lib.Shutdown()
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		inv.Driver = v
	}
	if v, ret := lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS {
		// 12040 is 12.4.
		inv.CUDA = Version{v / 1000, v % 1000 / 10}
	}
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return inv, fmt.Errorf("NVML device count: %w", ret)
	}
	for i := range n {
		dev, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return inv, fmt.Errorf("NVML device %d: %w", i, ret)
		}
		d := Device{Index: i}
		if d.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
			return inv, fmt.Errorf("NVML device %d uuid: %w", i, ret)
		}
		d.Name, _ = dev.GetName()
		if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			d.MemoryMiB = mem.Total >> 20
		}
		if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			d.PCIBusID = cstr(pci.BusIdLegacy[:])
			if id := cstr(pci.BusId[:]); id != "" {
				d.PCIBusID = id
			}
		}
		// ERROR_NOT_SUPPORTED on GPUs without MIG.
		if cur, _, ret := dev.GetMigMode(); ret == nvml.SUCCESS && cur == nvml.DEVICE_MIG_ENABLE {
			d.MIG = true
			if d.MIGDevices, ret = migDevices(dev); ret != nvml.SUCCESS {
				return inv, fmt.Errorf("NVML device %d MIG devices: %w", i, ret)
			}
		}
		// ERROR_NOT_SUPPORTED where the GPU cannot be virtualised.
		if mode, ret := dev.GetVirtualizationMode(); ret == nvml.SUCCESS {
			d.Virtualization = virtModes[mode]
		}
		inv.GPUs = append(inv.GPUs, d)
	}
	inv.skip()
	if len(inv.GPUs) == 0 {
		inv.Reason = "NVML reports no GPU"
	}
	return inv, nil
}

// virtModes names NVML's virtualization modes as nvidia-smi does; None
// is no mode.
var virtModes = map[nvml.GpuVirtualizationMode]string{
	nvml.GPU_VIRTUALIZATION_MODE_PASSTHROUGH: "Pass-Through",
	nvml.GPU_VIRTUALIZATION_MODE_VGPU:        "VGPU",
	nvml.GPU_VIRTUALIZATION_MODE_HOST_VGPU:   "Host VGPU",
	nvml.GPU_VIRTUALIZATION_MODE_HOST_VSGA:   "Host VSGA",
}

func migDevices(dev nvml.Device) ([]MIGDevice, nvml.Return) {
	count, ret := dev.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	var out []MIGDevice
	for j := range count {
		mig, ret := dev.GetMigDeviceHandleByIndex(j)
		if ret == nvml.ERROR_NOT_FOUND {
			continue // a free slot
		}
		if ret != nvml.SUCCESS {
			return nil, ret
		}
		m := MIGDevice{Index: j}
		m.UUID, _ = mig.GetUUID()
		m.GPUInstanceID, _ = mig.GetGpuInstanceId()
		m.ComputeInstanceID, _ = mig.GetComputeInstanceId()
		if a, ret := mig.GetAttributes(); ret == nvml.SUCCESS {
			m.MemoryMiB = a.MemorySizeMB
			m.Profile = migProfile(int(a.GpuInstanceSliceCount), int(a.ComputeInstanceSliceCount), a.MemorySizeMB)
		}
		out = append(out, m)
	}
	return out, nvml.SUCCESS
}

// migProfile names a MIG device as nvidia-smi does: "1g.10gb", or
// "1c.3g.40gb" for a compute instance smaller than its GPU instance.
// Memory is rounded up to whole GB, as NVIDIA's profile names are.
func migProfile(gi, ci int, memMiB uint64) string {
	if gi == 0 {
		return ""
	}
	p := fmt.Sprintf("%dg.%dgb", gi, (memMiB+1023)/1024)
	if ci > 0 && ci < gi {
		p = fmt.Sprintf("%dc.%s", ci, p)
	}
	return p
}

func cstr[T int8 | uint8](b []T) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
