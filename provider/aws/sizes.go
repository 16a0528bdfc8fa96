package aws

import (
	"context"
	"fmt"
	"strings"

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

// readSizes is what EC2 says of each of the pool's types
// (vm.Catalogue.Read).
func (p *Provider) readSizes(ctx context.Context, types []string) ([]vm.Size, error) {
	var out []vm.Size
	pages := ec2.NewDescribeInstanceTypesPaginator(p.opt.API, &ec2.DescribeInstanceTypesInput{InstanceTypes: toTypes(types)})
	for pages.HasMorePages() {
		page, err := pages.NextPage(ctx)
		if err != nil {
			if kind, _ := kindOf(err); kind == errRefused || kind == errFatal {
				return nil, provider.Rejected(fmt.Errorf("describe instance types %s: %w", strings.Join(types, ", "), err))
			}
			return nil, fmt.Errorf("describe instance types: %w", err)
		}
		for _, t := range page.InstanceTypes {
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
			out = append(out, s)
		}
	}
	return out, nil
}

// CheckShapes refuses at start a dynamic pool whose limits let a job ask
// for GPUs that none of its instance types has (provider.ShapeChecker).
func (p *Provider) CheckShapes(ctx context.Context, l dynamic.Limits) error {
	return p.catalogue.Check(ctx, l, p.opt.Logger)
}

func toTypes(names []string) []types.InstanceType {
	out := make([]types.InstanceType, len(names))
	for i, n := range names {
		out[i] = types.InstanceType(n)
	}
	return out
}
