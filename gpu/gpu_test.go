package gpu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func read(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The project's fixtures, written from the fields of NVIDIA's nvsmi DTD
// (v12, v13): four hosts.
func TestParseSMIHosts(t *testing.T) {
	tests := []struct {
		file, list string
		driver     string
		cuda       Version
		gpus       int
		units      []string // unit ids in order
		names      []string
		labels     string // of the first unit
		reason     bool
	}{
		{
			file: "h100x4-v12.xml", driver: "550.54.15", cuda: Version{12, 4}, gpus: 4,
			// Listed out of PCI order; NVML's index follows the bus id.
			units:  []string{"GPU-0b1e2d3c-4a5b-6c7d-8e9f-a0b1c2d3e4f5", "GPU-1c2d3e4f-5a6b-4c7d-9e8f-0a1b2c3d4e5f", "GPU-5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c8d", "GPU-7e4c1a3b-9d2e-4f61-8a0b-3c5d7e9f1a20"},
			labels: "[gpu gpu-h100 gpus-1 cuda-12.4]",
		},
		{
			file: "a100-mig-v12.xml", list: "a100-mig-L.txt", driver: "535.104.05", cuda: Version{12, 2}, gpus: 2,
			units:  []string{"MIG-4f0c9a57-1b2e-5d3c-9a8b-7c6d5e4f3a21", "MIG-8d7c6b5a-4e3f-5a2b-8c1d-0e9f8a7b6c5d", "MIG-2a3b4c5d-6e7f-5809-9a1b-2c3d4e5f6a7b", "GPU-f0e1d2c3-b4a5-4968-8776-5a4b3c2d1e0f"},
			labels: "[gpu gpu-a100 gpus-1 cuda-12.2 mig mig-3g.20gb]",
		},
		{
			// Without nvidia-smi -L, MIG devices are named <gpu>:<mig>.
			file: "a100-mig-v12.xml", driver: "535.104.05", cuda: Version{12, 2}, gpus: 2,
			units:  []string{"0:0", "0:1", "0:2", "GPU-f0e1d2c3-b4a5-4968-8776-5a4b3c2d1e0f"},
			labels: "[gpu gpu-a100 gpus-1 cuda-12.2 mig]",
		},
		{file: "nogpu-v12.xml", driver: "550.54.15", cuda: Version{12, 4}, reason: true},
		{
			file: "l4-v13.xml", driver: "580.82.07", cuda: Version{13, 0}, gpus: 1,
			units: []string{"GPU-3f2e1d0c-9b8a-4766-8554-4a3b2c1d0e9f"}, labels: "[gpu gpu-l4 gpus-1 cuda-13.0]",
		},
	}
	for _, tt := range tests {
		t.Run(tt.file+"+"+tt.list, func(t *testing.T) {
			inv, err := ParseSMI(read(t, filepath.Join("testdata", tt.file)))
			if err != nil {
				t.Fatal(err)
			}
			if tt.list != "" {
				inv.AddMIGNames(read(t, filepath.Join("testdata", tt.list)))
			}
			units := inv.Units()
			t.Logf("driver %s CUDA %s, %d GPUs, units %v, reason %q", inv.Driver, inv.CUDA, len(inv.GPUs), IDs(units), inv.Reason)
			if inv.Driver != tt.driver || inv.CUDA != tt.cuda || len(inv.GPUs) != tt.gpus {
				t.Fatalf("driver %q CUDA %s GPUs %d; want %q %s %d", inv.Driver, inv.CUDA, len(inv.GPUs), tt.driver, tt.cuda, tt.gpus)
			}
			if (inv.Reason != "") != tt.reason {
				t.Errorf("reason %q", inv.Reason)
			}
			if fmt.Sprint(IDs(units)) != fmt.Sprint(tt.units) && !(len(units) == 0 && len(tt.units) == 0) {
				t.Errorf("units %v, want %v", IDs(units), tt.units)
			}
			for i, d := range inv.GPUs {
				if d.Index != i || d.MemoryMiB == 0 || d.Name == "" {
					t.Errorf("GPU %d: %+v", i, d)
				}
			}
			if len(units) > 0 {
				if got := fmt.Sprint(Labels(units[:1], inv.CUDA)); got != tt.labels {
					t.Errorf("labels %s, want %s", got, tt.labels)
				}
			}
		})
	}
}

func TestParseSMIMIGDetails(t *testing.T) {
	inv, err := ParseSMI(read(t, "testdata/a100-mig-v12.xml"))
	if err != nil {
		t.Fatal(err)
	}
	inv.AddMIGNames(read(t, "testdata/a100-mig-L.txt"))
	g := inv.GPUs[0]
	if !g.MIG || len(g.MIGDevices) != 3 || inv.GPUs[1].MIG || len(inv.GPUs[1].MIGDevices) != 0 {
		t.Fatalf("GPUs %+v", inv.GPUs)
	}
	want := []MIGDevice{
		{Index: 0, UUID: "MIG-4f0c9a57-1b2e-5d3c-9a8b-7c6d5e4f3a21", Profile: "3g.20gb", GPUInstanceID: 1, MemoryMiB: 19968},
		{Index: 1, UUID: "MIG-8d7c6b5a-4e3f-5a2b-8c1d-0e9f8a7b6c5d", Profile: "2g.10gb", GPUInstanceID: 5, MemoryMiB: 9856},
		{Index: 2, UUID: "MIG-2a3b4c5d-6e7f-5809-9a1b-2c3d4e5f6a7b", Profile: "1g.5gb", GPUInstanceID: 13, MemoryMiB: 4864},
	}
	if fmt.Sprint(g.MIGDevices) != fmt.Sprint(want) {
		t.Errorf("MIG devices\n got %+v\nwant %+v", g.MIGDevices, want)
	}
	// The GPU's own memory is its fb_memory_usage, not a MIG device's.
	if g.MemoryMiB != 40960 {
		t.Errorf("memory %d", g.MemoryMiB)
	}
}

func TestParseSMIBadInput(t *testing.T) {
	for _, in := range []string{"", "No devices were found", "<html></html>", `<nvidia_smi_log><gpu id="1"><product_name>X</product_name></gpu></nvidia_smi_log>`} {
		if _, err := ParseSMI([]byte(in)); err == nil || !strings.Contains(err.Error(), "nvidia-smi") {
			t.Errorf("%q: err %v, want an error naming nvidia-smi", in, err)
		}
	}
}

// sharedCaptures finds the real nvidia-smi captures kept beside the
// project (../shared/testdata/nvidia-smi), or "" where there are none.
func sharedCaptures() string {
	if d := os.Getenv("RUNFLEET_NVIDIA_SMI_CAPTURES"); d != "" {
		return d
	}
	dir, _ := os.Getwd()
	for ; dir != filepath.Dir(dir); dir = filepath.Dir(dir) {
		p := filepath.Join(dir, "shared", "testdata", "nvidia-smi")
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			return p
		}
	}
	return ""
}

