package slurm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/provider"
)

// What a job of a dynamic pool may choose of its runner's Slurm job, as
// Jacamar CI's SCHEDULER_PARAMETERS lets a GitLab job choose sbatch's
// options, but each within the pool's list (its dynamic section) rather
// than any option at all: a job cannot pick a partition, an account or a
// reservation the pool did not name.

// Honours says what a job of a dynamic pool may ask its Slurm job to be:
// its GPUs (how many, which gres type), CPUs and memory, its partition, a
// node feature (--constraint) and its own time.
func (p *Provider) Honours() []string {
	return []string{dynamic.KeyGPUs, dynamic.KeyGPU, dynamic.KeyCPU, dynamic.KeyMem,
		dynamic.KeyPartition, dynamic.KeyConstraint, dynamic.KeyTime}
}

// section is the pool's section with what a job asked for in its stead.
func (p *Provider) section(req dynamic.Request) Section {
	s := p.opt.Section
	if req.CPUs > 0 {
		s.CPUs = int(math.Ceil(req.CPUs))
	}
	if req.Memory > 0 {
		s.Memory = strconv.FormatInt((req.Memory+1<<20-1)>>20, 10) + "M"
	}
	if req.GPU != "" {
		s.GPUType = req.GPU
	}
	if req.Partition != "" {
		s.Partition = req.Partition
	}
	if req.Constraint != "" {
		s.Constraint = req.Constraint
	}
	if req.Time > 0 {
		// The job's own time replaces the pool's fixed one.
		s.TimeLimit = config.Duration{}
	}
	return s
}

// timesFor is the fit of a runner's job in its partition: the pool's,
// unless its job chose a partition or said how long it runs. Such a runner
// is started for that job, so it waits idle for no longer than the pool's
// idle_timeout. A request that cannot fit is refused (ErrRejected) with
// both figures.
func (p *Provider) timesFor(ctx context.Context, req dynamic.Request) (times, error) {
	if req.Partition == "" && req.Time == 0 {
		return p.times, nil
	}
	sec := p.section(req)
	b, err := p.bound(ctx, sec.Partition)
	if err != nil {
		return times{}, err
	}
	idle := cmp.Or(p.opt.IdleTimeout, 10*time.Minute)
	t, err := fit(sec, idle, cmp.Or(req.Time, p.opt.JobTimeout), b)
	if err != nil {
		return times{}, provider.Rejected(err)
	}
	return t, nil
}

// bound reads the limits of a job in the named partition with the pool's
// QOS: the partition's and those of its QOS and the pool's.
func (p *Provider) bound(ctx context.Context, partition string) (bound, error) {
	part, err := p.partition(ctx, partition)
	if err != nil {
		return bound{}, err
	}
	return p.boundIn(ctx, part)
}

// boundIn is bound for a partition read.
func (p *Provider) boundIn(ctx context.Context, part Partition) (bound, error) {
	partQOS, err := p.qos(ctx, part.QOS)
	if err != nil {
		return bound{}, fmt.Errorf("partition %s's QOS: %w", part.Name, err)
	}
	jobQOS, err := p.qos(ctx, p.opt.Section.QOS)
	if err != nil {
		return bound{}, fmt.Errorf("slurm.qos: %w", err)
	}
	return boundOf(part, partQOS, jobQOS), nil
}

// qos reads a QOS's limits once. A cluster without accounting (or with
// slurmdbd down) has none to read. The QOS a job gets without one named
// (its association's default) is not read.
func (p *Provider) qos(ctx context.Context, name string) (QOS, error) {
	r, ok := p.opt.Cluster.(QOSReader)
	if !ok || name == "" {
		return QOS{Name: name}, nil
	}
	return readOnce(p, p.qoses, "qos", name, QOS{Name: name}, func() (QOS, error) { return r.QOS(ctx, name) })
}

// partition reads a partition's limits once.
func (p *Provider) partition(ctx context.Context, name string) (Partition, error) {
	r, ok := p.opt.Cluster.(PartitionReader)
	if !ok {
		return Partition{Name: name}, nil
	}
	return readOnce(p, p.parts, "partition", name, Partition{Name: name}, func() (Partition, error) { return r.Partition(ctx, name) })
}

// readOnce returns the limits kept of name, or reads and keeps them. A
// refusal (one the cluster lacks) is returned; where the cluster does not
// answer, none are known (unknown, not kept) and sbatch will say if the
// job does not fit.
func readOnce[T any](p *Provider, kept map[string]T, what, name string, unknown T, read func() (T, error)) (T, error) {
	p.mu.Lock()
	got, ok := kept[name]
	p.mu.Unlock()
	if ok {
		return got, nil
	}
	got, err := read()
	switch {
	case errors.Is(err, provider.ErrRejected):
		var none T
		return none, err
	case err != nil:
		p.log.Warn("could not read the limits of a "+what, what, name, "error", err)
		return unknown, nil
	}
	p.mu.Lock()
	kept[name] = got
	p.mu.Unlock()
	return got, nil
}

// CheckShapes refuses, at start, a dynamic section whose partitions the
// cluster does not have, or in which the longest job a job may ask for
// (time, or job_timeout) cannot fit (provider.ShapeChecker).
func (p *Provider) CheckShapes(ctx context.Context, l dynamic.Limits) error {
	parts, field := l.Partition, "dynamic.partition"
	switch {
	case len(parts) == 0 && l.MaxTime() == 0:
		return nil // the pool's own fit, checked at New
	case len(parts) == 0:
		parts, field = []string{p.opt.Section.Partition}, "dynamic.time"
	}
	longest := cmp.Or(l.MaxTime(), p.opt.JobTimeout)
	var errs []error
	for _, name := range parts {
		if _, err := p.timesFor(ctx, dynamic.Request{Partition: name, Time: longest}); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", field, err))
		}
	}
	return errors.Join(errs...)
}
