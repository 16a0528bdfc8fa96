// Package azure runs runners on Azure VMs, one VM per runner, Spot or
// regular, through armcompute. Each VM carries the manager id, pool and
// runner name in its tags from its creation on, makes its NIC and public
// address with it and deletes them, and its OS disk, with it; it runs the
// runner's plan from its custom data with `runfleet agent` (package
// bootstrap), and powers itself off when the agent ends, when no job came
// within the idle timeout, or at its deadline, also when the manager is
// gone. A VM powered off from inside is still allocated (and billed)
// until deleted: the manager deletes it when it sees it stopped, and
// `runfleet gc` after a crash.
//
// The subscription's VMs are listed every poll interval in one call with
// their power state; a Spot VM deleted without being deleted here was
// evicted (evictionPolicy Delete), and is reported.
package azure

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/devtestlabs/armdevtestlabs"
	"golang.org/x/crypto/ssh"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Tags every VM carries, with the exact values.
const (
	TagManager = "runfleet-manager"
	TagPool    = "runfleet-pool"
	TagRunner  = "runfleet-runner"
)

// CallTimeout bounds each request to Azure but a creation's, which
// CreateTimeout bounds, polls included.
var (
	CallTimeout   = 30 * time.Second
	CreateTimeout = 15 * time.Minute
)

// Options configure a Provider.
type Options struct {
	API API
	// Subscription is the subscription's id, of the VMs' resource IDs.
	Subscription string
	Manager      string
	Pool         string
	Section      Section
	// IdleTimeout and Lifetime are the VM side's: a VM powers off when
	// no job came within IdleTimeout, and at Lifetime after it was
	// asked for whatever it runs.
	IdleTimeout, Lifetime time.Duration
	Calls                 *atomic.Int64 // requests sent, when counted
	// Listing is the subscription's listing, shared with its other
	// pools (one of the pool's own when nil).
	Listing *Listing
	Logger  *slog.Logger
	now     func() time.Time
}

// Provider is one pool's VMs.
type Provider struct {
	opt   Options
	image Image
	key   string // the admin's authorised key when the pool gives none
	watch vm.Poller
	fresh sync.Mutex // one list at a time
	book  vm.Book[where]
	desk  *vm.Desk // assignments waiting for their VMs; nil without handoff_url

	mu      sync.Mutex
	evicted map[string]string // spot VMs deleted by Azure: name → runner
}

// where is a VM's resource group, and whether it is Spot.
type where struct {
	group string
	spot  bool
}

type seenVM = vm.Entry[where]

// New makes the provider of one pool; nothing is called until List,
// Create or Watch.
func New(o Options) (*Provider, error) {
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
	img, err := ParseImage(o.Section.Image)
	if err != nil {
		return nil, fmt.Errorf("azure.image: %w", err)
	}
	key := strings.TrimSpace(o.Section.SSHPublicKey)
	if key == "" {
		// Azure wants a key where password login is off: one whose
		// private half is thrown away, so that nobody can log in.
		pub, _, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return nil, err
		}
		sk, err := ssh.NewPublicKey(pub)
		if err != nil {
			return nil, err
		}
		key = strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sk)))
	}
	if o.Lifetime > MaxScheduled { // Provider.scheduled
		o.Logger.Warn("max_lifetime is over a day: the VMs get no auto-shutdown schedule (it is daily), so a VM whose manager is gone is billed while stopped until it is deleted (runfleet gc)", "max_lifetime", o.Lifetime)
	}
	p := &Provider{opt: o, image: img, key: key, evicted: map[string]string{}}
	if u := vm.DeskURL(o.Section.HandoffURL, o.Pool); u != "" {
		a, err := newAttestation(o.Subscription, o.Section.AttestedRoots, o.now)
		if err != nil {
			return nil, err
		}
		p.desk = &vm.Desk{URL: u, Logger: o.Logger, Verify: a.verify}
	}
	p.watch = vm.Poller{Interval: o.Section.PollInterval.Duration, What: "listing VMs", Logger: o.Logger, Poll: p.poll}
	return p, nil
}

