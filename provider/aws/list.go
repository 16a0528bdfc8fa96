package aws

import (
	"context"
	"fmt"
	"slices"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/record"
)

// terminated is the Reason of an instance that EC2 lists as terminated.
const terminated = "terminated"

// Limits keeps a manager's calls within EC2's documented request rates
// (the API reference's "Request throttling"), which hold per account and
// region: RunInstances' bucket holds 5 requests and refills 2 a second,
// TerminateInstances' 100 and 5, CreateTags' 100 and 10 (a batch's
// instances are named one call each), a mutating action's (DeleteVolume)
// 200 and 5. Pools of one region share them. Each
// attempt waits for a token, the SDK's retries too, and the refill is 5%
// under EC2's, so that requests bunched on the way (EC2 counts them as
// they arrive) are not throttled.
//
// Parameter Store's PutParameter, with which the handoff stores each
// runner's assignment, shares its default throughput of 40 a second with
// GetParameter, which the instances call (Parameter Store's
// "throughput" page); the manager keeps to 30 of them.
type Limits struct {
	run, terminate, mutate, tags, params *rate.Limiter
}

// NewLimits is EC2's default rates.
func NewLimits() *Limits {
	return &Limits{run: rate.NewLimiter(2*0.95, 5), terminate: rate.NewLimiter(5*0.95, 100), mutate: rate.NewLimiter(5*0.95, 200),
		tags: rate.NewLimiter(10*0.95, 100), params: rate.NewLimiter(30, 30)}
}

// limiter is the limiter of an operation, nil for one EC2 meters
// generously (describes: a bucket of 100 refilled 20 a second).
func (l *Limits) limiter(op string) *rate.Limiter {
	switch op {
	case "RunInstances":
		return l.run
	case "TerminateInstances":
		return l.terminate
	case "DeleteVolume":
		return l.mutate
	case "CreateTags":
		return l.tags
	case "PutParameter":
		return l.params
	}
	return nil
}

// sharedLimits are the limits the pools of one region and endpoint share.
var sharedLimits = vm.Shared[*Limits]{New: NewLimits}

// List returns the instances of a manager: the pool's from the last
// describe (at most a poll interval old) and the ones launched since,
// less the ones terminated here. Another manager's are described.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	if manager != p.opt.Manager {
		found, err := p.describe(ctx, manager, p.opt.Pool, "")
		var out []provider.Instance
		for _, si := range found {
			if si.Inst.Reason != terminated {
				out = append(out, si.Inst)
			}
		}
		return out, err
	}
	if p.book.Stale(p.opt.now(), p.opt.Section.PollInterval.Duration) {
		if err := p.refresh(ctx); err != nil {
			return nil, err
		}
	}
	return p.view(), nil
}

// view is what was described and launched since, less what was
// terminated here, and less what EC2 lists terminated.
func (p *Provider) view() []provider.Instance {
	return slices.DeleteFunc(p.book.Instances(), func(i provider.Instance) bool { return i.Reason == terminated })
}

// refresh describes the pool's instances, and reports what changed.
func (p *Provider) refresh(ctx context.Context) error {
	p.fresh.Lock()
	defer p.fresh.Unlock()
	start := p.opt.now()
	found, err := p.describe(ctx, p.opt.Manager, p.opt.Pool, "")
	if err != nil {
		return err
	}
	p.mu.Lock()
	for i, si := range found {
		// A batch's instance is described before its runner's tag:
		// named by what was launched.
		if n, ok := p.names[si.Inst.ID]; ok && si.Inst.Name == si.Inst.ID {
			found[i].Inst.Name = n
		} else {
			delete(p.names, si.Inst.ID)
		}
	}
	p.mu.Unlock()
	changed, known := p.book.Update(found, start, nil)
	// Notices forgotten once an instance is gone two describes running.
	p.watch.Forget(known)
	p.watch.Changed(changed)
	return nil
}

// describe lists a manager's instances (of one pool, one runner when
// given), all pages, terminated ones included (with Reason terminated).
func (p *Provider) describe(ctx context.Context, manager, pool, runner string) ([]seenInstance, error) {
	filters := []types.Filter{{Name: awssdk.String("tag:" + TagManager), Values: []string{manager}}}
	if pool != "" {
		filters = append(filters, types.Filter{Name: awssdk.String("tag:" + TagPool), Values: []string{pool}})
	}
	if runner != "" {
		filters = append(filters, types.Filter{Name: awssdk.String("tag:" + TagRunner), Values: []string{runner}})
	}
	pages := ec2.NewDescribeInstancesPaginator(p.opt.API, &ec2.DescribeInstancesInput{Filters: filters, MaxResults: awssdk.Int32(1000)})
	var out []seenInstance
	for pages.HasMorePages() {
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		page, err := pages.NextPage(cctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("describe instances: %w", err)
		}
		for _, r := range page.Reservations {
			for _, i := range r.Instances {
				out = append(out, seenInstance{Inst: p.instance(i), Data: i.InstanceLifecycle == types.InstanceLifecycleTypeSpot})
			}
		}
	}
	return out, nil
}

