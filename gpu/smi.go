package gpu

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// The fields of nvidia-smi's XML report (nvsmi_device_v*.dtd) that runfleet
// reads. Only these are declared: element names elsewhere in the report
// change between driver releases. encoding/xml is used directly: no
// maintained library parses this report.
type smiLog struct {
	XMLName  xml.Name `xml:"nvidia_smi_log"`
	Driver   string   `xml:"driver_version"`
	CUDA     string   `xml:"cuda_version"` // absent before DTD v10
	Attached string   `xml:"attached_gpus"`
	GPUs     []smiGPU `xml:"gpu"`
}

type smiGPU struct {
	ID         string   `xml:"id,attr"` // the PCI bus id
	Name       string   `xml:"product_name"`
	UUID       string   `xml:"uuid"`
	BusID      string   `xml:"pci>pci_bus_id"`
	Memory     string   `xml:"fb_memory_usage>total"`
	MemoryUsed string   `xml:"fb_memory_usage>used"`
	Util       string   `xml:"utilization>gpu_util"` // "N/A" in MIG mode
	MIGCurrent string   `xml:"mig_mode>current_mig"`
	VirtMode   string   `xml:"gpu_virtualization_mode>virtualization_mode"`
	MIGDevices []smiMIG `xml:"mig_devices>mig_device"` // the text "None" without MIG
}

type smiMIG struct {
	Index  string `xml:"index"`
	GI     string `xml:"gpu_instance_id"`
	CI     string `xml:"compute_instance_id"`
	Memory string `xml:"fb_memory_usage>total"`
}

// ParseSMI reads the output of `nvidia-smi -q -x`.
func ParseSMI(data []byte) (Inventory, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return Inventory{}, errors.New("nvidia-smi -q -x printed nothing")
	}
	l, err := decodeSMI(data)
	if err != nil {
		return Inventory{}, err
	}
	inv := Inventory{Source: "nvidia-smi", Driver: value(l.Driver)}
	if v, err := ParseVersion(value(l.CUDA)); err == nil {
		inv.CUDA = v
	} else {
		// Drivers before R410 do not report it.
		inv.CUDA = CUDAForDriver(inv.Driver)
	}
	for i, g := range l.GPUs {
		d := Device{
			UUID:      value(g.UUID),
			Name:      value(g.Name),
			PCIBusID:  value(g.BusID),
			MemoryMiB: mib(g.Memory),
			MIG:       strings.EqualFold(value(g.MIGCurrent), "Enabled"),
		}
		if v := value(g.VirtMode); v != "None" {
			d.Virtualization = v
		}
		if d.PCIBusID == "" {
			d.PCIBusID = g.ID
		}
		if d.UUID == "" {
			return Inventory{}, fmt.Errorf("nvidia-smi -q -x output: gpu %d (%s) has no uuid", i, g.ID)
		}
		if d.MIG {
			for _, m := range g.MIGDevices {
				d.MIGDevices = append(d.MIGDevices, MIGDevice{
					Index:             atoi(m.Index),
					GPUInstanceID:     atoi(m.GI),
					ComputeInstanceID: atoi(m.CI),
					MemoryMiB:         mib(m.Memory),
				})
			}
		}
		inv.GPUs = append(inv.GPUs, d)
	}
	sortDevices(inv.GPUs)
	inv.skip()
	if len(inv.GPUs) == 0 {
		inv.Reason = "nvidia-smi reports no GPU attached"
	}
	return inv, nil
}

// decodeSMI reads the report's fields runfleet uses.
func decodeSMI(data []byte) (smiLog, error) {
	var l smiLog
	if len(bytes.TrimSpace(data)) == 0 {
		return l, errors.New("nvidia-smi -q -x printed nothing")
	}
	dec := xml.NewDecoder(bytes.NewReader(data))
	// Reports declare UTF-8; should one not, its ASCII element names
	// and values read the same.
	dec.CharsetReader = func(_ string, r io.Reader) (io.Reader, error) { return r, nil }
	if err := dec.Decode(&l); err != nil {
		return l, fmt.Errorf("nvidia-smi -q -x output: %w", err)
	}
	return l, nil
}

