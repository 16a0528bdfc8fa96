package azure

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// EvictionNotice is how long Azure gives a Spot VM between its Preempt
// event and its eviction.
const EvictionNotice = 30 * time.Second

// List returns the VMs of a manager: the pool's from the last listing (at
// most a poll interval old) and the ones asked for since, less the ones
// deleted here. Another manager's are listed.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	if manager != p.opt.Manager {
		found, _, err := p.list(ctx, manager, p.opt.Pool, "", 0)
		out := make([]provider.Instance, 0, len(found))
		for _, sv := range found {
			out = append(out, sv.Inst)
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

// refresh lists the pool's VMs, reports what changed, and notes the Spot
// VMs that Azure deleted while they ran: being deleted, or gone, without
// being deleted here, and not stopped first (a VM that stops itself is
// deleted here).
func (p *Provider) refresh(ctx context.Context) error {
	p.fresh.Lock()
	defer p.fresh.Unlock()
	found, start, err := p.list(ctx, p.opt.Manager, p.opt.Pool, "", p.opt.Section.PollInterval.Duration)
	if err != nil {
		return err
	}
	var evicted []seenVM
	changed, known := p.book.Update(found, start, func(id string, old seenVM, now *seenVM, deleted bool) {
		ran := old.Inst.State != provider.StateExited
		switch {
		case deleted || !old.Data.spot && (now == nil || !now.Data.spot) || p.watch.Noticed(id):
		case now != nil && now.Data.spot && now.Inst.Reason == "deleting" && ran:
			evicted = append(evicted, *now)
		case now == nil && ran:
			evicted = append(evicted, old)
		}
	})
	p.mu.Lock()
	for _, sv := range evicted {
		p.evicted[sv.Inst.ID] = sv.Inst.Name
	}
	p.mu.Unlock()
	// Forgotten once gone two listings running.
	p.watch.Forget(known)
	p.watch.Changed(changed)
	return nil
}

// list lists a manager's VMs (of one pool, one runner when given) in the
// section's resource group, from a listing of the subscription's VMs with
// their power state (all pages) asked for at most maxAge ago, shared with
// the subscription's other pools (Listing), and says when it was asked
// for.
func (p *Provider) list(ctx context.Context, manager, pool, runner string, maxAge time.Duration) ([]seenVM, time.Time, error) {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	all, began, err := p.opt.Listing.Get(cctx, maxAge, p.opt.now, p.opt.API.List)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("list VMs: %w", briefError{err})
	}
	var out []seenVM
	for _, v := range all {
		sv := p.vm(v)
		if sv.Inst.Manager != manager || pool != "" && sv.Inst.Pool != pool || runner != "" && sv.Inst.Name != runner ||
			!strings.EqualFold(sv.Data.group, p.opt.Section.ResourceGroup) {
			continue
		}
		out = append(out, sv)
	}
	return out, began, nil
}

// vm maps Azure's VM: being made or starting is coming up (so the
// bootstrap timeout applies), running runs, and anything stopped,
// deallocated, failed or being deleted has ended.
func (p *Provider) vm(v *armcompute.VirtualMachine) seenVM {
	inst := provider.Instance{ID: deref(v.Name), Manager: deref(v.Tags[TagManager]), Pool: deref(v.Tags[TagPool]), Name: deref(v.Tags[TagRunner])}
	sv := seenVM{Data: where{group: groupOf(deref(v.ID))}}
	props := v.Properties
	if props == nil {
		props = &armcompute.VirtualMachineProperties{}
	}
	sv.Data.spot = props.Priority != nil && *props.Priority == armcompute.VirtualMachinePriorityTypesSpot
	inst.Machine = record.Machine{ID: inst.ID, Zone: deref(v.Location), Spot: sv.Data.spot}
	if hw := props.HardwareProfile; hw != nil && hw.VMSize != nil {
		inst.Machine.InstanceType = string(*hw.VMSize)
	}
	inst.Created = p.opt.now()
	if props.TimeCreated != nil {
		inst.Created = *props.TimeCreated
	}
	provisioning, power := strings.ToLower(deref(props.ProvisioningState)), ""
	if iv := props.InstanceView; iv != nil {
		for _, st := range iv.Statuses {
			code := deref(st.Code)
			if c, ok := strings.CutPrefix(code, "PowerState/"); ok {
				power = c
			}
			if c, ok := strings.CutPrefix(code, "ProvisioningState/"); ok && provisioning == "" {
				provisioning = c
			}
		}
	}
	switch {
	case provisioning == "deleting":
		inst.State, inst.Reason = provider.StateExited, "deleting"
	case strings.HasPrefix(provisioning, "failed"):
		inst.State, inst.Reason = provider.StateExited, "provisioning "+provisioning
	case power == "running":
		inst.State = provider.StateRunning
	case power == "stopping" || power == "stopped" || strings.HasPrefix(power, "deallocat"):
		inst.State, inst.Reason = provider.StateExited, power
	default: // creating, starting, or no power state yet
		inst.State = provider.StateCreated
	}
	sv.Inst = inst
	return sv
}

