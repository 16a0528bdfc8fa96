// Package gpu finds the NVIDIA GPUs of the host runfleet runs on, gives
// each runner its own, describes them as runner labels, and picks a runner
// image the driver can run.
//
// The inventory comes from NVML when runfleet is built with the nvml tag
// (and cgo), and otherwise from `nvidia-smi -q -x`. A host without a GPU,
// or without a driver, has an empty inventory and a reason: it never stops
// a CPU-only pool.
package gpu

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// Version is a CUDA version, major.minor.
type Version struct{ Major, Minor int }

// ParseVersion reads "12.4" (or "12.4.1", whose patch is ignored).
func ParseVersion(s string) (Version, error) {
	s = strings.TrimSpace(s)
	parts := strings.Split(s, ".")
	if len(parts) < 2 || len(parts) > 3 {
		return Version{}, fmt.Errorf("CUDA version %q is not major.minor", s)
	}
	var v Version
	var err error
	if v.Major, err = strconv.Atoi(parts[0]); err != nil || v.Major < 0 {
		return Version{}, fmt.Errorf("CUDA version %q is not major.minor", s)
	}
	if v.Minor, err = strconv.Atoi(parts[1]); err != nil || v.Minor < 0 {
		return Version{}, fmt.Errorf("CUDA version %q is not major.minor", s)
	}
	return v, nil
}

// IsZero reports whether the version is unknown.
func (v Version) IsZero() bool { return v == Version{} }

func (v Version) String() string {
	if v.IsZero() {
		return ""
	}
	return fmt.Sprintf("%d.%d", v.Major, v.Minor)
}

// Compare returns -1, 0 or 1 as v is older than, equal to or newer than w.
func (v Version) Compare(w Version) int {
	if c := cmp.Compare(v.Major, w.Major); c != 0 {
		return c
	}
	return cmp.Compare(v.Minor, w.Minor)
}

// MarshalText writes "12.4", and "" when unknown.
func (v Version) MarshalText() ([]byte, error) { return []byte(v.String()), nil }

// UnmarshalText reads "12.4"; "" is unknown.
func (v *Version) UnmarshalText(b []byte) error {
	if len(b) == 0 {
		*v = Version{}
		return nil
	}
	w, err := ParseVersion(string(b))
	if err != nil {
		return err
	}
	*v = w
	return nil
}

// MIGDevice is one MIG device (a GPU instance with a compute instance) of
// a GPU in MIG mode. Each is given to a runner as a GPU of its own.
type MIGDevice struct {
	Index             int    `json:"index"`
	UUID              string `json:"uuid,omitempty"`    // MIG-...; nvidia-smi -q -x does not give it
	Profile           string `json:"profile,omitempty"` // "1g.10gb"
	GPUInstanceID     int    `json:"gpu_instance_id"`
	ComputeInstanceID int    `json:"compute_instance_id"`
	MemoryMiB         uint64 `json:"memory_mib"`
}

// Device is one physical GPU.
type Device struct {
	// Index is NVML's (and nvidia-smi's) index: the order of PCI bus ids.
	Index     int    `json:"index"`
	UUID      string `json:"uuid"`
	Name      string `json:"name"`
	PCIBusID  string `json:"pci_bus_id,omitempty"`
	MemoryMiB uint64 `json:"memory_mib"`
	// MIG is set when MIG mode is on: the GPU is then used only through
	// its MIG devices.
	MIG        bool        `json:"mig"`
	MIGDevices []MIGDevice `json:"mig_devices,omitempty"`
	// Virtualization is the GPU's virtualization mode when it has one:
	// "Pass-Through", "VGPU" (a VM's vGPU), "Host VGPU" or "Host VSGA" (a
	// hypervisor's GPU, shared with its VMs).
	Virtualization string `json:"virtualization,omitempty"`
}

// SharedWithVMs reports whether the GPU is a hypervisor's, in a mode that
// shares it with virtual machines: its VMs use it, so it is not free.
func (d Device) SharedWithVMs() bool {
	return d.Virtualization == "Host VGPU" || d.Virtualization == "Host VSGA"
}

// Inventory is what a host has.
type Inventory struct {
	// Source is how it was read: "nvml" or "nvidia-smi".
	Source string `json:"source,omitempty"`
	Driver string `json:"driver_version,omitempty"`
	// CUDA is the newest CUDA version the driver supports.
	CUDA Version  `json:"cuda_version"`
	GPUs []Device `json:"gpus"`
	// Reason says why there is no GPU, when there is none.
	Reason string `json:"reason,omitempty"`
	// Error is set when the GPUs could not be read (output that is not a
	// report): unlike an empty inventory, it says nothing of the host.
	Error string `json:"error,omitempty"`
	// Skipped says, by GPU UUID, why a GPU is not handed out (shared with
	// virtual machines).
	Skipped map[string]string `json:"skipped,omitempty"`
	// ShareVMGPUs hands out GPUs shared with virtual machines too (the
	// config's gpu.allow_host_vgpu).
	ShareVMGPUs bool `json:"-"`
}

