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

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Bursts in one call (vm.Batcher): EC2 meters RunInstances by a bucket
// of 5 requests refilled 2 a second, so a hundred calls take some 48 s
// where one RunInstances (MinCount 1, MaxCount N) takes one request token
// and a hundred of the resource bucket's 1,000 (EC2 API reference,
// "Request throttling"). One request's tags are every instance's, so each
// instance gets its runner's name with a CreateTags of its own, and until
// then the provider knows it by what it launched (names).

// MaxBatch is the most instances one RunInstances asks for.
const MaxBatch = 100

// launchBatch asks for the batch's instances, placement by placement:
// what one type and subnet could not hold is asked of the next, and what
// none could is answered with why.
func (p *Provider) launchBatch(batch []*vm.Request, spot, fallback bool) {
	s := p.opt.Section
	// The batch's callers wait for it; each call has its own deadline.
	ctx := context.Background()
	fail := func(rest []*vm.Request, err error) {
		for _, r := range rest {
			r.Done(provider.Instance{}, err)
		}
	}
	ud, err := userData(s, p.handoff(), batch[0].Spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	if err != nil {
		fail(batch, fmt.Errorf("%w: %w", provider.ErrRejected, err))
		return
	}
	markets := []bool{spot}
	if spot && fallback {
		markets = append(markets, false)
	}
	rest := batch
	var tried []string
	for _, spot := range markets {
		for _, typ := range orEmpty(s.InstanceTypes) {
			for _, subnet := range orEmpty(s.Subnets) {
				for _, r := range rest {
					vm.Placed(r.Spec, s.Image, typ, "", spot)
				}
				in := p.runInput(rest[0].Spec, ud, typ, subnet, spot)
				in.MaxCount, in.TagSpecifications = awssdk.Int32(int32(len(rest))), poolTags(in.TagSpecifications)
				out, err := p.opt.API.RunInstances(ctx, in)
				if err != nil {
					kind, code := kindOf(err)
					switch kind {
					case errCapacity:
						tried = append(tried, fmt.Sprintf("%s %s in %s: %s", market(spot), or(typ, "the template's type"), or(subnet, "the default subnet"), code))
						p.opt.Logger.Info("no capacity; trying the next", "runners", len(rest), "type", typ, "subnet", subnet, "market", market(spot), "code", code)
						continue
					case errFatal:
						fail(rest, rejected(fmt.Errorf("run instances: %w", err)))
					case errThrottle:
						fail(rest, fmt.Errorf("run instances: EC2 throttled the request after retries: %w", err))
					default:
						fail(rest, fmt.Errorf("run instances: %w", err))
					}
					return
				}
				got := out.Instances[:min(len(out.Instances), len(rest))]
				p.opt.Logger.Info("instances launched", "asked", len(rest), "launched", len(got), "type", typ, "subnet", subnet, "market", market(spot))
				var wg sync.WaitGroup
				for i, ei := range got {
					r := rest[i]
					inst := p.instance(ei)
					inst.Name, inst.Manager, inst.Pool = r.Spec.Name, r.Spec.Manager, r.Spec.Pool
					p.mu.Lock()
					p.launched[inst.ID] = inst
					p.names[inst.ID] = r.Spec.Name
					p.mu.Unlock()
					wg.Go(func() { r.Done(inst, p.name(ctx, inst, awssdk.ToString(out.OwnerId), r.Spec)) })
				}
				wg.Wait()
				if rest = rest[len(got):]; len(rest) == 0 {
					return
				}
				tried = append(tried, fmt.Sprintf("%s %s in %s: %d of %d", market(spot), or(typ, "the template's type"), or(subnet, "the default subnet"), len(got), len(got)+len(rest)))
			}
		}
	}
	why := "no capacity: " + strings.Join(tried, "; ")
	if s.Spot && s.SpotFallback != FallbackOnDemand {
		why += " (spot_fallback: on_demand would start an on-demand instance)"
	}
	fail(rest, errors.New(why))
}

// poolTags drops the runner's tags from a request's: they name one
// runner, and a batch's instances are each another's.
func poolTags(specs []types.TagSpecification) []types.TagSpecification {
	out := make([]types.TagSpecification, 0, len(specs))
	for _, ts := range specs {
		var tags []types.Tag
		for _, t := range ts.Tags {
			if k := awssdk.ToString(t.Key); k != TagRunner && k != "Name" {
				tags = append(tags, t)
			}
		}
		out = append(out, types.TagSpecification{ResourceType: ts.ResourceType, Tags: tags})
	}
	return out
}

// name gives a batch's instance its runner: its tags, then its
// assignment. Where either fails, the instance is terminated.
func (p *Provider) name(ctx context.Context, inst provider.Instance, account string, spec provider.Spec) error {
	_, err := p.opt.API.CreateTags(ctx, &ec2.CreateTagsInput{Resources: []string{inst.ID}, Tags: []types.Tag{
		{Key: awssdk.String(TagRunner), Value: awssdk.String(spec.Name)},
		{Key: awssdk.String("Name"), Value: awssdk.String(spec.Name)},
	}})
	if err != nil {
		return p.abandon(ctx, inst.ID, fmt.Errorf("tag instance %s with its runner %s: %w", inst.ID, spec.Name, err))
	}
	return p.handOver(ctx, inst, account, spec)
}