// value drops the placeholders nvidia-smi writes for what it cannot tell.
func value(s string) string {
	s = strings.TrimSpace(s)
	switch s {
	case "N/A", "Not Found", "Not Supported", "Unknown Error", "Requested functionality has been deprecated", "None":
		return ""
	}
	return s
}

// mib reads "81920 MiB".
func mib(s string) uint64 {
	f := strings.Fields(value(s))
	if len(f) == 0 {
		return 0
	}
	n, err := strconv.ParseUint(f[0], 10, 64)
	if err != nil {
		return 0
	}
	if len(f) > 1 && strings.EqualFold(f[1], "GiB") {
		n *= 1024
	}
	return n
}

func atoi(s string) int {
	n, _ := strconv.Atoi(value(s))
	return n
}

var (
	listGPU = lazyregexp.New(`^GPU (\d+): .*\(UUID: (GPU-[^)]+)\)`)
	listMIG = lazyregexp.New(`^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)`)
)

// AddMIGNames fills in MIG devices' UUIDs and profiles from the output of
// `nvidia-smi -L`, which the XML report lacks:
//
//	GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5b...)
//	  MIG 1g.10gb     Device  0: (UUID: MIG-c6d4...)
func (inv *Inventory) AddMIGNames(list []byte) {
	var gpu string
	sc := bufio.NewScanner(bytes.NewReader(list))
	for sc.Scan() {
		line := sc.Text()
		if m := listGPU.FindStringSubmatch(line); m != nil {
			gpu = m[2]
			continue
		}
		m := listMIG.FindStringSubmatch(line)
		if m == nil || gpu == "" {
			continue
		}
		idx, _ := strconv.Atoi(m[2])
		for i := range inv.GPUs {
			d := &inv.GPUs[i]
			if d.UUID != gpu {
				continue
			}
			for j := range d.MIGDevices {
				if d.MIGDevices[j].Index == idx {
					d.MIGDevices[j].UUID, d.MIGDevices[j].Profile = m[3], m[1]
				}
			}
		}
	}
}

// SMI reads the inventory by running nvidia-smi.
type SMI struct {
	// Path is the nvidia-smi binary; "nvidia-smi" on PATH when empty.
	Path string
	// Timeout bounds each run (SMITimeout when 0).
	Timeout time.Duration
}

// SMITimeout is how long nvidia-smi may take: it answers in a second or
// two, and a hung driver makes it hang.
const SMITimeout = 30 * time.Second

// smiWaitDelay is how long a killed or finished nvidia-smi's output is
// waited for: a child of it that keeps the pipe open must not hold the
// read past the timeout.
const smiWaitDelay = 2 * time.Second

