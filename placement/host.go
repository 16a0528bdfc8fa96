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

	// The last reading of the GPUs' usage, when it was asked for, and
	// whether one is under way.
	usage     map[string]gpu.Usage
	usageAt   time.Time
	usageBusy bool
}

// usageKeep is how long a reading of the GPUs' usage is shown before
// another is asked for: a page refreshed every 5 s by several people
// runs nvidia-smi no more often than this.
const usageKeep = 10 * time.Second

// Usage returns the last reading of how busy each GPU is (by UUID), and
// asks for another in the background where it is older than usageKeep:
// a page never waits for nvidia-smi. Nil where no pool needed the GPUs,
// or no reading has come yet.
func (h *Host) Usage() map[string]gpu.Usage {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.inv == nil || len(h.inv.GPUs) == 0 {
		return nil
	}
	if !h.usageBusy && time.Since(h.usageAt) > usageKeep {
		h.usageBusy, h.usageAt = true, time.Now()
		go h.readUsage()
	}
	return h.usage
}

func (h *Host) readUsage() {
	ctx, cancel := context.WithTimeout(context.Background(), gpu.SMITimeout)
	defer cancel()
	u, err := gpu.ReadUsage(ctx, h.NvidiaSMI)
	if err != nil {
		h.log().Debug("could not read the GPUs' usage", "err", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.usageBusy = false
	if err == nil {
		h.usage = u
	}
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