// groupOf is the resource group of a resource ID.
func groupOf(id string) string {
	parts := strings.Split(id, "/")
	for i := 0; i+1 < len(parts); i++ {
		if strings.EqualFold(parts[i], "resourceGroups") {
			return parts[i+1]
		}
	}
	return ""
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Watch reports changes found by the poller, which it starts.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) { p.watch.Watch(ctx, changed) }

// WatchPreemption reports Spot VMs that Azure evicted. The VM itself
// sees the Preempt event 30 s ahead (Scheduled Events), stops its job
// and lets Azure go ahead at once; the manager sees the eviction in its
// next listing.
func (p *Provider) WatchPreemption(ctx context.Context, notice func(provider.Notice)) {
	p.watch.WatchPreemption(ctx, notice)
}

// poll lists the pool's VMs and reports the evictions seen. A notice is
// sent here, not from refresh: its receiver may list, which refreshes.
func (p *Provider) poll(ctx context.Context) error {
	if err := p.refresh(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	evicted := maps.Clone(p.evicted)
	clear(p.evicted)
	p.mu.Unlock()
	for name, runner := range evicted {
		p.watch.Notify(provider.Notice{Name: runner, ID: name, At: p.opt.now(), Reason: "spot eviction: Azure deleted the Spot VM " + name}, "spot eviction")
	}
	return nil
}

var _ provider.Sweeper = (*Provider)(nil)

// ScheduleKind is what gc calls a VM's auto-shutdown schedule.
const ScheduleKind = "auto-shutdown schedule"

// Leftovers lists the manager's auto-shutdown schedules, of this pool,
// whose VM is gone: runfleet made one per VM before Compute Schedule
// deallocated them, and nothing deletes one with its VM.
func (p *Provider) Leftovers(ctx context.Context, manager string) ([]provider.Resource, error) {
	vms, _, err := p.list(ctx, manager, p.opt.Pool, "", 0)
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	for _, sv := range vms {
		live[strings.ToLower(ScheduleName(sv.Inst.ID))] = true
	}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	scheds, err := p.opt.API.Schedules(cctx)
	if err != nil {
		return nil, fmt.Errorf("list auto-shutdown schedules: %s", brief(err))
	}
	var out []provider.Resource
	for _, sc := range scheds {
		name := strings.ToLower(deref(sc.Name))
		if deref(sc.Tags[TagManager]) != manager || deref(sc.Tags[TagPool]) != p.opt.Pool || live[name] || !strings.HasPrefix(name, "shutdown-computevm-") {
			continue
		}
		out = append(out, provider.Resource{Kind: ScheduleKind, Name: deref(sc.Tags[TagRunner]), ID: deref(sc.ID)})
	}
	return out, nil
}

// Sweep deletes a schedule Leftovers listed.
func (p *Provider) Sweep(ctx context.Context, r provider.Resource) error {
	m := scheduleIDRE.FindStringSubmatch(r.ID)
	if r.Kind != ScheduleKind || m == nil {
		return fmt.Errorf("azure: %s %q is not one of runfleet's", r.Kind, r.ID)
	}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	if err := p.opt.API.Unschedule(cctx, m[1], m[2]); err != nil {
		return fmt.Errorf("delete auto-shutdown schedule %s: %s", r.ID, brief(err))
	}
	return nil
}

var scheduleIDRE = lazyregexp.New(`(?i)^/subscriptions/[^/]+/resourceGroups/([^/]+)/providers/Microsoft\.DevTestLab/schedules/shutdown-computevm-([^/]+)$`)
