package aws

import (
	"context"
	"fmt"
	"strings"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials/ec2rolecreds"
	"github.com/aws/aws-sdk-go-v2/service/ssm"
	ssmtypes "github.com/aws/aws-sdk-go-v2/service/ssm/types"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
)

// The handoff through Systems Manager Parameter Store. An instance's user
// data is readable for its whole life, by any process on it (a job step
// included) through the metadata service and by anyone with
// ec2:DescribeInstanceAttribute, so it holds no credential: it is the
// same script for every runner of a pool. Once RunInstances has said
// which instance it started, the manager stores that runner's assignment
// (its name, its agent's command and its single-use credential) as a
// SecureString parameter named for the instance and tagged with its ARN;
// the instance reads it with its role's credentials and deletes it before
// its agent starts. The instance profile's policy allows an instance only
// the parameter tagged with its own ARN (${ec2:SourceInstanceARN}), so no
// other instance, and no job on another, reads it; after the read nobody
// on the instance can read it again. A parameter an instance never took
// expires by its own policy (Advanced tier), manager or not.
//
// This is what philips-labs/terraform-aws-github-runner does with its
// runners' configuration (modules/runners/templates/start-runner.sh),
// with the policy narrowed to the one instance.

// SourceParameters names the handoff in a plan.
const SourceParameters = "aws-ssm"

// ParameterPrefix is where a manager's assignments are stored:
// /runfleet/<manager>/<instance id>.
func ParameterPrefix(manager string) string { return "/runfleet/" + manager + "/" }

// HandoffWait is how long an instance waits for its assignment; the
// parameter expires a little after it.
const HandoffWait = 10 * time.Minute

// SSMAPI is what the manager calls of Systems Manager (*ssm.Client).
type SSMAPI interface {
	PutParameter(context.Context, *ssm.PutParameterInput, ...func(*ssm.Options)) (*ssm.PutParameterOutput, error)
}

// handoff is the plan's handoff: the manager's desk where the pool has
// handoff_url (identity.go), Parameter Store where its instances have an
// instance profile to read it with, nil otherwise.
func (p *Provider) handoff() *bootstrap.Handoff {
	s := p.opt.Section
	if p.desk != nil {
		return p.desk.Handoff(SourceIdentity, HandoffWait)
	}
	if s.InstanceProfile == "" {
		return nil
	}
	return &bootstrap.Handoff{Source: SourceParameters, Wait: HandoffWait, Params: map[string]string{
		"region": p.opt.Region, "endpoint": p.opt.SSMEndpoint, "prefix": ParameterPrefix(p.opt.Manager),
	}}
}

// hand stores a runner's assignment for the instance that will take it.
func (p *Provider) hand(ctx context.Context, id, account string, a bootstrap.Assignment) error {
	value, err := bootstrap.EncodeAssignment(a)
	if err != nil {
		return err
	}
	expires := p.opt.now().Add(HandoffWait + 5*time.Minute).UTC()
	_, err = p.opt.SSM.PutParameter(ctx, &ssm.PutParameterInput{
		Name: awssdk.String(ParameterPrefix(p.opt.Manager) + id), Value: awssdk.String(value),
		Type: ssmtypes.ParameterTypeSecureString, Tier: ssmtypes.ParameterTierAdvanced,
		Description: awssdk.String("runfleet: the assignment of runner " + a.Runner + ", taken once by instance " + id),
		Policies:    awssdk.String(fmt.Sprintf(`[{"Type":"Expiration","Version":"1.0","Attributes":{"Timestamp":"%s"}}]`, expires.Format("2006-01-02T15:04:05.000Z"))),
		Tags: []ssmtypes.Tag{
			{Key: awssdk.String(TagInstance), Value: awssdk.String(instanceARN(p.opt.Region, account, id))},
			{Key: awssdk.String(TagManager), Value: awssdk.String(p.opt.Manager)},
			{Key: awssdk.String(TagPool), Value: awssdk.String(p.opt.Pool)},
		},
	})
	if err != nil {
		return fmt.Errorf("store the assignment of %s for instance %s in Parameter Store: %w", a.Runner, id, err)
	}
	return nil
}

// MaxAssignment is the most a runner's encoded assignment may be:
// Parameter Store's advanced tier takes 8 KB.
const MaxAssignment = 8 << 10

// checkAssignment refuses, before any instance is asked for, a runner
// whose assignment would not fit a parameter.
func (p *Provider) checkAssignment(spec provider.Spec) error {
	if p.desk != nil {
		return nil
	}
	v, err := bootstrap.EncodeAssignment(boot(p.opt.Section, nil, 0, 0).Assign(spec))
	if err != nil {
		return err
	}
	if len(v) > MaxAssignment {
		return fmt.Errorf("the assignment of %s is %d bytes encoded, over Parameter Store's %d (fewer or smaller files)", spec.Name, len(v), MaxAssignment)
	}
	return nil
}

