package aws

import (
	"context"
	"errors"
	"fmt"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"github.com/runfleet/runfleet/provider"
)

// VolumeKind is what Leftovers calls an EBS volume.
const VolumeKind = "EBS volume"

// keptVolume is the State of a volume that will outlive its instance.
const keptVolume = "kept when its instance ends (DeleteOnTermination false)"

// SweepWait bounds how long Sweep waits for a volume's instance, which gc
// has just terminated, to let go of it (EC2 detaches the volume once the
// instance is terminated); SweepPoll is how often it looks.
var (
	SweepWait = 5 * time.Minute
	SweepPoll = 5 * time.Second
)

var _ provider.Sweeper = (*Provider)(nil)

// Leftovers lists the pool's EBS volumes that outlive their instance.
// Every volume made at launch carries the instance's tags; one whose
// mapping says DeleteOnTermination false (a launch template's or a custom
// AMI's data volume) is left "available" when the instance ends, and
// billed until something deletes it (EBS User Guide, "Preserve data when
// an instance is terminated"). Those are listed, and those still attached
// that will be.
func (p *Provider) Leftovers(ctx context.Context, manager string) ([]provider.Resource, error) {
	pages := ec2.NewDescribeVolumesPaginator(p.opt.API, &ec2.DescribeVolumesInput{MaxResults: awssdk.Int32(500), Filters: []types.Filter{
		{Name: awssdk.String("tag:" + TagManager), Values: []string{manager}},
		{Name: awssdk.String("tag:" + TagPool), Values: []string{p.opt.Pool}},
	}})
	var out []provider.Resource
	for pages.HasMorePages() {
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		page, err := pages.NextPage(cctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("describe volumes: %w", err)
		}
		for _, v := range page.Volumes {
			r := provider.Resource{Kind: VolumeKind, ID: awssdk.ToString(v.VolumeId)}
			switch {
			case v.State == types.VolumeStateAvailable:
			case v.State == types.VolumeStateInUse && len(v.Attachments) > 0 && !awssdk.ToBool(v.Attachments[0].DeleteOnTermination):
				r.State = keptVolume
			default:
				continue // deleted with its instance, or on its way out
			}
			for _, t := range v.Tags {
				if awssdk.ToString(t.Key) == TagRunner {
					r.Name = awssdk.ToString(t.Value)
				}
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// Sweep deletes a volume Leftovers listed, once its instance lets go of
// it: gc terminates the machines first, and a volume attached to an
// instance on its way out is waited for, up to SweepWait. A volume whose
// instance still runs (a busy runner gc left) is reported, not deleted;
// one already gone is no error.
func (p *Provider) Sweep(ctx context.Context, r provider.Resource) error {
	if r.Kind != VolumeKind {
		return fmt.Errorf("aws: %s %q is not one of runfleet's", r.Kind, r.ID)
	}
	deadline := time.Now().Add(SweepWait)
	for {
		attached, err := p.volumeHolder(ctx, r.ID)
		switch {
		case errors.Is(err, errGone):
			return nil
		case err != nil:
			return err
		case attached == "":
			err := p.deleteVolume(ctx, r.ID)
			if !errors.Is(err, errInUse) {
				return err
			}
		}
		if attached != "" {
			state, err := p.instanceState(ctx, attached)
			if err != nil {
				return err
			}
			if state != types.InstanceStateNameShuttingDown && state != types.InstanceStateNameTerminated {
				return fmt.Errorf("volume %s is attached to instance %s, which is %s: it can go once the instance is terminated", r.ID, attached, state)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("volume %s is still in use after %s", r.ID, SweepWait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(SweepPoll):
		}
	}
}

var (
	errGone  = errors.New("gone")
	errInUse = errors.New("in use")
)

// volumeHolder is the instance a volume is attached to, "" for none.
func (p *Provider) volumeHolder(ctx context.Context, id string) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	out, err := p.opt.API.DescribeVolumes(cctx, &ec2.DescribeVolumesInput{VolumeIds: []string{id}})
	if code(err) == "InvalidVolume.NotFound" {
		return "", errGone
	}
	if err != nil {
		return "", fmt.Errorf("describe volume %s: %w", id, err)
	}
	if len(out.Volumes) == 0 {
		return "", errGone
	}
	v := out.Volumes[0]
	if v.State == types.VolumeStateAvailable || len(v.Attachments) == 0 {
		return "", nil
	}
	return awssdk.ToString(v.Attachments[0].InstanceId), nil
}

func (p *Provider) deleteVolume(ctx context.Context, id string) error {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	_, err := p.opt.API.DeleteVolume(cctx, &ec2.DeleteVolumeInput{VolumeId: awssdk.String(id)})
	switch code(err) {
	case "InvalidVolume.NotFound":
		return nil
	case "VolumeInUse":
		return errInUse
	}
	if err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	return nil
}

func (p *Provider) instanceState(ctx context.Context, id string) (types.InstanceStateName, error) {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	out, err := p.opt.API.DescribeInstances(cctx, &ec2.DescribeInstancesInput{InstanceIds: []string{id}})
	if code(err) == "InvalidInstanceID.NotFound" {
		return types.InstanceStateNameTerminated, nil
	}
	if err != nil {
		return "", fmt.Errorf("describe instance %s: %w", id, err)
	}
	for _, r := range out.Reservations {
		for _, i := range r.Instances {
			if i.State != nil {
				return i.State.Name, nil
			}
		}
	}
	return types.InstanceStateNameTerminated, nil
}
