package gcp

import (
	"context"
	"fmt"
	"maps"
	"path"
	"strconv"
	"strings"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// preemptionNotice is how long Compute Engine gives a preempted
// instance before it stops it.
const preemptionNotice = 30 * time.Second

// List returns the instances of a manager: the pool's from the last
// listing (at most a poll interval old) and the ones inserted since,
// less the ones deleted here. Another manager's are listed.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	if manager != p.opt.Manager {
		found, _, err := p.list(ctx, manager, p.opt.Pool, "", 0)
		out := make([]provider.Instance, 0, len(found))
		for _, si := range found {
			out = append(out, si.Inst)
		}
		return out, err
	}
	if p.book.Stale(p.opt.now(), p.opt.Section.PollInterval.Duration) {
		if err := p.refresh(ctx); err != nil {
			return nil, err
		}
	}
	return p.book.Instances(), nil
}

// refresh lists the pool's instances, reports what changed, and notes
// the Spot instances that may have been preempted.
func (p *Provider) refresh(ctx context.Context) error {
	p.fresh.Lock()
	defer p.fresh.Unlock()
	found, start, err := p.list(ctx, p.opt.Manager, p.opt.Pool, "", p.opt.Section.PollInterval.Duration)
	if err != nil {
		return err
	}
	var suspects []seenInstance
	changed, known := p.book.Update(found, start, func(id string, old seenInstance, now *seenInstance, deleted bool) {
		if now == nil {
			p.drop(old.Data.zone, id) // gone: no later instance of that name can claim it
		}
		switch {
		case now != nil && now.Data.spot && now.Inst.State == provider.StateExited && !p.watch.Noticed(id):
			suspects = append(suspects, *now)
		case now == nil && old.Data.spot && !deleted && !p.watch.Noticed(id):
			suspects = append(suspects, old) // gone from the listing
		}
	})
	p.mu.Lock()
	for _, si := range suspects {
		p.suspect[si.Inst.ID] = si.Inst.Name
	}
	p.mu.Unlock()
	// Forgotten once gone two listings running.
	p.watch.Forget(known)
	p.watch.Changed(changed)
	return nil
}

// list lists a manager's instances (of one pool, one runner when given)
// in every zone, in one aggregated call (all pages), from a listing asked
// for at most maxAge ago, which this manager's pools in the project share
// (Listing), and says when it was asked for. Another manager's are listed
// afresh.
func (p *Provider) list(ctx context.Context, manager, pool, runner string, maxAge time.Duration) ([]seenInstance, time.Time, error) {
	filter := fmt.Sprintf("labels.%s = %q", LabelManager, labelValue(manager))
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	var list []*computepb.Instance
	began, err := p.opt.now(), error(nil)
	if manager == p.opt.Manager {
		list, began, err = p.opt.Listing.Get(cctx, maxAge, p.opt.now, func(ctx context.Context) ([]*computepb.Instance, error) {
			return p.opt.API.List(ctx, p.opt.Project, filter)
		})
	} else {
		if pool != "" {
			filter += fmt.Sprintf(" AND labels.%s = %q", LabelPool, labelValue(pool))
		}
		list, err = p.opt.API.List(cctx, p.opt.Project, filter)
	}
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("list instances: %w", err)
	}
	var out []seenInstance
	for _, i := range list {
		si := p.instance(i)
		// Labels are made label-safe, so two names may share them: the
		// metadata holds the exact ones.
		if si.Inst.Manager != manager || pool != "" && si.Inst.Pool != pool || runner != "" && si.Inst.Name != runner {
			continue
		}
		out = append(out, si)
	}
	return out, began, nil
}

// instance maps Compute Engine's instance: provisioning and staging are
// coming up (so the bootstrap timeout applies), running runs, and
// anything stopping, stopped or suspended has ended.
func (p *Provider) instance(i *computepb.Instance) seenInstance {
	inst := provider.Instance{ID: i.GetName()}
	if t, err := time.Parse(time.RFC3339, i.GetCreationTimestamp()); err == nil {
		inst.Created = t
	} else {
		inst.Created = p.opt.now()
	}
	inst.Machine = record.Machine{
		ID: inst.ID, InstanceType: path.Base(i.GetMachineType()), Zone: path.Base(i.GetZone()),
		Spot: i.GetScheduling().GetProvisioningModel() == "SPOT",
	}
	for _, item := range i.GetMetadata().GetItems() {
		switch item.GetKey() {
		case LabelManager:
			inst.Manager = item.GetValue()
		case LabelPool:
			inst.Pool = item.GetValue()
		case LabelRunner:
			inst.Name = item.GetValue()
		}
	}
	if inst.Name == "" && inst.Pool != "" {
		inst.Name = runnerOf(inst.ID) // a bulk insert's (bulk.go)
	}
	switch status := i.GetStatus(); status {
	case "PROVISIONING", "STAGING", "PENDING":
		inst.State = provider.StateCreated
	case "RUNNING":
		inst.State = provider.StateRunning
	default:
		inst.State = provider.StateExited
		inst.Reason = strings.ToLower(status)
		if m := i.GetStatusMessage(); m != "" {
			inst.Reason += ": " + m
		}
	}
	return seenInstance{Inst: inst, Data: where{zone: last(i.GetZone()), spot: i.GetScheduling().GetProvisioningModel() == computepb.Scheduling_SPOT.String()}}
}

// Watch reports changes found by the poller, which it starts.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) { p.watch.Watch(ctx, changed) }

// WatchPreemption reports Spot instances that Compute Engine preempted:
// its 30-second notice.
func (p *Provider) WatchPreemption(ctx context.Context, notice func(provider.Notice)) {
	p.watch.WatchPreemption(ctx, notice)
}

// poll lists the pool's instances, and reads the preemptions when a Spot
// instance stopped or vanished.
func (p *Provider) poll(ctx context.Context) error {
	if err := p.refresh(ctx); err != nil {
		return err
	}
	return p.preemptions(ctx)
}

// preemptions reads the project's preemption operations when a Spot
// instance of the pool stopped or vanished without being deleted here
// (a Spot VM's own power-off stops it too): one call then, none in the
// steady state.
func (p *Provider) preemptions(ctx context.Context) error {
	p.mu.Lock()
	suspects := maps.Clone(p.suspect)
	clear(p.suspect)
	p.mu.Unlock()
	if len(suspects) == 0 {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	ops, err := p.opt.API.Preempted(cctx, p.opt.Project)
	cancel()
	if err != nil {
		p.mu.Lock()
		maps.Copy(p.suspect, suspects) // asked again next time
		p.mu.Unlock()
		return fmt.Errorf("list preemptions: %w", err)
	}
	for _, op := range ops {
		name := last(op.GetTargetLink())
		runner, ok := suspects[name]
		if !ok {
			continue
		}
		at, err := time.Parse(time.RFC3339, op.GetInsertTime())
		if err != nil {
			at = p.opt.now()
		}
		p.watch.Notify(provider.Notice{Name: runner, ID: name, At: at.Add(preemptionNotice),
			Reason: "spot preemption: " + op.GetStatusMessage() + " (operation " + strconv.FormatUint(op.GetId(), 10) + ")"}, "spot preemption")
	}
	return nil
}
