package gpu

import (
	"context"
	"errors"
)

// ErrNoNVML is returned by the NVML reader when the host has no NVML
// library: no NVIDIA driver is installed.
var ErrNoNVML = errors.New("NVML library not found")

// nvmlInventory reads through NVML; nil unless built with the nvml tag.
var nvmlInventory func(context.Context) (Inventory, error)

// NVMLBuilt reports whether this binary reads GPUs through NVML.
func NVMLBuilt() bool { return nvmlInventory != nil }

// Detect reads this host's inventory: through NVML when built in and the
// library loads, else through nvidia-smi. smi names the nvidia-smi binary;
// when set, it is used directly, NVML is not tried. Detect never fails: a
// host it cannot read has an empty inventory, and Reason says why.
func Detect(ctx context.Context, smi string) Inventory {
	var why error
	if smi == "" && nvmlInventory != nil {
		inv, err := nvmlInventory(ctx)
		if err == nil {
			return inv
		}
		why = err
	}
	inv, err := SMI{Path: smi}.Inventory(ctx)
	if err == nil && len(inv.GPUs) == 0 && why != nil && !errors.Is(why, ErrNoNVML) {
		inv.Reason = why.Error() + "; " + inv.Reason
	}
	return inv
}
