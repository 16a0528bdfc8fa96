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

// Bursts in one call. Where the handoff keeps every runner's credential
// out of the user data, the user data is the pool's, and the runners the
// pool asks for together go out in one RunInstances (MinCount 1, MaxCount
// N): EC2 meters RunInstances by a bucket of 5 requests refilled 2 a
// second, so a hundred calls take some 48 s where one takes one request
// token and a hundred of the resource bucket's 1,000 (EC2 API reference,
// "Request throttling"). The pool calls Create for each runner at once;
// the Creates that arrive while a launch is under way (or waits its
// turn) form the next one. One request's tags are every instance's, so
// each instance gets its runner's name with a CreateTags of its own, and
// until then the provider knows it by what it launched (names).

// MaxBatch is the most instances one RunInstances asks for.
const MaxBatch = 100

// launcher gathers the Creates that wait for a launch.
type launcher struct {
	mu      sync.Mutex
	waiting []*launchReq
	busy    bool
}

type launchReq struct {
	ctx  context.Context
	spec provider.Spec
	done chan launchResult
}

type launchResult struct {
	inst provider.Instance
	err  error
}

// launch starts the runner's instance with the others asked for at the
// same time.
func (p *Provider) launch(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	r := &launchReq{ctx: ctx, spec: spec, done: make(chan launchResult, 1)}
	l := &p.batch
	l.mu.Lock()
	l.waiting = append(l.waiting, r)
	start := !l.busy
	l.busy = true
	l.mu.Unlock()
	if start {
		go p.launchWaiting()
	}
	res := <-r.done
	return res.inst, res.err
}

// launchWaiting launches what waits, a batch at a time, until nothing
// does.
func (p *Provider) launchWaiting() {
	l := &p.batch
	for {
		l.mu.Lock()
		batch := l.waiting[:min(len(l.waiting), MaxBatch)]
		l.waiting = l.waiting[len(batch):]
		if len(batch) == 0 {
			l.busy = false
			l.mu.Unlock()
			return
		}
		l.mu.Unlock()
		// A runner's market is the pool's or its job's (spot=): one
		// launch per market.
		groups := map[[2]bool][]*launchReq{}
		var order [][2]bool
		for _, r := range batch {
			if err := r.ctx.Err(); err != nil {
				r.done <- launchResult{err: err}
				continue
			}
			s := p.opt.Section
			spot, fallback := vm.Market(s.Spot, s.SpotFallback == FallbackOnDemand, r.spec.Request.Spot)
			k := [2]bool{spot, fallback}
			if groups[k] == nil {
				order = append(order, k)
			}
			groups[k] = append(groups[k], r)
		}
		for _, k := range order {
			p.launchBatch(groups[k], k[0], k[1])
		}
	}
}

// launchBatch asks for the batch's instances, placement by placement:
// what one type and subnet could not hold is asked of the next, and what
// none could is answered with why.
func (p *Provider) launchBatch(batch []*launchReq, spot, fallback bool) {
	s := p.opt.Section
	// The batch's callers wait for it; each call has its own deadline.
	ctx := context.Background()
	fail := func(rest []*launchReq, err error) {
		for _, r := range rest {
			r.done <- launchResult{err: err}
		}
	}
	ud, err := userData(s, p.handoff(), batch[0].spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
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
					vm.Placed(r.spec, s.Image, typ, "", spot)
				}
				in := p.runInput(rest[0].spec, ud, typ, subnet, spot)
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
					inst.Name, inst.Manager, inst.Pool = r.spec.Name, r.spec.Manager, r.spec.Pool
					p.mu.Lock()
					p.launched[inst.ID] = inst
					p.names[inst.ID] = r.spec.Name
					p.mu.Unlock()
					wg.Go(func() { r.done <- launchResult{inst, p.name(ctx, inst, awssdk.ToString(out.OwnerId), r.spec)} })
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