var (
	_ provider.Provider    = (*Provider)(nil)
	_ provider.Watcher     = (*Provider)(nil)
	_ provider.Preempter   = (*Provider)(nil)
	_ provider.Describer   = (*Provider)(nil)
	_ provider.CallCounter = (*Provider)(nil)
	_ provider.Handoffer   = (*Provider)(nil)
)

func (p *Provider) Traits() provider.Traits {
	return provider.Traits{KeepsBootData: true, Preemptible: p.opt.Section.Spot, BootGrace: EventsGrace}
}

// EventsGrace is how much longer than the pool's bootstrap_timeout a VM
// has to come online: its agent starts once Scheduled Events have
// answered (bootstrap.Paced), and the first answer can take two minutes.
const EventsGrace = 2 * time.Minute

// Honours says what a job of a dynamic pool may ask: spot=, in a Spot pool.
func (p *Provider) Honours() []string { return vm.Honours(p.opt.Section.Spot) }

func (p *Provider) Calls() int64 { return p.opt.Calls.Load() }

// Close stops the poller. VMs keep running.
func (p *Provider) Close() error {
	p.watch.Stop()
	return nil
}

// Create makes the runner's VM: the first size and location with
// capacity, Spot first when the pool asks for it, then regular when its
// fallback says so.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if inst, ok := p.book.Live(spec.Name); ok {
		return inst, nil
	}
	s := p.opt.Section
	h := p.desk.Handoff(SourceAttested, HandoffWait)
	script, err := customData(s, h, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	if err != nil {
		return provider.Instance{}, fmt.Errorf("%w: %w", provider.ErrRejected, err)
	}
	var made provider.Instance
	spot, fallback := vm.Market(s.Spot, s.SpotFallback == FallbackOnDemand, spec.Request.Spot)
	err = vm.Placement{
		Spot: spot, Fallback: fallback, Types: s.VMSizes, Places: s.Locations,
		What: "create VM", Standard: "regular", Limit: "Azure Resource Manager's request limit", Judge: judge, Logger: p.opt.Logger,
	}.Try(spec.Name, func(spot bool, size, loc string) (err error) {
		if spec.Record != nil {
			vm.Placed(spec, s.Image, size, loc, spot)
			if script, err = customData(s, h, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime); err != nil {
				return fmt.Errorf("%w: %w", provider.ErrRejected, err)
			}
		}
		made, err = p.create(ctx, spec, script, size, loc, spot)
		return err
	})
	return made, err
}

// judge says what an error of create means. A size or image not offered
// in one location is refused there: the others are tried.
func judge(err error) (vm.Outcome, string, string) {
	kind, code := kindOf(err)
	switch kind {
	case errCapacity:
		return vm.NoCapacity, code, ""
	case errFatal, errNotFound:
		return vm.Refused, code, brief(err)
	case errThrottle:
		return vm.Throttled, code, ""
	}
	return vm.Transient, code, ""
}

// briefError is an Azure error said in one line (brief), its chain kept
// for kindOf.
type briefError struct{ err error }

func (e briefError) Error() string { return brief(e.err) }
func (e briefError) Unwrap() error { return e.err }

// brief is an error in one line: an Azure answer's code, status and
// message, rather than the request and the whole body.
func brief(err error) string {
	var re *azcore.ResponseError
	if !errors.As(err, &re) {
		return err.Error()
	}
	out := fmt.Sprintf("%s (HTTP %d)", or(re.ErrorCode, "no code"), re.StatusCode)
	// Error() is the request, the status and code, then the body,
	// between lines of dashes.
	parts := strings.Split(re.Error(), strings.Repeat("-", 80))
	if len(parts) >= 3 {
		var body struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal([]byte(parts[2]), &body) == nil && body.Error.Message != "" {
			out += ": " + body.Error.Message
		}
	}
	return out
}

func market(spot bool) string {
	if spot {
		return "spot"
	}
	return "regular"
}

