package gcp

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Bursts in one call (vm.Batcher). With handoff_url the startup-script
// is the pool's, so the runners asked for together go out in one
// instances.bulkInsert: one request, metered as one insert, and one
// operation to wait for, however many instances ("About bulk creation of
// VMs"). Its instances are alike but for their names: labels and
// metadata are the pool's, and each instance's runner is read from its
// name (runnerOf), which is the runner's and a random suffix. A runner
// whose name cannot be read back so (not a valid start of an instance
// name) is inserted alone.

// MaxBulk is the most instances one bulkInsert asks for (Compute Engine
// takes up to 5,000).
const MaxBulk = 500

// BulkTimeout bounds a batch's launch, its operations' waits included.
var BulkTimeout = 10 * time.Minute

// LabelLaunch names the bulk insert that made an instance, so that what
// one made can be listed when it made fewer than asked.
const LabelLaunch = "runfleet-launch"

// bulkable says whether a runner's instance name gives its name back.
var bulkable = lazyregexp.New(`^[a-z]([-a-z0-9]{0,54}[a-z0-9])?$`)

// runnerOf is the runner of an instance whose name is the runner's and
// instanceName's suffix.
func runnerOf(instance string) string {
	if i := len(instance) - 7; i > 0 && instance[i] == '-' {
		return instance[:i]
	}
	return ""
}

// launchBatch asks for the batch's instances, placement by placement
// (vm.Placement): what one type and zone could not hold is asked of the
// next, and what none could is answered with why.
func (p *Provider) launchBatch(batch []*vm.Request, spot, fallback bool) {
	// The batch's callers wait for it, however long their own deadlines;
	// each call has its own, and the whole launch this one.
	ctx, cancel := context.WithTimeout(context.Background(), BulkTimeout)
	defer cancel()
	script, err := startupScript(p.opt.Section, p.desk.Handoff(SourceIdentity, HandoffWait), batch[0].Spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
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
	vm.TryBatch(p.placement(spot, fallback, choices, "bulk insert"), batch, func(rest []*vm.Request, spot bool, typ, zone string) ([]*vm.Request, error) {
		return p.bulkInsert(ctx, rest, script, typ, zone, spot)
	})
}

// bulkInsert asks one zone for the batch's instances and answers those
// it made; it returns those it did not make. An error leaves every
// request unanswered.
func (p *Provider) bulkInsert(ctx context.Context, batch []*vm.Request, script, typ, zone string, spot bool) ([]*vm.Request, error) {
	launch := uuid.NewString()[:8]
	names := make([]string, len(batch))
	for i, r := range batch {
		vm.Placed(r.Spec, p.opt.Section.Image, typ, zone, spot)
		names[i] = instanceName(r.Spec.Name)
		p.hold(zone, names[i], r.Spec)
	}
	forget := func(i int) {
		p.book.Failed(names[i])
		p.drop(zone, names[i])
	}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	op, err := p.opt.API.BulkInsert(cctx, p.opt.Project, zone, p.bulkResource(batch[0].Spec, names, script, typ, zone, spot, launch), uuid.NewString())
	cancel()
	if err != nil {
		for i := range batch {
			forget(i)
		}
		return batch, err
	}
	now := p.opt.now()
	insts := make([]provider.Instance, len(batch))
	for i, r := range batch {
		insts[i] = provider.Instance{ID: names[i], Name: r.Spec.Name, Manager: r.Spec.Manager, Pool: r.Spec.Pool, State: provider.StateCreated, Created: now}
		// Listed as coming up while the operation runs (insert).
		p.book.Launched(seenInstance{Inst: insts[i], Data: where{zone: zone, spot: spot}})
	}
	op, err = waitOp(ctx, p.opt.API, p.opt.Project, zone, op)
	if err == nil {
		err = failed(op)
	}
	var oe *opError
	if errors.As(err, &oe) {
		for i := range batch {
			forget(i)
		}
		return batch, err
	}
	if err != nil {
		// Not known to have failed: they may come up; the listing will
		// tell.
		return batch, err
	}
	made := func(string) bool { return true }
	if st := op.GetInstancesBulkInsertOperationMetadata().GetPerLocationStatus()["zones/"+zone]; st != nil && int(st.GetCreatedVmCount()) < len(batch) {
		if made, err = p.madeBy(ctx, launch); err != nil {
			return batch, err
		}
	}
	var rest []*vm.Request
	for i, r := range batch {
		if !made(names[i]) {
			forget(i)
			rest = append(rest, r)
			continue
		}
		p.opt.Logger.Info("instance inserted", "runner", r.Spec.Name, "instance", names[i], "type", typ, "zone", zone, "market", market(spot), "bulk", len(batch))
		r.Done(insts[i], nil)
	}
	return rest, nil
}

// madeBy lists what a bulk insert made, when it made fewer than it was
// asked for: bulkInsert's operation says how many, not which.
func (p *Provider) madeBy(ctx context.Context, launch string) (func(string) bool, error) {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	list, err := p.opt.API.List(cctx, p.opt.Project, fmt.Sprintf("labels.%s = %q", LabelLaunch, launch))
	cancel()
	if err != nil {
		return nil, fmt.Errorf("list what bulk insert %s made: %w", launch, err)
	}
	return func(name string) bool {
		return slices.ContainsFunc(list, func(i *computepb.Instance) bool { return i.GetName() == name })
	}, nil
}

// bulkResource is the request for a bulk insert: the instance insert
// would ask for, without its runner, and the names. Its types are
// names, not URLs, as instanceProperties takes them.
func (p *Provider) bulkResource(spec provider.Spec, names []string, script, typ, zone string, spot bool, launch string) *computepb.BulkInsertInstanceResource {
	in := p.instanceResource(spec, "", script, typ, zone, spot)
	pool := func(labels map[string]string) map[string]string {
		labels = maps.Clone(labels)
		delete(labels, LabelRunner)
		labels[LabelLaunch] = launch
		return labels
	}
	disk := in.Disks[0]
	disk.InitializeParams.Labels = pool(disk.InitializeParams.Labels)
	disk.InitializeParams.DiskType = proto.String(p.opt.Section.Disk.Type)
	for _, a := range in.GuestAccelerators {
		a.AcceleratorType = proto.String(p.opt.Section.Accelerator.Type)
	}
	props := &computepb.InstanceProperties{
		MachineType: proto.String(typ), Labels: pool(in.Labels), Disks: in.Disks, NetworkInterfaces: in.NetworkInterfaces,
		Scheduling: in.Scheduling, ServiceAccounts: in.ServiceAccounts, Tags: in.Tags, GuestAccelerators: in.GuestAccelerators,
		Metadata: &computepb.Metadata{Items: slices.DeleteFunc(in.Metadata.Items, func(it *computepb.Items) bool { return it.GetKey() == LabelRunner })},
	}
	per := make(map[string]*computepb.BulkInsertInstanceResourcePerInstanceProperties, len(names))
	for _, n := range names {
		per[n] = &computepb.BulkInsertInstanceResourcePerInstanceProperties{}
	}
	return &computepb.BulkInsertInstanceResource{
		Count: proto.Int64(int64(len(names))), MinCount: proto.Int64(1), InstanceProperties: props, PerInstanceProperties: per,
	}
}
