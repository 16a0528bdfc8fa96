// Package aws runs runners on EC2 instances, one instance per runner,
// spot or on-demand, through aws-sdk-go-v2. Each instance is tagged with
// the manager id, pool and runner name when it is made (so no untagged
// instance ever exists), runs the runner's plan from its user data with
// `runfleet agent` (package bootstrap), and terminates itself when the
// agent ends, when no job came within the idle timeout, or at its
// deadline, also when the manager is gone.
//
// The pool's instances are described every poll interval (one call for
// the pool, not one per runner); spot requests marked for termination
// are reported as preemption notices.
package aws

import (
	"context"
	"crypto/rsa"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Tags every instance (and its volumes and spot request) carries.
const (
	TagManager = "runfleet:manager"
	TagPool    = "runfleet:pool"
	TagRunner  = "runfleet:runner"
)

// CallTimeout bounds each request to EC2: each attempt of a call (the
// client's timeout), and each describe as a whole.
var CallTimeout = 30 * time.Second

// API is what the provider calls of EC2 (*ec2.Client).
type API interface {
	RunInstances(context.Context, *ec2.RunInstancesInput, ...func(*ec2.Options)) (*ec2.RunInstancesOutput, error)
	DescribeInstances(context.Context, *ec2.DescribeInstancesInput, ...func(*ec2.Options)) (*ec2.DescribeInstancesOutput, error)
	TerminateInstances(context.Context, *ec2.TerminateInstancesInput, ...func(*ec2.Options)) (*ec2.TerminateInstancesOutput, error)
	CreateTags(context.Context, *ec2.CreateTagsInput, ...func(*ec2.Options)) (*ec2.CreateTagsOutput, error)
	DescribeSpotInstanceRequests(context.Context, *ec2.DescribeSpotInstanceRequestsInput, ...func(*ec2.Options)) (*ec2.DescribeSpotInstanceRequestsOutput, error)
	DescribeVolumes(context.Context, *ec2.DescribeVolumesInput, ...func(*ec2.Options)) (*ec2.DescribeVolumesOutput, error)
	DeleteVolume(context.Context, *ec2.DeleteVolumeInput, ...func(*ec2.Options)) (*ec2.DeleteVolumeOutput, error)
	DescribeInstanceTypes(context.Context, *ec2.DescribeInstanceTypesInput, ...func(*ec2.Options)) (*ec2.DescribeInstanceTypesOutput, error)
	DescribeSpotPriceHistory(context.Context, *ec2.DescribeSpotPriceHistoryInput, ...func(*ec2.Options)) (*ec2.DescribeSpotPriceHistoryOutput, error)
}

// Options configure a Provider.
type Options struct {
	API API
	// SSM stores each runner's assignment for its instance, where the
	// pool's instances have an instance profile (handoff.go).
	SSM SSMAPI
	// SSMEndpoint is the one the manager's Parameter Store client uses
	// where it is not the region's (ssm_endpoint, or
	// AWS_ENDPOINT_URL_SSM): the instances use it too.
	SSMEndpoint string
	// Pricing reads on-demand prices from the price list, for the
	// records (price.go); nil leaves on-demand instances unpriced.
	Pricing PricingAPI
	// Region is the pool's (the instances' ARNs name it).
	Region  string
	Manager string
	Pool    string
	Section Section
	// IdleTimeout and Lifetime are the instance side's: an instance
	// powers off when no job came within IdleTimeout, and at Lifetime
	// after it was asked for whatever it runs.
	IdleTimeout, Lifetime time.Duration
	Calls                 *atomic.Int64 // requests sent, when counted
	// IdentityKeys check the identity documents of instances claiming
	// their assignment (Section.HandoffURL): AWS's, from identity_certs.
	IdentityKeys []*rsa.PublicKey
	Logger       *slog.Logger
	now          func() time.Time
}

// Provider is one pool's instances.
type Provider struct {
	opt   Options
	watch vm.Poller
	fresh sync.Mutex // one describe at a time

	book  vm.Book[bool] // the pool's instances, and whether each is spot
	mu    sync.Mutex
	names map[string]string // by id: the runner of a batch's instance, until its tag is described

	batch     vm.Batcher
	desk      *vm.Desk     // assignments waiting for their instances; nil without handoff_url
	catalogue vm.Catalogue // what the pool's instance types have, for jobs that choose their size
}

// seenInstance is an instance, and whether it is spot.
type seenInstance = vm.Entry[bool]

// New makes the provider of one pool; nothing is called until List,
// Create or Watch.
func New(o Options) *Provider {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.now == nil {
		o.now = time.Now
	}
	if o.Calls == nil {
		o.Calls = new(atomic.Int64)
	}
	p := &Provider{opt: o, names: map[string]string{}}
	if u := vm.DeskURL(o.Section.HandoffURL, o.Pool); u != "" {
		p.desk = &vm.Desk{URL: u, Logger: o.Logger, Verify: func(_ context.Context, token, _ string) (string, error) {
			return verifyIdentity(o.IdentityKeys, o.Region, token)
		}}
	}
	p.batch = vm.Batcher{Max: MaxBatch, Launch: p.launchBatch, Market: p.marketOf, Size: vm.SizeKey}
	p.catalogue.Types, p.catalogue.Cloud, p.catalogue.Read = o.Section.InstanceTypes, "EC2", p.readSizes
	p.watch = vm.Poller{Interval: o.Section.PollInterval.Duration, What: "describing instances", Logger: o.Logger, Poll: p.poll}
	return p
}

var (
	_ provider.Provider    = (*Provider)(nil)
	_ provider.Watcher     = (*Provider)(nil)
	_ provider.Pricer      = (*Provider)(nil)
	_ provider.Preempter   = (*Provider)(nil)
	_ provider.Describer   = (*Provider)(nil)
	_ provider.CallCounter = (*Provider)(nil)
	_ provider.Handoffer   = (*Provider)(nil)
)

func (p *Provider) Traits() provider.Traits {
	return provider.Traits{KeepsBootData: true, Preemptible: p.opt.Section.Spot}
}

// Honours says what a job of a dynamic pool may ask: spot=, in a Spot
// pool; cpu=, mem=, gpus= and gpu= where it lists its instance types.
func (p *Provider) Honours() []string {
	return vm.Honours(p.opt.Section.Spot, len(p.opt.Section.InstanceTypes) > 0)
}

func (p *Provider) Calls() int64 { return p.opt.Calls.Load() }

// Close stops the poller. Instances keep running.
func (p *Provider) Close() error {
	p.watch.Stop()
	return nil
}

// Create starts the runner's instance: the first instance type and
// subnet with capacity, spot first when the pool asks for spot, then
// on-demand when its fallback says so.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if inst, ok := p.book.Live(spec.Name); ok {
		return inst, nil
	}
	s := p.opt.Section
	h := p.handoff()
	ud, err := userData(s, h, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	if err != nil {
		return provider.Instance{}, provider.Rejected(err)
	}
	if h != nil {
		if err := p.checkAssignment(spec); err != nil {
			return provider.Instance{}, provider.Rejected(err)
		}
		return p.batch.Do(ctx, spec)
	}
	choices, err := p.catalogue.TypesFor(ctx, spec.Request)
	if err != nil {
		return provider.Instance{}, err
	}
	var made provider.Instance
	spot, fallback := p.marketOf(spec)
	err = p.placement(spot, fallback, choices, "run instance").Try(spec.Name, func(spot bool, typ, subnet string) (err error) {
		if spec.Record != nil {
			// The subnet's zone comes with the instance's listing.
			vm.Placed(spec, s.Image, typ, "", spot)
			if ud, err = userData(s, nil, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime); err != nil {
				return provider.Rejected(err)
			}
		}
		made, err = p.run(ctx, spec, ud, typ, subnet, spot)
		return err
	})
	return made, err
}