// Inventory runs `nvidia-smi -q -x`, and `nvidia-smi -L` when a GPU is in
// MIG mode. A host without nvidia-smi or without a GPU gives an empty
// inventory and the reason, not an error. The error (also in
// Inventory.Error) is for a driver that is there but fails: an
// nvidia-smi named by path that does not exist, one that fails or does
// not answer within the timeout, output that cannot be read.
func (s SMI) Inventory(ctx context.Context) (Inventory, error) {
	path := s.Path
	if path == "" {
		path = "nvidia-smi"
	}
	timeout := cmp.Or(s.Timeout, SMITimeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := smiRun(ctx, path, "-q", "-x")
	if err != nil {
		reason, failed := smiFailure(path, s.Path != "", out, err, ctx.Err() != nil, timeout)
		inv := Inventory{Source: "nvidia-smi", Reason: reason}
		if failed {
			inv.Error = reason
			return inv, errors.New(reason)
		}
		return inv, nil
	}
	inv, err := ParseSMI(out)
	if err != nil {
		return Inventory{Source: "nvidia-smi", Reason: err.Error(), Error: err.Error()}, err
	}
	for _, d := range inv.GPUs {
		if d.MIG {
			if list, err := smiRun(ctx, path, "-L"); err == nil {
				inv.AddMIGNames(list)
			}
			break
		}
	}
	return inv, nil
}

// smiRun runs nvidia-smi and returns its output.
func smiRun(ctx context.Context, path string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.WaitDelay = smiWaitDelay
	return cmd.Output()
}

// noDevices is what nvidia-smi says, with exit status 6, where the driver
// works and sees no GPU.
const noDevices = "No devices were found"

// smiFailure says why nvidia-smi gave no report, in its own words where it
// has some ("No devices were found", "NVIDIA-SMI has failed because it
// couldn't communicate with the NVIDIA driver"), and whether that is a
// failure rather than a host without a driver or a GPU: nvidia-smi not on
// PATH, or saying it found no device, is a host without GPUs; one named by
// path that is not there, one that fails otherwise, or one that did not
// answer in time, is a failure.
func smiFailure(path string, named bool, out []byte, err error, timedOut bool, timeout time.Duration) (string, bool) {
	switch {
	case timedOut:
		return fmt.Sprintf("%s did not answer within %s (the driver may be hung)", path, timeout), true
	case errors.Is(err, exec.ErrNotFound) && !named:
		return "nvidia-smi not found: no NVIDIA driver on this host", false
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, exec.ErrNotFound):
		return fmt.Sprintf("%s: no such program (--nvidia-smi, gpu.nvidia_smi)", path), true
	}
	msg := strings.TrimSpace(string(out))
	var ee *exec.ExitError
	if errors.As(err, &ee) && msg == "" {
		msg = strings.TrimSpace(string(ee.Stderr))
	}
	first, _, _ := strings.Cut(msg, "\n")
	if first = strings.TrimSpace(first); first == "" {
		return fmt.Sprintf("%s failed: %v", path, err), true
	}
	return fmt.Sprintf("%s: %s", path, first), !strings.Contains(first, noDevices)
}

// driverCUDA is the first driver release (Linux x86_64) of each CUDA
// version, from Table 3 of NVIDIA's CUDA Toolkit release notes. It is used
// only when the driver does not report its CUDA version (before R410).
var driverCUDA = []struct {
	driver string
	cuda   Version
}{
	{"580.65.06", Version{13, 0}},
	{"575.51.03", Version{12, 9}},
	{"570.26", Version{12, 8}},
	{"560.28.03", Version{12, 6}},
	{"555.42.02", Version{12, 5}},
	{"550.54.14", Version{12, 4}},
	{"545.23.06", Version{12, 3}},
	{"535.54.03", Version{12, 2}},
	{"530.30.02", Version{12, 1}},
	{"525.60.13", Version{12, 0}},
	{"520.61.05", Version{11, 8}},
	{"515.43.04", Version{11, 7}},
	{"510.39.01", Version{11, 6}},
	{"495.29.05", Version{11, 5}},
	{"470.42.01", Version{11, 4}},
	{"465.19.01", Version{11, 3}},
	{"460.27.03", Version{11, 2}},
	{"455.23", Version{11, 1}},
	{"450.36.06", Version{11, 0}},
	{"440.33", Version{10, 2}},
	{"418.39", Version{10, 1}},
	{"410.48", Version{10, 0}},
	{"396.26", Version{9, 2}},
	{"390.46", Version{9, 1}},
	{"384.81", Version{9, 0}},
	{"375.26", Version{8, 0}},
	{"352.31", Version{7, 5}},
	{"346.46", Version{7, 0}},
}

// CUDAForDriver is the newest CUDA version a Linux driver release
// supports, by NVIDIA's table; zero for an unknown or older driver.
func CUDAForDriver(driver string) Version {
	d := dotted(driver)
	if d == nil {
		return Version{}
	}
	for _, e := range driverCUDA {
		if compareDotted(d, dotted(e.driver)) >= 0 {
			return e.cuda
		}
	}
	return Version{}
}

func dotted(s string) []int {
	if s == "" {
		return nil
	}
	var out []int
	for _, p := range strings.Split(s, ".") {
		n, err := strconv.Atoi(p)
		if err != nil {
			return nil
		}
		out = append(out, n)
	}
	return out
}

func compareDotted(a, b []int) int {
	for i := 0; i < max(len(a), len(b)); i++ {
		var x, y int
		if i < len(a) {
			x = a[i]
		}
		if i < len(b) {
			y = b[i]
		}
		if x != y {
			if x < y {
				return -1
			}
			return 1
		}
	}
	return 0
}
