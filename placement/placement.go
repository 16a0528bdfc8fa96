// Package placement decides where a pool's runners go and what they are
// known by: how many of this host's GPUs each runner gets and which, how
// many runners the pool keeps, the labels a runner registers with beside
// the labels demand matches the pool on, and which of a job's requests
// the pool's provider honours. It reads a pool's wishes (Want) and its
// provider's traits and returns a Plan; it writes nothing back into the
// configuration, so that a reload compares what the user wrote.
package placement

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/provider"
)

// Want is what a pool's configuration asks of its placement.
type Want struct {
	Pool     string
	Provider string // the provider's name, for errors
	Labels   []string
	// GPUsPerRunner is how many GPUs each runner gets: -1 all, 0 none.
	GPUsPerRunner int
	// SizeFromGPUs sizes the pool by its GPUs: gpus_per_runner given
	// and size not.
	SizeFromGPUs bool
	Size, Max    int
	// HardwareLabels adds the labels of each runner's GPUs.
	HardwareLabels bool
	// Dynamic is what the pool's jobs may ask for; nil for a pool
	// whose runners are all alike.
	Dynamic *dynamic.Limits
}

// Plan is where a pool's runners go: how many the pool keeps, and what
// each gets and registers with.
type Plan struct {
	// Size is the number of idle runners kept ready, Max the most at
	// once: as the pool asks, or as its GPUs allow.
	Size, Max int
	Runners   Runners
}

// For plans a pool on this host with its provider. It fails when the
// host or the provider cannot give runners what the pool asks for.
func For(h *Host, w Want, prov provider.Provider) (Plan, error) {
	t := provider.TraitsOf(prov)
	p := Plan{Size: w.Size, Max: w.Max, Runners: Runners{Labels: poolLabels(w, prov)}}
	if err := p.fitGPUs(h, w, t); err != nil {
		return Plan{}, err
	}
	if w.Dynamic == nil {
		return p, nil
	}
	if asksGPUs := len(w.Dynamic.GPUs) > 0 || len(w.Dynamic.GPU) > 0; asksGPUs && w.GPUsPerRunner == 0 && (t.HostGPUs || t.SchedulesGPUs) {
		// A cloud's machine type has its GPUs; here a runner gets a
		// number of them.
		return Plan{}, fmt.Errorf("dynamic.gpus: needs gpus_per_runner: the GPUs of a job that asks for none")
	}
	honours := []string{}
	if s, ok := prov.(provider.Shaper); ok {
		honours = s.Honours()
	}
	if p.Runners.GPUs != nil {
		honours = append(honours, dynamic.KeyGPUs, dynamic.KeyGPU)
		p.Runners.ShapeGPUs = slices.Clone(w.Dynamic.GPUs)
	}
	for _, k := range w.Dynamic.Keys() {
		if !slices.Contains(honours, k) {
			if len(honours) == 0 {
				honours = []string{"none"}
			}
			return Plan{}, fmt.Errorf("dynamic.%s: provider %s cannot give a runner what a job asks for in %s= (it can: %s)", k, w.Provider, k, strings.Join(honours, ", "))
		}
	}
	return p, nil
}

// poolLabels are the pool's labels and, with hardware labels, those its
// provider gives every machine of the pool (provider.Labeler).
func poolLabels(w Want, prov provider.Provider) []string {
	l, ok := prov.(provider.Labeler)
	if !ok || !w.HardwareLabels {
		return slices.Clone(w.Labels)
	}
	return union(w.Labels, l.HardwareLabels())
}

// fitGPUs gives the pool's runners this host's GPUs, where its provider
// hands them out, and sizes a pool whose size comes from its GPUs. A
// provider whose backend gives machines GPUs of its own (Slurm's gres) is
// told of them in its PoolConfig, and the host's are not read.
func (p *Plan) fitGPUs(h *Host, w Want, t provider.Traits) error {
	switch {
	case w.GPUsPerRunner == 0:
		return nil
	case t.SchedulesGPUs && w.SizeFromGPUs && w.Max == 0:
		return fmt.Errorf("max: not given, and provider %s gives runners GPUs of its own nodes, which this host cannot count: give max, the most runners at once (size is 0: runners start as jobs queue)", w.Provider)
	case t.SchedulesGPUs && w.SizeFromGPUs:
		// No idle runner holds a cluster's GPUs, and burns its
		// account's GPU-hours, unless the pool asks for one.
		p.Size = 0
		return nil
	case t.SchedulesGPUs:
		return nil
	case !t.HostGPUs:
		return fmt.Errorf("gpus_per_runner: provider %s cannot give runners this host's GPUs", w.Provider)
	}
	per := w.GPUsPerRunner
	inv, alloc := h.detect()
	units := alloc.Len()
	switch {
	case units == 0:
		return fmt.Errorf("gpus_per_runner: %s, and this host has no GPU (%s)", count(per), inv.Reason)
	case per > units:
		return fmt.Errorf("gpus_per_runner: %d, and this host has %d GPUs", per, units)
	}
	fit := 1 // runners the GPUs allow at once
	if per > 0 {
		fit = units / per
	}
	switch {
	case w.SizeFromGPUs:
		p.Size, p.Max = fit, max(p.Max, fit)
		h.log().Info("pool sized by its GPUs", "pool", w.Pool, "size", p.Size, "gpus_per_runner", count(per))
	case p.Max > fit:
		h.log().Warn("the pool asks for more runners than the GPUs allow; it runs at most what they allow", "pool", w.Pool, "max", p.Max, "runners_the_gpus_allow", fit)
	}
	p.Runners.GPUs, p.Runners.PerRunner = alloc, per
	p.Runners.CUDA, p.Runners.HardwareLabels = inv.CUDA, w.HardwareLabels
	return nil
}

func count(per int) string {
	if per < 0 {
		return "all"
	}
	return strconv.Itoa(per)
}

// union is a with the labels of b it lacks, in order.
func union(a []string, b ...[]string) []string {
	out := slices.Clone(a)
	for _, bs := range b {
		for _, l := range bs {
			if !slices.Contains(out, l) {
				out = append(out, l)
			}
		}
	}
	return out
}