// create asks for one VM and waits for its creation: a VM Azure cannot
// place fails there, not at the request.
func (p *Provider) create(ctx context.Context, spec provider.Spec, script []byte, size, loc string, spot bool) (provider.Instance, error) {
	name := vmName(spec.Name)
	res := p.vmResource(spec, name, script, size, loc, spot)
	now := p.opt.now()
	inst := provider.Instance{ID: name, Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool, State: provider.StateCreated, Created: now}
	// Listed as coming up while it is made, so that a pass in the
	// meantime neither starts another nor deletes it.
	p.book.Launched(seenVM{Inst: inst, Data: where{group: p.opt.Section.ResourceGroup, spot: spot}})
	cctx, cancel := context.WithTimeout(ctx, CreateTimeout)
	vmID, err := p.opt.API.Create(cctx, p.opt.Section.ResourceGroup, name, res)
	cancel()
	if err != nil {
		if kind, _ := kindOf(err); kind == errOther {
			// Not known to have failed: it may come up; the listing
			// will tell.
			return provider.Instance{}, err
		}
		p.book.Failed(name)
		// A VM refused after its resource was made (an allocation
		// failure) stays, failed, until deleted; if this deletion
		// fails, the listing shows it and the pool deletes it.
		var made *madeFailed
		if errors.As(err, &made) {
			_ = p.deleteVM(ctx, p.opt.Section.ResourceGroup, name, spec.Name)
		}
		return provider.Instance{}, err
	}
	if err := p.hold(vmID, spec); err != nil {
		// A VM that could never take its runner's assignment.
		if derr := p.deleteVM(ctx, p.opt.Section.ResourceGroup, name, spec.Name); derr != nil {
			err = fmt.Errorf("%w; and deleting VM %s failed: %w", err, name, derr)
		}
		return provider.Instance{}, fmt.Errorf("%w: %w", provider.ErrRejected, err)
	}
	p.opt.Logger.Info("VM created", "runner", spec.Name, "vm", name, "size", size, "location", loc, "market", market(spot))
	p.schedule(ctx, name, loc, res.Tags, now.Add(p.opt.Lifetime))
	return inst, nil
}

// MaxScheduled is the longest lifetime an auto-shutdown schedule ends a
// VM at: the schedule is daily, so a later deadline would come first on
// an earlier day.
const MaxScheduled = 24 * time.Hour

// schedule gives a VM an auto-shutdown schedule at its deadline: a VM
// that powers itself off from inside is Stopped, still allocated and
// billed, and only deallocation (or deletion) ends that; with the
// manager gone, nothing else would. The schedule is Azure's own and
// needs no credential on the VM: the alternative, an identity on the VM
// allowed to deallocate it, would be a token a job step could read and
// use on other VMs. A schedule that cannot be made leaves the VM, said
// in the log: the manager still deletes it.
func (p *Provider) schedule(ctx context.Context, name, loc string, tags map[string]*string, deadline time.Time) {
	if !p.scheduled() {
		return // said once, in New
	}
	at := shutdownTime(p.opt.now(), deadline)
	sc := armdevtestlabs.Schedule{Location: to.Ptr(loc), Tags: tags, Properties: &armdevtestlabs.ScheduleProperties{
		Status: to.Ptr(armdevtestlabs.EnableStatusEnabled), TaskType: to.Ptr("ComputeVmShutdownTask"),
		DailyRecurrence: &armdevtestlabs.DayDetails{Time: to.Ptr(at.Format("1504"))}, TimeZoneID: to.Ptr("UTC"),
		TargetResourceID:     to.Ptr(vmID(p.opt.Subscription, p.opt.Section.ResourceGroup, name)),
		NotificationSettings: &armdevtestlabs.NotificationSettings{Status: to.Ptr(armdevtestlabs.EnableStatusDisabled)},
	}}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	err := p.opt.API.Schedule(cctx, p.opt.Section.ResourceGroup, name, sc)
	cancel()
	if err != nil {
		p.opt.Logger.Warn("VM has no auto-shutdown schedule: should this manager be gone, nothing deallocates it after its deadline, and it is billed while stopped until it is deleted (runfleet gc)",
			"vm", name, "err", brief(err))
		return
	}
	p.opt.Logger.Debug("VM's auto-shutdown scheduled", "vm", name, "at", at.Format("15:04 UTC"))
}