// instance maps EC2's instance: pending is coming up (so the bootstrap
// timeout applies), running runs, and anything shutting down or stopped
// has ended.
func (p *Provider) instance(i types.Instance) provider.Instance {
	inst := provider.Instance{ID: awssdk.ToString(i.InstanceId), Created: awssdk.ToTime(i.LaunchTime)}
	if inst.Created.IsZero() {
		inst.Created = p.opt.now()
	}
	inst.Machine = record.Machine{ID: inst.ID, InstanceType: string(i.InstanceType), Spot: i.InstanceLifecycle == types.InstanceLifecycleTypeSpot}
	if i.Placement != nil {
		inst.Machine.Zone = awssdk.ToString(i.Placement.AvailabilityZone)
	}
	for _, t := range i.Tags {
		switch awssdk.ToString(t.Key) {
		case TagManager:
			inst.Manager = awssdk.ToString(t.Value)
		case TagPool:
			inst.Pool = awssdk.ToString(t.Value)
		case TagRunner:
			inst.Name = awssdk.ToString(t.Value)
		}
	}
	if inst.Name == "" {
		// Not tagged with its runner (yet): known by its id.
		inst.Name = inst.ID
	}
	var state types.InstanceStateName
	if i.State != nil {
		state = i.State.Name
	}
	switch state {
	case types.InstanceStateNamePending:
		inst.State = provider.StateCreated
	case types.InstanceStateNameRunning:
		inst.State = provider.StateRunning
	default:
		inst.State = provider.StateExited
		inst.Reason = string(state)
		if i.StateReason != nil && state != types.InstanceStateNameTerminated {
			inst.Reason += ": " + awssdk.ToString(i.StateReason.Message)
		}
	}
	return inst
}

// Watch reports changes found by the poller, which it starts.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) { p.watch.Watch(ctx, changed) }

// WatchPreemption reports spot instances whose requests EC2 marked for
// termination, stop or hibernation: the two-minute interruption notice.
func (p *Provider) WatchPreemption(ctx context.Context, notice func(provider.Notice)) {
	p.watch.WatchPreemption(ctx, notice)
}

// poll describes the pool's instances, and its spot requests while it
// has spot instances.
func (p *Provider) poll(ctx context.Context) error {
	if err := p.refresh(ctx); err != nil {
		return err
	}
	return p.spotNotices(ctx)
}

// interruptCodes are the spot request status codes of an interruption
// notice.
var interruptCodes = map[string]bool{"marked-for-termination": true, "marked-for-stop": true, "marked-for-hibernation": true}

// spotNotices reads the spot requests of the pool's live spot instances.
func (p *Provider) spotNotices(ctx context.Context) error {
	var ids []string
	names := map[string]string{}
	for _, si := range p.book.View() {
		if id := si.Inst.ID; si.Data && si.Inst.State != provider.StateExited && !p.watch.Noticed(id) {
			ids = append(ids, id)
			names[id] = si.Inst.Name
		}
	}
	for len(ids) > 0 {
		chunk := ids[:min(len(ids), 200)]
		ids = ids[len(chunk):]
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		out, err := p.opt.API.DescribeSpotInstanceRequests(cctx, &ec2.DescribeSpotInstanceRequestsInput{
			Filters: []types.Filter{{Name: awssdk.String("instance-id"), Values: chunk}},
		})
		cancel()
		if err != nil {
			return fmt.Errorf("describe spot requests: %w", err)
		}
		for _, r := range out.SpotInstanceRequests {
			if r.Status == nil || !interruptCodes[awssdk.ToString(r.Status.Code)] {
				continue
			}
			p.watch.Notify(provider.Notice{
				Name: names[awssdk.ToString(r.InstanceId)], ID: awssdk.ToString(r.InstanceId),
				At:     awssdk.ToTime(r.Status.UpdateTime).Add(2 * time.Minute),
				Reason: "spot interruption: " + awssdk.ToString(r.Status.Code),
			}, "spot interruption notice")
		}
	}
	return nil
}
