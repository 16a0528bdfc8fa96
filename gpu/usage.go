package gpu

import (
	"context"
	"strings"
)

// Usage is how busy one GPU is now, where the driver tells.
type Usage struct {
	// Percent is the time over the driver's last sample period that a
	// kernel ran on the GPU (NVML's utilization.gpu); -1 unknown.
	Percent int `json:"percent"`
	// MemoryUsedMiB is its memory in use; 0 with MemoryKnown false is
	// unknown.
	MemoryUsedMiB uint64 `json:"memory_used_mib"`
	MemoryKnown   bool   `json:"-"`
}

// nvmlUsage reads through NVML; nil unless built with the nvml tag.
var nvmlUsage func(context.Context) (map[string]Usage, error)

// ReadUsage reads how busy each GPU is, by UUID: through NVML when built
// in and smi is "", else from `nvidia-smi -q -x`. A GPU in MIG mode
// reports no utilisation (NVML answers NOT_SUPPORTED): its Percent is -1.
func ReadUsage(ctx context.Context, smi string) (map[string]Usage, error) {
	if smi == "" && nvmlUsage != nil {
		if u, err := nvmlUsage(ctx); err == nil {
			return u, nil
		}
	}
	path := smi
	if path == "" {
		path = "nvidia-smi"
	}
	ctx, cancel := context.WithTimeout(ctx, SMITimeout)
	defer cancel()
	out, err := smiRun(ctx, path, "-q", "-x")
	if err != nil {
		return nil, err
	}
	return ParseUsage(out)
}

// ParseUsage reads the usage of each GPU from `nvidia-smi -q -x`.
func ParseUsage(data []byte) (map[string]Usage, error) {
	l, err := decodeSMI(data)
	if err != nil {
		return nil, err
	}
	out := map[string]Usage{}
	for _, g := range l.GPUs {
		u := Usage{Percent: -1}
		if v := value(g.Util); v != "" {
			u.Percent = atoi(strings.TrimSuffix(v, "%"))
		}
		if v := value(g.MemoryUsed); v != "" {
			u.MemoryUsedMiB, u.MemoryKnown = mib(v), true
		}
		out[value(g.UUID)] = u
	}
	return out, nil
}
