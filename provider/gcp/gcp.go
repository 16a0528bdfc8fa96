// Package gcp runs runners on Compute Engine instances, one instance per
// runner, Spot or standard, through cloud.google.com/go/compute. Each
// instance carries the manager id, pool and runner name in its labels
// (and, exactly, in its metadata) from its insert on, runs the runner's
// plan from its startup-script with `runfleet agent` (package
// bootstrap), and powers itself off when the agent ends, when no job
// came within the idle timeout, or at its deadline, also when the
// manager is gone; Compute Engine deletes it at its maxRunDuration
// should that fail too.
//
// The pool's instances are listed every poll interval in one aggregated
// call; a Spot instance seen stopping or gone without being deleted here
// has its preemption read from the project's operations, and reported.
package gcp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Labels every instance carries (and its boot disk), with the values made
// label-safe; the exact values are in the metadata items of the same
// names.
const (
	LabelManager = "runfleet-manager"
	LabelPool    = "runfleet-pool"
	LabelRunner  = "runfleet-runner"
)

// CallTimeout bounds each request to Compute Engine but an operation's
// wait (opWait).
var CallTimeout = 30 * time.Second

// MaxRunGrace is how much longer than its own deadline Compute Engine
// lets an instance run (scheduling.maxRunDuration) before deleting it:
// the instance powers itself off first, and this is for when it cannot.
const MaxRunGrace = 10 * time.Minute

// Options configure a Provider.
type Options struct {
	API     API
	Project string
	Manager string
	Pool    string
	Section Section
	// IdleTimeout and Lifetime are the instance side's: an instance
	// powers off when no job came within IdleTimeout, and at Lifetime
	// after it was asked for whatever it runs.
	IdleTimeout, Lifetime time.Duration
	Calls                 *atomic.Int64 // requests sent, when counted
	// Listing is the manager's instances in the project, shared with its
	// other pools there (one of the pool's own when nil).
	Listing *Listing
	// Verifier checks the identity tokens of instances claiming their
	// assignment (Section.HandoffURL); Google's keys when nil.
	Verifier Verifier
	// Catalog lists Compute Engine's SKUs, from which the instances'
	// records are priced (price.go); nil leaves them unpriced.
	Catalog Catalog
	Logger  *slog.Logger
	now     func() time.Time
}

// Provider is one pool's instances.
type Provider struct {
	opt  Options
	skus skuCache // the catalog's SKUs, for prices
	// types are the machine types read (machineType), by name.
	typesMu sync.Mutex
	types   map[string]*computepb.MachineType
	watch   vm.Poller
	fresh   sync.Mutex // one list at a time
	book    vm.Book[where]
	desk    *vm.Desk // assignments waiting for their instances; nil without handoff_url
	batch   vm.Batcher
	// catalogue is what the pool's machine types have, for jobs that
	// choose their size.
	catalogue vm.Catalogue

	mu      sync.Mutex
	suspect map[string]string // spot instances stopping or vanished: name → runner
}

// where is an instance's zone, and whether it is Spot.
type where struct {
	zone string
	spot bool
}

type seenInstance = vm.Entry[where]

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
	if o.Listing == nil {
		o.Listing = &Listing{}
	}
	p := &Provider{opt: o, suspect: map[string]string{}}
	p.batch = vm.Batcher{Max: MaxBulk, Market: p.marketOf, Launch: p.launchBatch, Size: vm.SizeKey}
	p.catalogue.Types, p.catalogue.Cloud, p.catalogue.Read = o.Section.MachineTypes, "Compute Engine", p.readSizes
	if u := vm.DeskURL(o.Section.HandoffURL, o.Pool); u != "" {
		verifier := sync.OnceValues(func() (Verifier, error) {
			if o.Verifier != nil {
				return o.Verifier, nil
			}
			return NewVerifier(context.Background(), o.Section.IdentityCerts)
		})
		p.desk = &vm.Desk{URL: u, Logger: o.Logger, Verify: func(ctx context.Context, token, audience string) (string, error) {
			v, err := verifier()
			if err != nil {
				return "", err
			}
			return verify(ctx, v, o.Project, token, audience)
		}}
	}
	p.watch = vm.Poller{Interval: o.Section.PollInterval.Duration, What: "listing instances", Logger: o.Logger, Poll: p.poll}
	return p
}