// marketOf is the runner's market: the pool's, or its job's (spot=).
func (p *Provider) marketOf(spec provider.Spec) (spot, fallback bool) {
	s := p.opt.Section
	return vm.Market(s.Spot, s.SpotFallback == FallbackOnDemand, spec.Request.Spot)
}

// placement is where a runner's instance is tried, in order: each of the
// instance types (the pool's, or those that fit its job, vm.Catalogue.TypesFor) and
// subnets, or the launch template's and the default.
func (p *Provider) placement(spot, fallback bool, types []string, what string) vm.Placement {
	s := p.opt.Section
	return vm.Placement{
		Spot: spot, Fallback: fallback, Types: orEmpty(types), Places: orEmpty(s.Subnets),
		AnyType: "the template's type", AnyPlace: "the default subnet",
		What: what, Standard: "on-demand", Limit: "EC2's request rate", Judge: judge, Logger: p.opt.Logger,
	}
}

// judge says what an error of RunInstances means: one that no retry
// fixes for this type or subnet is tried at the next (the pool stops if
// all refuse), one that none would take (the account, the AMI, the user
// data) halts the pool at once.
func judge(err error) (vm.Outcome, string, string) {
	if errors.Is(err, provider.ErrRejected) {
		return vm.Halt, "", ""
	}
	switch kind, code := kindOf(err); kind {
	case errCapacity:
		return vm.NoCapacity, code, ""
	case errRefused:
		return vm.Refused, code, err.Error()
	case errFatal:
		return vm.Halt, code, ""
	case errThrottle:
		return vm.Throttled, code, ""
	default:
		return vm.Transient, code, ""
	}
}