// scheduled says whether the pool's VMs get auto-shutdown schedules.
func (p *Provider) scheduled() bool { return p.opt.Lifetime <= MaxScheduled }

// shutdownTime is the time of day (UTC, whole minutes, as Azure takes it)
// at which a VM made at now is deallocated: the first such time after
// now must be its deadline or the minute before it. The minute after the
// deadline is taken where it still comes first, within a day of now.
func shutdownTime(now, deadline time.Time) time.Time {
	at := deadline.UTC().Truncate(time.Minute)
	if next := at.Add(time.Minute); at.Before(deadline) && next.Sub(now) < 24*time.Hour {
		at = next
	}
	return at
}

func vmID(sub, group, name string) string {
	return "/subscriptions/" + sub + "/resourceGroups/" + group + "/providers/Microsoft.Compute/virtualMachines/" + name
}

// vmResource is the VM asked for: tagged, its NIC, public address and
// OS disk deleted with it, Spot ones deleted when evicted.
func (p *Provider) vmResource(spec provider.Spec, name string, script []byte, size, loc string, spot bool) armcompute.VirtualMachine {
	s := p.opt.Section
	tags := map[string]*string{TagManager: to.Ptr(spec.Manager), TagPool: to.Ptr(spec.Pool), TagRunner: to.Ptr(spec.Name)}
	for k, v := range s.Tags {
		tags[k] = to.Ptr(v)
	}
	img := &armcompute.ImageReference{}
	if p.image.ID != "" {
		img.ID = to.Ptr(p.image.ID)
	} else {
		img.Publisher, img.Offer, img.SKU, img.Version = &p.image.Publisher, &p.image.Offer, &p.image.SKU, &p.image.Version
	}
	disk := &armcompute.OSDisk{
		CreateOption: to.Ptr(armcompute.DiskCreateOptionTypesFromImage), DeleteOption: to.Ptr(armcompute.DiskDeleteOptionTypesDelete),
		ManagedDisk: &armcompute.ManagedDiskParameters{StorageAccountType: to.Ptr(armcompute.StorageAccountTypes(s.Disk.Type))},
	}
	if s.Disk.SizeGB > 0 {
		disk.DiskSizeGB = to.Ptr(int32(s.Disk.SizeGB))
	}
	ipc := &armcompute.VirtualMachineNetworkInterfaceIPConfiguration{Name: to.Ptr("ipconfig"), Properties: &armcompute.VirtualMachineNetworkInterfaceIPConfigurationProperties{
		Primary: to.Ptr(true), Subnet: &armcompute.SubResource{ID: to.Ptr(s.Subnets[loc])},
	}}
	if *s.PublicIP {
		ipc.Properties.PublicIPAddressConfiguration = &armcompute.VirtualMachinePublicIPAddressConfiguration{
			Name: to.Ptr(name + "-ip"), Tags: tags,
			Properties: &armcompute.VirtualMachinePublicIPAddressConfigurationProperties{DeleteOption: to.Ptr(armcompute.DeleteOptionsDelete),
				PublicIPAllocationMethod: to.Ptr(armcompute.PublicIPAllocationMethodStatic)},
			SKU: &armcompute.PublicIPAddressSKU{Name: to.Ptr(armcompute.PublicIPAddressSKUNameStandard)},
		}
	}
	admin := s.AdminUser
	props := &armcompute.VirtualMachineProperties{
		HardwareProfile: &armcompute.HardwareProfile{VMSize: to.Ptr(armcompute.VirtualMachineSizeTypes(size))},
		StorageProfile:  &armcompute.StorageProfile{ImageReference: img, OSDisk: disk},
		OSProfile: &armcompute.OSProfile{ComputerName: to.Ptr(name), AdminUsername: to.Ptr(admin),
			CustomData: to.Ptr(base64.StdEncoding.EncodeToString(script)),
			LinuxConfiguration: &armcompute.LinuxConfiguration{DisablePasswordAuthentication: to.Ptr(true),
				SSH: &armcompute.SSHConfiguration{PublicKeys: []*armcompute.SSHPublicKey{{Path: to.Ptr("/home/" + admin + "/.ssh/authorized_keys"), KeyData: to.Ptr(p.key)}}}},
		},
		NetworkProfile: &armcompute.NetworkProfile{
			NetworkAPIVersion: to.Ptr(armcompute.NetworkAPIVersionTwoThousandTwenty1101),
			NetworkInterfaceConfigurations: []*armcompute.VirtualMachineNetworkInterfaceConfiguration{{Name: to.Ptr(name + "-nic"), Tags: tags,
				Properties: &armcompute.VirtualMachineNetworkInterfaceConfigurationProperties{Primary: to.Ptr(true),
					DeleteOption: to.Ptr(armcompute.DeleteOptionsDelete), IPConfigurations: []*armcompute.VirtualMachineNetworkInterfaceIPConfiguration{ipc}}}},
		},
		Priority: to.Ptr(armcompute.VirtualMachinePriorityTypesRegular),
	}
	if spot {
		props.Priority = to.Ptr(armcompute.VirtualMachinePriorityTypesSpot)
		props.EvictionPolicy = to.Ptr(armcompute.VirtualMachineEvictionPolicyTypesDelete)
		props.BillingProfile = &armcompute.BillingProfile{MaxPrice: to.Ptr(*s.MaxPrice)}
	}
	out := armcompute.VirtualMachine{Location: to.Ptr(loc), Tags: tags, Properties: props}
	if s.Identity != "" {
		out.Identity = &armcompute.VirtualMachineIdentity{Type: to.Ptr(armcompute.ResourceIdentityTypeUserAssigned),
			UserAssignedIdentities: map[string]*armcompute.UserAssignedIdentitiesValue{s.Identity: {}}}
	}
	return out
}

