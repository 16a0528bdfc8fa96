package aws

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// What a dynamic pool's job may ask of its instance's size (cpu=, mem=,
// gpus=, gpu=) is met by choosing among the pool's instance_types those
// that have it, the smallest first (vm.Fit), from what EC2 says of each
// type: DescribeInstanceTypes, read once for the pool's types.

// catalogue reads the pool's types once; a failed read is not kept.
type catalogue struct {
	mu    sync.Mutex
	sizes []vm.Size
}

// sizes is what each of the pool's instance types has, in the pool's
// order.
func (p *Provider) sizes(ctx context.Context) ([]vm.Size, error) {
	c := &p.catalogue
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sizes != nil {
		return c.sizes, nil
	}
	types := p.opt.Section.InstanceTypes
	by := map[string]vm.Size{}
	pages := ec2.NewDescribeInstanceTypesPaginator(p.opt.API, &ec2.DescribeInstanceTypesInput{InstanceTypes: toTypes(types)})
	for pages.HasMorePages() {
		out, err := pages.NextPage(ctx)
		if err != nil {
			if kind, _ := kindOf(err); kind == errRefused || kind == errFatal {
				return nil, provider.Rejected(fmt.Errorf("describe instance types %s: %w", strings.Join(types, ", "), err))
			}
			return nil, fmt.Errorf("describe instance types: %w", err)
		}
		for _, t := range out.InstanceTypes {
			s := vm.Size{Type: string(t.InstanceType)}
			if t.VCpuInfo != nil {
				s.CPUs = float64(awssdk.ToInt32(t.VCpuInfo.DefaultVCpus))
			}
			if t.MemoryInfo != nil {
				s.Memory = awssdk.ToInt64(t.MemoryInfo.SizeInMiB) << 20
			}
			if t.GpuInfo != nil {
				for _, g := range t.GpuInfo.Gpus {
					s.GPUs += int(awssdk.ToInt32(g.Count))
					s.GPU = gpu.Model(awssdk.ToString(g.Manufacturer) + " " + awssdk.ToString(g.Name))
				}
			}
			by[s.Type] = s
		}
	}
	out := make([]vm.Size, 0, len(types))
	for _, t := range types {
		s, ok := by[t]
		if !ok {
			return nil, provider.Rejected(fmt.Errorf("describe instance types: EC2 says nothing of %s", t))
		}
		out = append(out, s)
	}
	c.sizes = out
	return out, nil
}

// typesFor is the pool's instance types that have what a runner's job
// asks of its size, the smallest first; the pool's, in order, for a job
// that asks for none. None that fits is refused: the job's shape waits.
func (p *Provider) typesFor(ctx context.Context, r dynamic.Request) ([]string, error) {
	if !vm.Sized(r) {
		return p.opt.Section.InstanceTypes, nil
	}
	sizes, err := p.sizes(ctx)
	if err != nil {
		return nil, err
	}
	types, err := vm.Fit(sizes, r)
	if err != nil {
		return nil, provider.Rejected(err)
	}
	return types, nil
}

// sizeKey is what a runner's job asks of its size, so that the runners
// of one size launch together (vm.Batcher.Size).
func sizeKey(spec provider.Spec) string {
	r := spec.Request
	return fmt.Sprintf("%g/%d/%d/%s", r.CPUs, r.Memory, r.GPUs, r.GPU)
}

// CheckShapes refuses at start a dynamic pool whose limits let a job ask
// for GPUs that none of its instance types has (provider.ShapeChecker):
// each count it allows, of each model it allows. Where EC2 cannot be read
// now, nothing is refused: the job's own start says.
func (p *Provider) CheckShapes(ctx context.Context, l dynamic.Limits) error {
	if len(l.GPUs) == 0 && len(l.GPU) == 0 {
		return nil
	}
	sizes, err := p.sizes(ctx)
	switch {
	case errors.Is(err, provider.ErrRejected):
		return fmt.Errorf("dynamic: %w", err)
	case err != nil:
		p.opt.Logger.Warn("could not read the pool's instance types; jobs that ask for GPUs are checked as they start", "err", err)
		return nil
	}
	// Each count a job may ask, of some model it may ask, and each model.
	for _, n := range l.GPUs {
		if _, err := vm.Fit(sizes, dynamic.Request{GPUs: n}); err != nil {
			return fmt.Errorf("dynamic: a job may ask gpus=%d, and %w", n, err)
		}
	}
	for _, m := range l.GPU {
		if _, err := vm.Fit(sizes, dynamic.Request{GPU: m}); err != nil {
			return fmt.Errorf("dynamic: a job may ask gpu=%s, and %w", m, err)
		}
	}
	return nil
}

func toTypes(names []string) []types.InstanceType {
	out := make([]types.InstanceType, len(names))
	for i, n := range names {
		out[i] = types.InstanceType(n)
	}
	return out
}