var (
	_ provider.Provider     = (*Provider)(nil)
	_ provider.Watcher      = (*Provider)(nil)
	_ provider.Pricer       = (*Provider)(nil)
	_ provider.Preempter    = (*Provider)(nil)
	_ provider.Describer    = (*Provider)(nil)
	_ provider.CallCounter  = (*Provider)(nil)
	_ provider.Handoffer    = (*Provider)(nil)
	_ provider.ShapeChecker = (*Provider)(nil)
)

func (p *Provider) Traits() provider.Traits {
	return provider.Traits{KeepsBootData: true, Preemptible: p.opt.Section.Spot}
}

// Honours says what a job of a dynamic pool may ask: spot=, in a Spot
// pool, and its machine's CPUs, memory and GPUs, met by the pool's
// machine types (sizes.go).
func (p *Provider) Honours() []string { return vm.Honours(p.opt.Section.Spot, true) }

func (p *Provider) Calls() int64 { return p.opt.Calls.Load() }

// Close stops the poller. Instances keep running.
func (p *Provider) Close() error {
	p.watch.Stop()
	return nil
}

// Create starts the runner's instance: the first machine type and zone
// with capacity, Spot first when the pool asks for it, then standard when
// its fallback says so. With handoff_url the runners asked for together
// go out in one bulk insert (bulk.go); without it each runner's instance
// carries its own credential in its metadata, which bulkInsert's
// per-instance properties cannot hold, and is inserted alone.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if inst, ok := p.book.Live(spec.Name); ok {
		return inst, nil
	}
	s := p.opt.Section
	h := p.desk.Handoff(SourceIdentity, HandoffWait)
	if h != nil && bulkable.MatchString(spec.Name) {
		return p.batch.Do(ctx, spec)
	}
	choices, err := p.catalogue.TypesFor(ctx, spec.Request)
	if err != nil {
		return provider.Instance{}, err
	}
	var made provider.Instance
	spot, fallback := p.marketOf(spec)
	err = vm.TryBoot(p.placement(spot, fallback, choices, "insert instance"), spec, s.Image, func() (string, error) {
		return startupScript(s, h, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	}, func(spot bool, typ, zone, script string) (err error) {
		made, err = p.insert(ctx, spec, script, typ, zone, spot)
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
// machine types (the pool's, or those that fit its job,
// vm.Catalogue.TypesFor) and zones.
func (p *Provider) placement(spot, fallback bool, types []string, what string) vm.Placement {
	s := p.opt.Section
	return vm.Placement{
		Spot: spot, Fallback: fallback, Types: types, Places: s.Zones,
		What: what, Standard: "standard", Limit: "Compute Engine's request quota", Judge: judge, Logger: p.opt.Logger,
	}
}

// judge says what an error of insert means. A type or accelerator not
// offered in one zone is refused as invalid there: the others are tried.
func judge(err error) (vm.Outcome, string, string) {
	kind, code := classify(err)
	switch kind {
	case errCapacity:
		return vm.NoCapacity, code, ""
	case errFatal, errNotFound:
		return vm.Refused, code, err.Error()
	case errThrottle:
		return vm.Throttled, code, ""
	}
	return vm.Transient, code, ""
}

// classify says what an error of insert means.
func classify(err error) (errKind, string) {
	var oe *opError
	if errors.As(err, &oe) {
		return oe.kind(), strings.Join(oe.codes, ", ")
	}
	return kindOf(err)
}

func market(spot bool) string {
	if spot {
		return "spot"
	}
	return "standard"
}

// insert asks for one instance and waits for its operation: an
// instance Compute Engine cannot place fails there, not at the insert.
func (p *Provider) insert(ctx context.Context, spec provider.Spec, script, typ, zone string, spot bool) (provider.Instance, error) {
	name := instanceName(spec.Name)
	in := p.instanceResource(spec, name, script, typ, zone, spot)
	p.hold(zone, name, spec)
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	op, err := p.opt.API.Insert(cctx, p.opt.Project, zone, in, uuid.NewString())
	cancel()
	if err != nil {
		p.drop(zone, name)
		return provider.Instance{}, err
	}
	now := p.opt.now()
	inst := provider.Instance{ID: name, Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool, State: provider.StateCreated, Created: now}
	// Listed as coming up while its operation runs, so that a pass in
	// the meantime neither starts another nor deletes it.
	p.book.Launched(seenInstance{Inst: inst, Data: where{zone: zone, spot: spot}})
	op, err = waitOp(ctx, p.opt.API, p.opt.Project, zone, op)
	if err == nil {
		err = failed(op)
	}
	if err != nil {
		var oe *opError
		if !errors.As(err, &oe) {
			// Not known to have failed: it may come up; the listing
			// will tell.
			return provider.Instance{}, err
		}
		p.book.Failed(name)
		p.drop(zone, name)
		return provider.Instance{}, err
	}
	p.opt.Logger.Info("instance inserted", "runner", spec.Name, "instance", name, "type", typ, "zone", zone, "market", market(spot))
	return inst, nil
}

// instanceResource is the instance asked for: labelled, its boot disk
// deleted with it, Spot ones deleted when taken back, and every one
// deleted by Compute Engine after its deadline and MaxRunGrace.
func (p *Provider) instanceResource(spec provider.Spec, name, script, typ, zone string, spot bool) *computepb.Instance {
	s := p.opt.Section
	labels := map[string]string{LabelManager: labelValue(spec.Manager), LabelPool: labelValue(spec.Pool), LabelRunner: labelValue(spec.Name)}
	maps.Copy(labels, s.Labels)
	items := []*computepb.Items{
		{Key: proto.String("startup-script"), Value: proto.String(script)},
		{Key: proto.String(LabelManager), Value: proto.String(spec.Manager)},
		{Key: proto.String(LabelPool), Value: proto.String(spec.Pool)},
		{Key: proto.String(LabelRunner), Value: proto.String(spec.Name)},
	}
	disk := &computepb.AttachedDisk{Boot: proto.Bool(true), AutoDelete: proto.Bool(true), InitializeParams: &computepb.AttachedDiskInitializeParams{
		SourceImage: proto.String(s.Image), DiskType: proto.String("zones/" + zone + "/diskTypes/" + s.Disk.Type), Labels: labels,
	}}
	if s.Disk.SizeGB > 0 {
		disk.InitializeParams.DiskSizeGb = proto.Int64(int64(s.Disk.SizeGB))
	}
	nic := &computepb.NetworkInterface{}
	if s.Network != "" {
		nic.Network = proto.String(s.Network)
	}
	if s.Subnetwork != "" {
		nic.Subnetwork = proto.String(s.Subnetwork)
	}
	if *s.ExternalIP {
		nic.AccessConfigs = []*computepb.AccessConfig{{Name: proto.String("External NAT"), Type: proto.String("ONE_TO_ONE_NAT")}}
	}
	model := computepb.Scheduling_STANDARD.String()
	if spot {
		model = computepb.Scheduling_SPOT.String()
	}
	sched := &computepb.Scheduling{
		ProvisioningModel: proto.String(model), AutomaticRestart: proto.Bool(false),
		InstanceTerminationAction: proto.String(computepb.Scheduling_DELETE.String()),
		MaxRunDuration:            &computepb.Duration{Seconds: proto.Int64(int64((p.opt.Lifetime + MaxRunGrace) / time.Second))},
	}
	in := &computepb.Instance{
		Name: proto.String(name), MachineType: proto.String("zones/" + zone + "/machineTypes/" + typ),
		Labels: labels, Metadata: &computepb.Metadata{Items: items}, Disks: []*computepb.AttachedDisk{disk},
		NetworkInterfaces: []*computepb.NetworkInterface{nic}, Scheduling: sched,
	}
	// GPUs cannot move with a live migration; Spot VMs are never migrated.
	// A type that carries GPUs of its own takes no other.
	if a := s.Accelerator; a.Type != "" && !gpuFamily(typ) {
		in.GuestAccelerators = []*computepb.AcceleratorConfig{{AcceleratorType: proto.String("zones/" + zone + "/acceleratorTypes/" + a.Type), AcceleratorCount: proto.Int32(int32(a.Count))}}
	}
	if a := s.Accelerator; a.Type != "" || spot || gpuFamily(typ) {
		sched.OnHostMaintenance = proto.String(computepb.Scheduling_TERMINATE.String())
	}
	if s.ServiceAccount != "" {
		in.ServiceAccounts = []*computepb.ServiceAccount{{Email: proto.String(s.ServiceAccount), Scopes: s.Scopes}}
	}
	if len(s.NetworkTags) > 0 {
		in.Tags = &computepb.Tags{Items: s.NetworkTags}
	}
	return in
}

// gpuFamily says whether a machine type carries GPUs of its own (A2, A3,
// A4, G2, G4).
func gpuFamily(typ string) bool {
	family, _, _ := strings.Cut(typ, "-")
	return family == "a2" || family == "a3" || family == "a4" || family == "g2" || family == "g4"
}

var unsafeName = lazyregexp.New(`[^a-z0-9-]+`)

// instanceName is a new instance's name: the runner's, made a valid
// name, and a random suffix, so that a slot's next instance can be made
// while its last one is deleted.
func instanceName(runner string) string {
	base := strings.Trim(unsafeName.ReplaceAllString(strings.ToLower(runner), "-"), "-")
	if base == "" || base[0] < 'a' || base[0] > 'z' {
		base = "rf-" + base
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return strings.TrimRight(base[:min(len(base), 56)], "-") + "-" + hex.EncodeToString(b)
}

var unsafeLabel = lazyregexp.New(`[^a-z0-9_-]+`)

// labelValue makes s a label value: lowercase letters, digits, _ and -,
// at most 63. The exact value is in the metadata.
func labelValue(s string) string {
	v := unsafeLabel.ReplaceAllString(strings.ToLower(s), "_")
	return v[:min(len(v), 63)]
}

// Delete deletes the runner's instances; their boot disks go with them.
// One already gone is no error. The deletion is not waited for: an
// instance being deleted is hidden from List, and listed again should
// the deletion fail.
func (p *Provider) Delete(ctx context.Context, name string) error {
	found := p.book.Of(name)
	if len(found) == 0 {
		// Not seen here: made by an earlier manager, not listed yet.
		var err error
		if found, _, err = p.list(ctx, p.opt.Manager, p.opt.Pool, name, 0); err != nil {
			return err
		}
	}
	var errs []error
	for _, si := range found {
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		err := p.opt.API.Delete(cctx, p.opt.Project, si.Data.zone, si.Inst.ID, uuid.NewString())
		cancel()
		if k, _ := kindOf(err); err != nil && k != errNotFound {
			errs = append(errs, fmt.Errorf("delete instance %s: %w", si.Inst.ID, err))
			continue
		}
		p.book.Deleted(si.Inst.ID, p.opt.now())
		p.drop(si.Data.zone, si.Inst.ID) // no later instance of that name can claim it
		p.opt.Logger.Info("instance deleted", "runner", name, "instance", si.Inst.ID, "zone", si.Data.zone)
	}
	return errors.Join(errs...)
}
