package placement

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/runfleet/runfleet/gpu"
)

// detectWait bounds the one read of the host's GPUs (nvidia-smi or NVML).
const detectWait = time.Minute

// Host is this host's GPUs, read once, when a pool first needs them (its
// runners get GPUs of their own, or its provider picks an image by CUDA
// version), so that a CPU-only configuration never runs nvidia-smi; and
// the allocator that hands them to the runners of every pool.
type Host struct {
	// NvidiaSMI is the nvidia-smi to run ("" finds it in PATH).
	NvidiaSMI string
	// ShareVMGPUs hands out GPUs that a virtual machine shares with the
	// host (the config's gpu.allow_host_vgpu).
	ShareVMGPUs bool
	Log         *slog.Logger

	mu    sync.Mutex
	inv   *gpu.Inventory
	alloc *gpu.Allocator
}

// GPUs returns the host's GPUs, read on the first call.
func (h *Host) GPUs() gpu.Inventory {
	inv, _ := h.detect()
	return inv
}

// Read returns what was read of the host's GPUs, and their allocator;
// nil for both where no pool needed them.
func (h *Host) Read() (*gpu.Inventory, *gpu.Allocator) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.inv, h.alloc
}

func (h *Host) detect() (gpu.Inventory, *gpu.Allocator) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.inv != nil {
		return *h.inv, h.alloc
	}
	ctx, cancel := context.WithTimeout(context.Background(), detectWait)
	defer cancel()
	inv := gpu.Detect(ctx, h.NvidiaSMI)
	inv.ShareVMGPUs = h.ShareVMGPUs
	h.inv, h.alloc = &inv, gpu.NewAllocator(inv.Units())
	h.report(inv)
	return inv, h.alloc
}

func (h *Host) report(inv gpu.Inventory) {
	log := h.log()
	for id, why := range inv.Skipped {
		if !inv.ShareVMGPUs {
			log.Warn("GPU not handed out", "gpu", id, "why", why)
		}
	}
	switch {
	case inv.Error != "":
		log.Error("could not read this host's GPUs", "err", inv.Error, "source", inv.Source)
	case len(inv.GPUs) == 0:
		log.Warn("no GPU found", "reason", inv.Reason, "source", inv.Source)
	default:
		log.Info("GPUs found", "gpus", len(inv.GPUs), "units", h.alloc.Len(), "driver", inv.Driver, "cuda", inv.CUDA, "source", inv.Source)
	}
}

func (h *Host) log() *slog.Logger {
	if h.Log == nil {
		return slog.Default()
	}
	return h.Log
}
