package gcp

import "testing"

// A GPU's SKU is found under each way the catalog has named it.
func TestGPUSKUNames(t *testing.T) {
	for _, c := range []struct {
		accel, desc string
		spot        bool
	}{
		{"nvidia-tesla-t4", "Nvidia Tesla T4 GPU attached to VMs running in Americas", false},
		{"nvidia-tesla-t4", "Nvidia Tesla T4 GPU attached to Spot Preemptible VMs running in Americas", true},
		{"nvidia-tesla-t4", "Nvidia Tesla T4 GPU running in Americas", false},
		{"nvidia-l4", "Nvidia L4 GPU attached to Spot Preemptible VMs running in Hong Kong", true},
		{"nvidia-a100-80gb", "Nvidia Tesla A100 80GB GPU attached to Spot Preemptible VMs running in Americas", true},
		{"nvidia-a100-80gb", "Nvidia A100 80GB GPU running in Americas", false},
		{"nvidia-h100-80gb", "Nvidia H100 80GB GPU attached to VMs running in Belgium", false},
	} {
		m := gpuRE(c.accel).FindStringSubmatch(c.desc)
		if m == nil || spotSKU(m) != c.spot {
			t.Errorf("%s: %q matched %v, spot %v; want a match, spot %v", c.accel, c.desc, m != nil, m != nil && spotSKU(m), c.spot)
		}
	}
	for _, c := range []struct{ accel, desc string }{
		{"nvidia-tesla-a100", "Nvidia Tesla A100 80GB GPU attached to VMs running in Americas"},
		{"nvidia-l4", "Nvidia L4 Virtual Workstation GPU attached to VMs running in Americas"},
		{"nvidia-tesla-t4", "Commitment v1: Nvidia Tesla T4 GPU in Americas for 1 Year"},
	} {
		if gpuRE(c.accel).MatchString(c.desc) {
			t.Errorf("%s matched %q", c.accel, c.desc)
		}
	}
}