// Unit is what a runner is given: a whole GPU, or one MIG device of a GPU
// in MIG mode.
type Unit struct {
	// ID selects the unit in Docker's DeviceIDs, NVIDIA_VISIBLE_DEVICES
	// and CUDA_VISIBLE_DEVICES: a GPU's UUID, a MIG device's UUID, or
	// "<gpu>:<mig>" where the MIG UUID is unknown.
	ID     string
	Device Device
	MIG    *MIGDevice
}

// Units lists what can be handed out, in index order. A GPU in MIG mode
// counts as its MIG devices; one in MIG mode with none configured gives
// nothing.
func (inv Inventory) Units() []Unit {
	var out []Unit
	for _, d := range inv.GPUs {
		if d.SharedWithVMs() && !inv.ShareVMGPUs {
			continue
		}
		if !d.MIG {
			out = append(out, Unit{ID: d.UUID, Device: d})
			continue
		}
		for i := range d.MIGDevices {
			m := d.MIGDevices[i]
			id := m.UUID
			if id == "" {
				// NVIDIA's container toolkit accepts <gpu>:<mig>.
				id = fmt.Sprintf("%d:%d", d.Index, m.Index)
			}
			out = append(out, Unit{ID: id, Device: d, MIG: &m})
		}
	}
	return out
}

// skip notes the GPUs that are not handed out, and why.
func (inv *Inventory) skip() {
	for _, d := range inv.GPUs {
		if d.SharedWithVMs() {
			if inv.Skipped == nil {
				inv.Skipped = map[string]string{}
			}
			inv.Skipped[d.UUID] = fmt.Sprintf("in %s mode: virtual machines use it (set gpu.allow_host_vgpu to hand it to runners)", d.Virtualization)
		}
	}
}

// sortDevices orders GPUs as NVML numbers them, by PCI bus id, and sets
// Index. nvidia-smi's document order is not always that order.
func sortDevices(ds []Device) {
	slices.SortStableFunc(ds, func(a, b Device) int { return cmp.Compare(busKey(a.PCIBusID), busKey(b.PCIBusID)) })
	for i := range ds {
		ds[i].Index = i
	}
}

// busKey normalises "0000:00:03.0" and "00000000:00:03.0" alike.
func busKey(id string) string {
	dom, rest, ok := strings.Cut(strings.ToLower(id), ":")
	if !ok {
		return id
	}
	n, err := strconv.ParseUint(dom, 16, 32)
	if err != nil {
		return id
	}
	return fmt.Sprintf("%08x:%s", n, rest)
}

// Labels describe the hardware a runner got, for runs-on: "gpu",
// "gpu-<model>" for each model, "gpus-<n>", "cuda-<version>", and for MIG
// devices "mig" and "mig-<profile>". A runner without units gets none.
func Labels(units []Unit, cuda Version) []string {
	if len(units) == 0 {
		return nil
	}
	out := []string{"gpu"}
	add := func(l string) {
		if l != "" && !slices.Contains(out, l) {
			out = append(out, l)
		}
	}
	for _, u := range units {
		if m := Model(u.Device.Name); m != "" {
			add("gpu-" + m)
		}
	}
	add(fmt.Sprintf("gpus-%d", len(units)))
	if !cuda.IsZero() {
		add("cuda-" + cuda.String())
	}
	for _, u := range units {
		if u.MIG != nil {
			add("mig")
			if u.MIG.Profile != "" {
				add("mig-" + u.MIG.Profile)
			}
		}
	}
	return out
}

var (
	// Words that name the vendor or product line, not the model.
	vendorWords = map[string]bool{"nvidia": true, "geforce": true, "tesla": true, "generation": true, "graphics": true, "device": true}
	// From here on a product name gives the form factor or memory:
	// "A100-SXM4-80GB", "H200 141GB HBM3e", "H100 PCIe".
	formWord = lazyregexp.New(`^(sxm\d*|pcie|hbm\w*|\d+gb)$`)
)

// Model turns a product name into a label word: "NVIDIA H200 141GB HBM3e"
// is "h200", "NVIDIA A100-SXM4-80GB" "a100", "NVIDIA GeForce RTX 3080"
// "rtx-3080", "Tesla T4" "t4". It is "" for a name that says nothing
// ("Graphics Device").
func Model(name string) string {
	var words []string
	for _, w := range strings.FieldsFunc(strings.ToLower(name), func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.')
	}) {
		if formWord.MatchString(w) {
			break
		}
		if !vendorWords[w] {
			words = append(words, w)
		}
	}
	return strings.Join(words, "-")
}
