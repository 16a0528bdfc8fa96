package gpu

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzParseSMI throws arbitrary bytes, seeded with the fixtures, at the
// `nvidia-smi -q -x` and `-L` parsers: they never panic, a report they
// accept has a UUID for every GPU and units the allocator can hand out,
// and one they refuse is an error, never an empty inventory.
func FuzzParseSMI(f *testing.F) {
	fixtures, _ := filepath.Glob("testdata/*.xml")
	list, _ := os.ReadFile("testdata/a100-mig-L.txt")
	for _, p := range fixtures {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, list)
		f.Add(b[:len(b)/2], []byte{})
	}
	f.Add([]byte(""), []byte("GPU 0: X (UUID: GPU-1)\n  MIG 1g.5gb Device 0: (UUID: MIG-1)\n"))
	f.Add([]byte("<nvidia_smi_log><gpu id=\"x\"><uuid>GPU-1</uuid><mig_mode><current_mig>Enabled</current_mig></mig_mode><mig_devices><mig_device><index>99999999999999999999</index></mig_device></mig_devices></gpu></nvidia_smi_log>"), []byte("  MIG x Device 9: (UUID: MIG-2)"))
	f.Fuzz(func(t *testing.T, xml, list []byte) {
		inv, err := ParseSMI(xml)
		if err != nil {
			if err.Error() == "" || len(inv.GPUs) != 0 {
				t.Fatalf("refused with %q and %d GPUs", err, len(inv.GPUs))
			}
			return
		}
		inv.AddMIGNames(list)
		for _, d := range inv.GPUs {
			if d.UUID == "" {
				t.Fatalf("a GPU without a UUID: %+v", d)
			}
		}
		a := NewAllocator(inv.Units())
		if a.Len() != len(inv.Units()) {
			t.Fatalf("allocator has %d units of %d", a.Len(), len(inv.Units()))
		}
	})
}
