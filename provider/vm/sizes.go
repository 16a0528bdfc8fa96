package vm

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/dynamic"
)

// Size is what a cloud's machine type has, from the cloud's own catalogue
// (EC2's DescribeInstanceTypes): for a dynamic pool's job that asks for
// CPUs, memory or GPUs, the pool's types that have them are tried.
type Size struct {
	Type   string
	CPUs   float64
	Memory int64  // bytes
	GPUs   int    // how many
	GPU    string // their model, as hardware labels name it (gpu.Model: t4, a10g, h100)
}

func (s Size) String() string {
	out := fmt.Sprintf("%s (%g CPUs, %s", s.Type, s.CPUs, sizeOf(s.Memory))
	if s.GPUs > 0 {
		out += fmt.Sprintf(", %d %s", s.GPUs, cmp.Or(s.GPU, "GPU"))
	}
	return out + ")"
}

func sizeOf(n int64) string {
	if n%(1<<30) == 0 {
		return fmt.Sprintf("%dg", n>>30)
	}
	return fmt.Sprintf("%dm", n>>20)
}

// Sized reports whether a job asks for a machine's size: CPUs, memory or
// GPUs.
func Sized(r dynamic.Request) bool { return r.CPUs > 0 || r.Memory > 0 || r.GPUs > 0 || r.GPU != "" }

// Fit returns the types of sizes that have what a job asks for (at least
// its CPUs, memory and GPUs, of its GPU model), the smallest first (fewest
// GPUs, then CPUs, then memory: the cheapest, as the clouds price them),
// in the pool's order where two are alike. A job that asks for no size
// gets every type in the pool's order. None fitting is an error naming
// what was asked and what the pool's types have.
func Fit(sizes []Size, r dynamic.Request) ([]string, error) {
	if !Sized(r) {
		out := make([]string, len(sizes))
		for i, s := range sizes {
			out[i] = s.Type
		}
		return out, nil
	}
	var fit []Size
	for _, s := range sizes {
		if s.CPUs >= r.CPUs && s.Memory >= r.Memory && s.GPUs >= r.GPUs && (r.GPU == "" || s.GPU == r.GPU) {
			fit = append(fit, s)
		}
	}
	if len(fit) == 0 {
		have := make([]string, len(sizes))
		for i, s := range sizes {
			have[i] = s.String()
		}
		return nil, fmt.Errorf("no instance type of the pool has %s: it has %s", asked(r), strings.Join(have, ", "))
	}
	slices.SortStableFunc(fit, func(a, b Size) int {
		return cmp.Or(cmp.Compare(a.GPUs, b.GPUs), cmp.Compare(a.CPUs, b.CPUs), cmp.Compare(a.Memory, b.Memory))
	})
	out := make([]string, len(fit))
	for i, s := range fit {
		out[i] = s.Type
	}
	return out, nil
}

// asked says what a job asked of its machine's size.
func asked(r dynamic.Request) string {
	var parts []string
	if r.GPUs > 0 || r.GPU != "" {
		parts = append(parts, fmt.Sprintf("%d %s", max(r.GPUs, 1), cmp.Or(r.GPU, "GPU")))
	}
	if r.CPUs > 0 {
		parts = append(parts, fmt.Sprintf("%g CPUs", r.CPUs))
	}
	if r.Memory > 0 {
		parts = append(parts, sizeOf(r.Memory)+" of memory")
	}
	return strings.Join(parts, ", ")
}

// Honours is what a cloud pool's jobs may choose (provider.Shaper): Spot
// or standard where the pool runs Spot, and their machine's CPUs, memory
// and GPUs where it lists the types to choose from.
func Honours(poolSpot, sized bool) []string {
	var out []string
	if poolSpot {
		out = append(out, dynamic.KeySpot)
	}
	if sized {
		out = append(out, dynamic.KeyCPU, dynamic.KeyMem, dynamic.KeyGPUs, dynamic.KeyGPU)
	}
	return out
}
