package aws

import (
	"context"
	"fmt"
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

// launchBatch asks for the batch's instances, placement by placement
// (vm.Placement): what one type and subnet could not hold is asked of the
// next, and what none could is answered with why.
func (p *Provider) launchBatch(batch []*vm.Request, spot, fallback bool) {
	// The batch's callers wait for it; each call has its own deadline.
	ctx := context.Background()
	ud, err := userData(p.opt.Section, p.handoff(), batch[0].Spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	if err != nil {
		vm.Fail(batch, provider.Rejected(err))
		return
	}
	// A batch's runners ask for one size (vm.Batcher.Size).
	choices, err := p.catalogue.TypesFor(ctx, batch[0].Spec.Request)
	if err != nil {
		vm.Fail(batch, err)
		return
	}
	vm.TryBatch(p.placement(spot, fallback, choices, "run instances"), batch, func(rest []*vm.Request, spot bool, typ, subnet string) ([]*vm.Request, error) {
		return p.runBatch(ctx, rest, ud, typ, subnet, spot)
	})
}

// runBatch asks one type and subnet for the batch's instances (MinCount
// 1) and answers those EC2 launched, each once it is named; it returns
// those it did not launch. An error leaves every request unanswered.
func (p *Provider) runBatch(ctx context.Context, batch []*vm.Request, ud []byte, typ, subnet string, spot bool) ([]*vm.Request, error) {
	for _, r := range batch {
		vm.Placed(r.Spec, p.opt.Section.Image, typ, "", spot)
	}
	in := p.runInput(batch[0].Spec, ud, typ, subnet, spot)
	in.MaxCount, in.TagSpecifications = awssdk.Int32(int32(len(batch))), poolTags(in.TagSpecifications)
	out, err := p.opt.API.RunInstances(ctx, in)
	if err != nil {
		return batch, err
	}
	got := out.Instances[:min(len(out.Instances), len(batch))]
	p.opt.Logger.Info("instances launched", "asked", len(batch), "launched", len(got), "type", typ, "subnet", subnet, "market", market(spot))
	var wg sync.WaitGroup
	for i, ei := range got {
		r := batch[i]
		inst := p.instance(ei)
		inst.Name, inst.Manager, inst.Pool = r.Spec.Name, r.Spec.Manager, r.Spec.Pool
		p.mu.Lock()
		p.names[inst.ID] = r.Spec.Name
		p.mu.Unlock()
		p.book.Launched(seenInstance{Inst: inst, Data: spot})
		wg.Go(func() { r.Done(inst, p.name(ctx, inst, awssdk.ToString(out.OwnerId), r.Spec)) })
	}
	wg.Wait()
	return batch[len(got):], nil
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