var unsafeName = regexp.MustCompile(`[^a-z0-9-]+`)

// vmName is a new VM's name (and host name): the runner's, made a valid
// name, and a random suffix, so that a slot's next VM can be made while
// its last one is deleted.
func vmName(runner string) string {
	base := strings.Trim(unsafeName.ReplaceAllString(strings.ToLower(runner), "-"), "-")
	if base == "" {
		base = "rf"
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return strings.TrimRight(base[:min(len(base), 56)], "-") + "-" + hex.EncodeToString(b)
}

// Delete deletes the runner's VMs; their NICs, public addresses and
// disks go with them. One already gone is no error. The deletion is not
// waited for: a VM being deleted is hidden from List, and listed again
// should the deletion fail.
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
	for _, sv := range found {
		if err := p.deleteVM(ctx, sv.Data.group, sv.Inst.ID, name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// deleteVM starts a VM's deletion and hides it from List. Its
// auto-shutdown schedule goes first: nothing deletes it with the VM. A
// schedule that cannot be deleted does not keep the VM, which costs: gc
// sweeps the schedule.
func (p *Provider) deleteVM(ctx context.Context, group, id, runner string) error {
	if p.scheduled() {
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		err := p.opt.API.Unschedule(cctx, group, id)
		cancel()
		if err != nil {
			p.opt.Logger.Warn("could not delete a VM's auto-shutdown schedule; deleting the VM all the same (runfleet gc deletes the schedule)", "vm", id, "err", brief(err))
		}
	}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	err := p.opt.API.Delete(cctx, group, id)
	cancel()
	if k, _ := kindOf(err); err != nil && k != errNotFound {
		return fmt.Errorf("delete VM %s: %s", id, brief(err))
	}
	p.book.Deleted(id, p.opt.now())
	p.opt.Logger.Info("VM deleted", "runner", runner, "vm", id)
	return nil
}