func market(spot bool) string {
	if spot {
		return "spot"
	}
	return "on-demand"
}

func orEmpty(s []string) []string {
	if len(s) == 0 {
		return []string{""}
	}
	return s
}

// run asks for one instance.
func (p *Provider) run(ctx context.Context, spec provider.Spec, ud []byte, typ, subnet string, spot bool) (provider.Instance, error) {
	in := p.runInput(spec, ud, typ, subnet, spot)
	// Each attempt has its deadline (the client's timeout); the call as
	// a whole may first wait its turn within EC2's request rate.
	out, err := p.opt.API.RunInstances(ctx, in)
	if err != nil {
		return provider.Instance{}, err
	}
	if len(out.Instances) != 1 {
		return provider.Instance{}, fmt.Errorf("run instance: EC2 returned %d instances for one", len(out.Instances))
	}
	inst := p.instance(out.Instances[0])
	inst.Name, inst.Manager, inst.Pool = spec.Name, spec.Manager, spec.Pool
	p.book.Launched(seenInstance{Inst: inst, Data: spot})
	p.opt.Logger.Info("instance launched", "runner", spec.Name, "id", inst.ID, "type", typ, "subnet", subnet, "market", market(spot))
	return inst, nil
}

// runInput is the RunInstances request: tagged at creation, terminated
// by its own shutdown, metadata through IMDSv2 only.
func (p *Provider) runInput(spec provider.Spec, ud []byte, typ, subnet string, spot bool) *ec2.RunInstancesInput {
	s := p.opt.Section
	tags := []types.Tag{
		{Key: awssdk.String(TagManager), Value: awssdk.String(spec.Manager)},
		{Key: awssdk.String(TagPool), Value: awssdk.String(spec.Pool)},
		{Key: awssdk.String(TagRunner), Value: awssdk.String(spec.Name)},
		{Key: awssdk.String("Name"), Value: awssdk.String(spec.Name)},
	}
	for _, k := range slices.Sorted(maps.Keys(s.Tags)) {
		tags = append(tags, types.Tag{Key: awssdk.String(k), Value: awssdk.String(s.Tags[k])})
	}
	resources := []types.ResourceType{types.ResourceTypeInstance, types.ResourceTypeVolume}
	if spot {
		resources = append(resources, types.ResourceTypeSpotInstancesRequest)
	}
	var specs []types.TagSpecification
	for _, r := range resources {
		specs = append(specs, types.TagSpecification{ResourceType: r, Tags: tags})
	}
	in := &ec2.RunInstancesInput{
		MinCount: awssdk.Int32(1), MaxCount: awssdk.Int32(1),
		UserData:                          awssdk.String(base64.StdEncoding.EncodeToString(ud)),
		TagSpecifications:                 specs,
		InstanceInitiatedShutdownBehavior: types.ShutdownBehaviorTerminate,
		MetadataOptions: &types.InstanceMetadataOptionsRequest{
			HttpTokens: types.HttpTokensStateRequired, HttpEndpoint: types.InstanceMetadataEndpointStateEnabled,
		},
	}
	if s.Image != "" {
		in.ImageId = awssdk.String(s.Image)
	}
	if typ != "" {
		in.InstanceType = types.InstanceType(typ)
	}
	if lt := s.LaunchTemplate; lt.given() {
		in.LaunchTemplate = &types.LaunchTemplateSpecification{Version: nonEmpty(lt.Version)}
		in.LaunchTemplate.LaunchTemplateId, in.LaunchTemplate.LaunchTemplateName = nonEmpty(lt.ID), nonEmpty(lt.Name)
	}
	in.SubnetId = nonEmpty(subnet)
	in.SecurityGroupIds = s.SecurityGroups
	in.KeyName = nonEmpty(s.KeyName)
	if ip := s.InstanceProfile; ip != "" {
		in.IamInstanceProfile = &types.IamInstanceProfileSpecification{}
		if strings.HasPrefix(ip, "arn:") {
			in.IamInstanceProfile.Arn = &ip
		} else {
			in.IamInstanceProfile.Name = &ip
		}
	}
	if v := s.RootVolume; v.SizeGB > 0 {
		in.BlockDeviceMappings = []types.BlockDeviceMapping{{DeviceName: awssdk.String(v.Device), Ebs: &types.EbsBlockDevice{
			VolumeSize: awssdk.Int32(int32(v.SizeGB)), VolumeType: types.VolumeType(v.Type), DeleteOnTermination: awssdk.Bool(true),
		}}}
	}
	if spot {
		in.InstanceMarketOptions = &types.InstanceMarketOptionsRequest{MarketType: types.MarketTypeSpot, SpotOptions: &types.SpotMarketOptions{
			MaxPrice: nonEmpty(s.SpotMaxPrice), SpotInstanceType: types.SpotInstanceTypeOneTime,
			InstanceInterruptionBehavior: types.InstanceInterruptionBehaviorTerminate,
		}}
	}
	return in
}

func nonEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// Delete terminates the runner's instances. One already gone is no error,
// and one EC2 lists shutting down, which its shutdown behaviour
// terminates, is not asked again: the usual end of a runner, whose agent
// ended after its job, costs no call.
func (p *Provider) Delete(ctx context.Context, name string) error {
	var ids []string
	ending := false
	for _, inst := range p.view() {
		switch {
		case inst.Name != name:
		case inst.State == provider.StateExited && strings.HasPrefix(inst.Reason, string(types.InstanceStateNameShuttingDown)):
			p.book.Deleted(inst.ID, p.opt.now())
			ending = true
		default:
			ids = append(ids, inst.ID)
		}
	}
	if len(ids) == 0 && !ending {
		// Not seen here: made by an earlier manager, not described yet.
		found, err := p.describe(ctx, p.opt.Manager, p.opt.Pool, name)
		if err != nil {
			return err
		}
		for _, si := range found {
			if si.Inst.State != provider.StateExited || si.Inst.Reason != terminated {
				ids = append(ids, si.Inst.ID)
			}
		}
	}
	if len(ids) == 0 {
		return nil
	}
	if err := p.terminate(ctx, ids); err != nil {
		return err
	}
	for _, id := range ids {
		p.book.Deleted(id, p.opt.now())
	}
	p.opt.Logger.Info("instance terminated", "runner", name, "ids", ids)
	return nil
}

// terminate terminates instances; ones EC2 does not know are gone
// already.
func (p *Provider) terminate(ctx context.Context, ids []string) error {
	_, err := p.opt.API.TerminateInstances(ctx, &ec2.TerminateInstancesInput{InstanceIds: ids})
	if _, code := kindOf(err); code == "InvalidInstanceID.NotFound" {
		if len(ids) == 1 {
			return nil
		}
		// One unknown id fails the whole call: one at a time.
		var errs []error
		for _, id := range ids {
			errs = append(errs, p.terminate(ctx, []string{id}))
		}
		return errors.Join(errs...)
	}
	if err != nil {
		return fmt.Errorf("terminate %s: %w", strings.Join(ids, ", "), err)
	}
	return nil
}