// handOver stores the runner's assignment for the instance just
// launched, at the desk or in Parameter Store; where that fails the
// instance, which could never start its agent, is terminated.
func (p *Provider) handOver(ctx context.Context, inst provider.Instance, account string, spec provider.Spec) error {
	var err error
	if p.desk != nil {
		err = p.hold(inst, account, spec)
	} else {
		err = p.hand(ctx, inst.ID, account, boot(p.opt.Section, nil, 0, 0).Assign(spec))
	}
	if err == nil {
		return nil
	}
	return p.abandon(ctx, inst.ID, err)
}

// abandon terminates an instance launched for a runner that cannot have
// it, and says why, an error no retry fixes as such.
func (p *Provider) abandon(ctx context.Context, id string, err error) error {
	if terr := p.terminate(ctx, []string{id}); terr != nil {
		err = fmt.Errorf("%w; and terminating the instance failed: %w", err, terr)
	} else {
		p.book.Deleted(id, p.opt.now())
		p.mu.Lock()
		delete(p.names, id)
		p.mu.Unlock()
	}
	switch k, c := kindOf(err); {
	case k == errFatal, c == "AccessDeniedException", c == "ValidationException", c == "UnrecognizedClientException":
		// The manager may not tag instances or store parameters, or
		// they are refused: no retry fixes that.
		return provider.Rejected(err)
	}
	return err
}

// TagInstance is the tag the instance policy matches against
// ${ec2:SourceInstanceARN}.
const TagInstance = "runfleet:instance"

// instanceARN is an instance's ARN in its region's partition.
func instanceARN(region, account, id string) string {
	partition := "aws"
	switch {
	case strings.HasPrefix(region, "cn-"):
		partition = "aws-cn"
	case strings.HasPrefix(region, "us-gov-"):
		partition = "aws-us-gov"
	}
	return "arn:" + partition + ":ec2:" + region + ":" + account + ":instance/" + id
}

// parameterSource is the instance side: it reads this instance's
// parameter with the instance's role credentials, then deletes it.
type parameterSource struct {
	deniedSince time.Time // the first of an unbroken run of AccessDenied answers
	now         func() time.Time
}

// DeniedFor is how long Parameter Store may deny an instance its
// assignment before the instance gives up: the manager stores it within
// seconds of RunInstances' answer, long before an instance has booted, so
// a denial that lasts is a role without runfleet's statement.
var DeniedFor = 2 * time.Minute

func init() {
	bootstrap.RegisterSource(SourceParameters, func() bootstrap.Source { return &parameterSource{now: time.Now} })
}

func (ps *parameterSource) Take(ctx context.Context, h bootstrap.Handoff) (bootstrap.Assignment, error) {
	md := NewMetadata()
	id, _, err := md.get(ctx, "instance-id")
	if err != nil {
		return bootstrap.Assignment{}, fmt.Errorf("%w: this instance's id: %v", bootstrap.ErrNotYet, err)
	}
	creds := awssdk.NewCredentialsCache(ec2rolecreds.New(func(o *ec2rolecreds.Options) { o.Client = md.c }))
	if _, err := creds.Retrieve(ctx); err != nil {
		// No instance profile: nothing on this instance can read the
		// assignment, now or later.
		return bootstrap.Assignment{}, fmt.Errorf("this instance has no role credentials to read Parameter Store with (the pool's instance_profile): %w", err)
	}
	client := ssm.New(ssm.Options{Region: h.Params["region"], Credentials: creds}, func(o *ssm.Options) {
		if e := h.Params["endpoint"]; e != "" {
			o.BaseEndpoint = awssdk.String(e)
		}
	})
	name := awssdk.String(h.Params["prefix"] + string(id))
	got, err := client.GetParameter(ctx, &ssm.GetParameterInput{Name: name, WithDecryption: awssdk.Bool(true)})
	if err != nil {
		// Until the manager has stored it the parameter is not there,
		// and the policy, which matches its tag, denies it
		// (AccessDeniedException); an outage passes too. What the
		// last answer was is said when the wait ends.
		if code(err) != "AccessDeniedException" {
			ps.deniedSince = time.Time{}
		} else if ps.deniedSince.IsZero() {
			ps.deniedSince = ps.now()
		} else if d := ps.now().Sub(ps.deniedSince); d >= DeniedFor {
			return bootstrap.Assignment{}, fmt.Errorf("this instance was denied %s by Parameter Store for %s (is runfleet's statement, docs/providers/aws.md, in the role of the pool's instance_profile?): %w", *name, max(d, DeniedFor).Round(time.Second), err)
		}
		return bootstrap.Assignment{}, fmt.Errorf("%w: %s: %v", bootstrap.ErrNotYet, *name, err)
	}
	if _, err := client.DeleteParameter(ctx, &ssm.DeleteParameterInput{Name: name}); err != nil && code(err) != "ParameterNotFound" {
		// Taken but left readable: the agent does not start with it.
		return bootstrap.Assignment{}, fmt.Errorf("delete %s after reading it: %w", *name, err)
	}
	return bootstrap.DecodeAssignment(awssdk.ToString(got.Parameter.Value))
}