// TestParseSMIRealCaptures reads real reports from other machines (from
// DTD v7 to v13, with inline DTDs, "N/A" and "Not Found" values, missing
// CUDA versions, out-of-order devices), where this checkout has them.
func TestParseSMIRealCaptures(t *testing.T) {
	dir := sharedCaptures()
	if dir == "" {
		t.Skip("no real nvidia-smi captures beside this checkout (../shared/testdata/nvidia-smi); the project's own fixtures are tested above")
	}
	want := map[string]struct {
		gpus  int
		cuda  Version
		first string // model of GPU 0
	}{
		"a100-sxm4-v12.xml":                     {1, Version{12, 2}, "a100"},
		"a10g.xml":                              {1, Version{11, 7}, "a10g"},
		"gtx-1660-ti.xml":                       {1, Version{10, 1}, ""},
		"quadro-p2000-v12.xml":                  {1, Version{12, 0}, "quadro-p2000"},
		"quadro-p400.xml":                       {1, Version{10, 1}, "quadro-p400"},
		"rtx-3060-v12.xml":                      {1, Version{12, 8}, "rtx-3060"},
		"rtx-3080-v12.xml":                      {1, Version{12, 2}, "rtx-3080"},
		"rtx-3080-v13.xml":                      {1, Version{13, 2}, "rtx-3080"},
		"rtx-3090-v12.xml":                      {1, Version{12, 0}, "rtx-3090"},
		"rtx-4000-sff-ada-v13.xml":              {1, Version{13, 2}, "rtx-4000-sff-ada"},
		"tesla-t4.xml":                          {1, Version{11, 7}, "t4"},
		"nvidia_smi_out_of_order.xml":           {4, Version{10, 1}, "k80"}, // "Not Found": from the driver table
		"nvidia_smi_sample.xml":                 {2, Version{8, 0}, "gtx-1070"},
		"nvidia_smi_sample_ecc_unsupported.xml": {2, Version{10, 0}, "rtx-2080-ti"},
		"example1.xml":                          {1, Version{7, 5}, "grid-k520"},
		"example2.xml":                          {1, Version{7, 5}, "grid-k520"},
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.xml"))
	if len(files) == 0 {
		t.Fatalf("no captures in %s", dir)
	}
	for _, f := range files {
		name := filepath.Base(f)
		t.Run(name, func(t *testing.T) {
			inv, err := ParseSMI(read(t, f))
			if err != nil {
				t.Fatal(err)
			}
			w, ok := want[name]
			if !ok {
				t.Fatalf("a capture this test does not know: %+v", inv)
			}
			if len(inv.GPUs) != w.gpus || inv.CUDA != w.cuda || Model(inv.GPUs[0].Name) != w.first {
				t.Errorf("%d GPUs, CUDA %s, model %q; want %d, %s, %q", len(inv.GPUs), inv.CUDA, Model(inv.GPUs[0].Name), w.gpus, w.cuda, w.first)
			}
			for i, d := range inv.GPUs {
				if !strings.HasPrefix(d.UUID, "GPU-") || d.MemoryMiB == 0 || d.Index != i {
					t.Errorf("GPU %d: %+v", i, d)
				}
				if i > 0 && busKey(inv.GPUs[i-1].PCIBusID) >= busKey(d.PCIBusID) {
					t.Errorf("GPU %d is not in PCI bus order: %s after %s", i, d.PCIBusID, inv.GPUs[i-1].PCIBusID)
				}
			}
		})
	}
	// The A100 capture is in MIG mode with four devices and no UUIDs:
	// each is handed out as <gpu>:<mig>.
	inv, err := ParseSMI(read(t, filepath.Join(dir, "a100-sxm4-v12.xml")))
	if err == nil {
		if got := fmt.Sprint(IDs(inv.Units())); got != "[0:0 0:1 0:2 0:3]" {
			t.Errorf("A100 MIG units %s", got)
		}
	}
}

// An nvidia-smi that hangs, with a child that keeps its output open, is
// given up at the timeout (WaitDelay: without it the read waited for the
// child, twice the timeout), and said to be one, not "signal: killed".
func TestSMITimeout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nvidia-smi")
	if err := os.WriteFile(path, []byte("#!/bin/sh\nsleep 30 &\nsleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	inv, err := SMI{Path: path, Timeout: time.Second}.Inventory(context.Background())
	took := time.Since(start)
	if err == nil || !strings.Contains(inv.Error, "did not answer within 1s") || strings.Contains(inv.Error, "killed") {
		t.Errorf("a hung nvidia-smi: %+v %v", inv, err)
	}
	if took > time.Second+smiWaitDelay+5*time.Second {
		t.Errorf("a hung nvidia-smi held the read for %s", took)
	}
	t.Logf("given up after %s: %s", took.Round(10*time.Millisecond), inv.Error)
}

// fakeSMI writes an nvidia-smi that prints the given report for -q -x and
// list for -L, or fails as a host without a working driver does.
func fakeSMI(t *testing.T, report, list string, exit int) string {
	t.Helper()
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("report", report)
	write("list", list)
	script := fmt.Sprintf("#!/bin/sh\ncase \"$1\" in -L) cat %s/list;; *) cat %s/report;; esac\nexit %d\n", dir, dir, exit)
	path := filepath.Join(dir, "nvidia-smi")
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestDetectThroughNvidiaSMI(t *testing.T) {
	ctx := context.Background()
	inv := Detect(ctx, fakeSMI(t, string(read(t, "testdata/a100-mig-v12.xml")), string(read(t, "testdata/a100-mig-L.txt")), 0))
	if len(inv.Units()) != 4 || inv.Units()[0].MIG.Profile != "3g.20gb" || inv.Source != "nvidia-smi" {
		t.Fatalf("inventory %+v", inv)
	}
	// A driver that is there and fails is an error; a host where the
	// driver finds no GPU is not.
	for _, tt := range []struct {
		name, out string
		exit      int
		reason    string
		failed    bool
	}{
		{"driver unreachable", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\n", 9, "couldn't communicate with the NVIDIA driver", true},
		{"no device", "No devices were found\n", 6, "No devices were found", false},
		{"silent failure", "", 3, "failed: exit status 3", true},
	} {
		inv := Detect(ctx, fakeSMI(t, tt.out, "", tt.exit))
		t.Logf("%s: reason %q", tt.name, inv.Reason)
		if len(inv.GPUs) != 0 || !strings.Contains(inv.Reason, tt.reason) || (inv.Error != "") != tt.failed {
			t.Errorf("%s: %+v, want an error %v", tt.name, inv, tt.failed)
		}
	}
	// nvidia-smi named by path and not there is an error; not on PATH,
	// a host without a driver.
	inv = Detect(ctx, filepath.Join(t.TempDir(), "nvidia-smi"))
	if len(inv.GPUs) != 0 || !strings.Contains(inv.Error, "no such program") {
		t.Errorf("missing binary named by path: %+v", inv)
	}
	// A host without GPUs is not an error; output that cannot be read
	// is, and an empty output says it was empty.
	full := string(read(t, "testdata/h100x4-v12.xml"))
	for _, tt := range []struct{ name, out, want string }{
		{"truncated", full[:len(full)/2], "nvidia-smi -q -x output: XML syntax error"},
		{"empty", "", "nvidia-smi -q -x printed nothing"},
	} {
		inv := Detect(ctx, fakeSMI(t, tt.out, "", 0))
		if len(inv.GPUs) != 0 || !strings.Contains(inv.Error, tt.want) {
			t.Errorf("%s output: %+v, want the error %q", tt.name, inv, tt.want)
		}
	}
	if inv := Detect(ctx, fakeSMI(t, string(read(t, "testdata/nogpu-v12.xml")), "", 0)); inv.Error != "" || inv.Reason == "" {
		t.Errorf("no GPU: %+v, want a reason and no error", inv)
	}
	t.Setenv("PATH", t.TempDir())
	if inv = Detect(ctx, ""); inv.Error != "" || !strings.Contains(inv.Reason, "no NVIDIA driver on this host") {
		t.Errorf("no nvidia-smi on PATH: %+v", inv)
	}
}

// A hypervisor's GPU shared with its VMs (Host VGPU) is not handed out by
// default, and the inventory says why.
func TestParseSMIHostVGPU(t *testing.T) {
	x := strings.Replace(string(read(t, "testdata/h100x4-v12.xml")), "<virtualization_mode>None</virtualization_mode>", "<virtualization_mode>Host VGPU</virtualization_mode>", 1)
	inv, err := ParseSMI([]byte(x))
	if err != nil {
		t.Fatal(err)
	}
	var shared []string
	for _, d := range inv.GPUs {
		if d.SharedWithVMs() {
			shared = append(shared, d.UUID)
		}
	}
	if len(shared) != 1 || len(inv.Units()) != 3 || slices.Contains(IDs(inv.Units()), shared[0]) || !strings.Contains(inv.Skipped[shared[0]], "Host VGPU") {
		t.Fatalf("shared %v, units %v, skipped %v: want the Host VGPU GPU left out, with why", shared, IDs(inv.Units()), inv.Skipped)
	}
	inv.ShareVMGPUs = true
	if len(inv.Units()) != 4 {
		t.Fatalf("units %v with sharing allowed", IDs(inv.Units()))
	}
}

func TestModel(t *testing.T) {
	for name, want := range map[string]string{
		"NVIDIA H200 141GB HBM3e":            "h200",
		"NVIDIA H200":                        "h200",
		"NVIDIA H100 80GB HBM3":              "h100",
		"NVIDIA H100 PCIe":                   "h100",
		"NVIDIA H100 NVL":                    "h100-nvl",
		"NVIDIA A100-SXM4-80GB":              "a100",
		"NVIDIA A100 80GB PCIe":              "a100",
		"Tesla T4":                           "t4",
		"Tesla V100-SXM2-16GB":               "v100",
		"NVIDIA GeForce RTX 3080":            "rtx-3080",
		"GeForce GTX 1070":                   "gtx-1070",
		"NVIDIA RTX 4000 SFF Ada Generation": "rtx-4000-sff-ada",
		"NVIDIA RTX A6000":                   "rtx-a6000",
		"NVIDIA L4":                          "l4",
		"NVIDIA B200":                        "b200",
		"Graphics Device":                    "",
	} {
		if got := Model(name); got != want {
			t.Errorf("Model(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestCUDAForDriver(t *testing.T) {
	for driver, want := range map[string]string{
		"352.99": "7.5", "384.66": "8.0", "384.81": "9.0", "418.43": "10.1", "430.26": "10.1",
		"515.105.01": "11.7", "535.54.03": "12.2", "550.54.15": "12.4", "570.124.04": "12.8", "580.82.07": "13.0",
		"340.1": "", "": "", "junk": "",
	} {
		if got := CUDAForDriver(driver).String(); got != want {
			t.Errorf("CUDAForDriver(%q) = %q, want %q", driver, got, want)
		}
	}
}

func TestPickImage(t *testing.T) {
	host := Inventory{Driver: "535.104.05", CUDA: Version{12, 2}, GPUs: []Device{{UUID: "GPU-1"}}}
	none := Inventory{Reason: "nvidia-smi not found: no NVIDIA driver on this host"}
	list := []Image{
		{"runner:cuda11.8", Version{11, 8}},
		{"runner:cuda12.4", Version{12, 4}},
		{"runner:cuda12.1", Version{12, 1}},
	}
	tests := []struct {
		image  string
		images []Image
		inv    Inventory
		want   string // or the error's text
		err    bool
	}{
		{image: "nvidia/cuda:{{.CUDA}}.0-runtime-ubuntu22.04", inv: host, want: "nvidia/cuda:12.2.0-runtime-ubuntu22.04"},
		{image: "runner:cu{{.CUDAMajor}}{{.CUDAMinor}}", inv: host, want: "runner:cu122"},
		{image: "runner:plain", inv: none, want: "runner:plain"},
		{images: list, inv: host, want: "runner:cuda12.1"},
		{images: list, inv: Inventory{CUDA: Version{13, 0}}, want: "runner:cuda12.4"},
		{images: list, inv: Inventory{Driver: "515.105.01", CUDA: Version{11, 7}}, err: true,
			want: "no image fits: the driver (515.105.01) supports CUDA up to 11.7; runner:cuda11.8 needs CUDA 11.8, runner:cuda12.1 needs CUDA 12.1, runner:cuda12.4 needs CUDA 12.4"},
		{images: list, inv: none, err: true, want: "this host has no CUDA driver (nvidia-smi not found"},
		{image: "nvidia/cuda:{{.CUDA}}-base", inv: none, err: true, want: "needs the driver's CUDA version, and this host has none (nvidia-smi not found"},
		{image: "runner:{{.Nope}}", inv: host, err: true, want: "Nope"},
	}
	for _, tt := range tests {
		got, err := PickImage(tt.image, tt.images, tt.inv)
		switch {
		case tt.err && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("PickImage(%q, %v): %q, %v; want error %q", tt.image, tt.images, got, err, tt.want)
		case !tt.err && (err != nil || got != tt.want):
			t.Errorf("PickImage(%q, %v): %q, %v; want %q", tt.image, tt.images, got, err, tt.want)
		}
	}
}

func TestAllocatorNeverSharesAUnit(t *testing.T) {
	var units []Unit
	for i := range 8 {
		units = append(units, Unit{ID: fmt.Sprintf("GPU-%d", i)})
	}
	a := NewAllocator(units)
	// 16 runners race for pairs of 8 units, releasing and taking again.
	var wg sync.WaitGroup
	var mu sync.Mutex
	inUse := map[string]string{}
	for r := range 16 {
		wg.Go(func() {
			name := fmt.Sprintf("pool-%d", r)
			for range 200 {
				got, err := a.Take(name, 2)
				if err != nil {
					continue
				}
				mu.Lock()
				for _, u := range got {
					if o, ok := inUse[u.ID]; ok {
						t.Errorf("%s given to %s while %s holds it", u.ID, name, o)
					}
					inUse[u.ID] = name
				}
				mu.Unlock()
				mu.Lock()
				for _, u := range got {
					delete(inUse, u.ID)
				}
				mu.Unlock()
				a.Release(name)
			}
		})
	}
	wg.Wait()
	if a.Free() != 8 {
		t.Fatalf("%d free after all released", a.Free())
	}

	// Take is idempotent; all takes everything; Hold adopts and reports
	// conflicts.
	x, _ := a.Take("x", 1)
	again, _ := a.Take("x", 1)
	if x[0].ID != again[0].ID || a.Free() != 7 {
		t.Errorf("second Take gave %v, free %d", IDs(again), a.Free())
	}
	if _, err := a.Take("all", -1); err == nil {
		t.Error("all units given while one is held")
	}
	if c := a.Hold("y", []string{"GPU-0", "GPU-5", "GPU-99"}); fmt.Sprint(c) != "[GPU-0 GPU-99]" {
		t.Errorf("conflicts %v", c)
	}
	if h := a.Holders(); fmt.Sprint(h) != "map[x:[GPU-0] y:[GPU-5]]" {
		t.Errorf("holders %v", h)
	}
	a.Release("x")
	a.Release("y")
	if got, err := a.Take("all", -1); err != nil || len(got) != 8 {
		t.Errorf("all: %v, %v", IDs(got), err)
	}
}
