// Package azure runs runners on Azure VMs, one VM per runner, Spot or
// regular, through armcompute. Each VM carries the manager id, pool and
// runner name in its tags from its creation on, makes its NIC and public
// address with it and deletes them, and its OS disk, with it; it runs the
// runner's plan from its custom data with `runfleet agent` (package
// bootstrap), and powers itself off when the agent ends, when no job came
// within the idle timeout, or at its deadline, also when the manager is
// gone. A VM powered off from inside is still allocated (and billed)
// until deleted: the manager deletes it when it sees it stopped, Compute
// Schedule deallocates it at its deadline when no manager did, and
// `runfleet gc` deletes it after a crash.
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
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"golang.org/x/crypto/ssh"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Tags every VM carries, with the exact values.
const (
	TagManager = "runfleet-manager"
	TagPool    = "runfleet-pool"
	TagRunner  = "runfleet-runner"
)

// CallTimeout bounds each request to Azure; CreateTimeout the wait for a
// VM to be made (made).
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
	// Prices reads the VMs' prices for their records (price.go); nil
	// leaves them unpriced.
	Prices *RetailPrices
	Logger *slog.Logger
	now    func() time.Time
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
	// deadlines submits the VMs' deallocations at their deadlines.
	deadlines *deadlines
	// catalogue is what the pool's VM sizes have, for jobs that choose
	// their size.
	catalogue vm.Catalogue

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
	p := &Provider{opt: o, image: img, key: key, evicted: map[string]string{}}
	if !p.scheduled() {
		o.Logger.Warn("max_lifetime is over 13 days: the VMs get no deallocation at their deadline (Compute Schedule takes one at most 14 days ahead), so a VM whose manager is gone is billed while stopped until it is deleted (runfleet gc)", "max_lifetime", o.Lifetime)
	}
	p.deadlines = newDeadlines(o.API, o.Logger)
	p.catalogue.Types, p.catalogue.Cloud, p.catalogue.Read = o.Section.VMSizes, "Azure", p.readSizes
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
	return provider.Traits{KeepsBootData: true, Preemptible: p.opt.Section.Spot, BootGrace: EventsGrace}
}

// EventsGrace is how much longer than the pool's bootstrap_timeout a VM
// has to come online: its agent starts once Scheduled Events have
// answered (bootstrap.Paced), and the first answer can take two minutes.
const EventsGrace = 2 * time.Minute

// Honours says what a job of a dynamic pool may ask: spot=, in a Spot
// pool, and its VM's CPUs, memory and GPUs, met by the pool's VM sizes
// (sizes.go).
func (p *Provider) Honours() []string { return vm.Honours(p.opt.Section.Spot, true) }

func (p *Provider) Calls() int64 { return p.opt.Calls.Load() }

// Close stops the poller and sends the deallocations not yet sent. VMs
// keep running.
func (p *Provider) Close() error {
	p.watch.Stop()
	p.deadlines.close()
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
	choices, err := p.catalogue.TypesFor(ctx, spec.Request)
	if err != nil {
		return provider.Instance{}, err
	}
	var made provider.Instance
	spot, fallback := vm.Market(s.Spot, s.SpotFallback == FallbackOnDemand, spec.Request.Spot)
	err = vm.TryBoot(vm.Placement{
		Spot: spot, Fallback: fallback, Types: choices, Places: s.Locations,
		What: "create VM", Standard: "regular", Limit: "Azure Resource Manager's request limit", Judge: judge, Logger: p.opt.Logger,
	}, spec, s.Image, func() ([]byte, error) {
		return customData(s, h, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	}, func(spot bool, size, loc string, script []byte) (err error) {
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

// create asks for one VM and waits until the subscription's listing
// says how its creation ended: a VM Azure cannot place fails there, not
// at the request. The creation's own operation is not polled, so a VM
// costs its creation, its deallocation's share of a batch, and its
// deletion (and its share of listings the pools make anyway).
func (p *Provider) create(ctx context.Context, spec provider.Spec, script []byte, size, loc string, spot bool) (provider.Instance, error) {
	name := vmName(spec.Name)
	res := p.vmResource(spec, name, script, size, loc, spot)
	now := p.opt.now()
	group := p.opt.Section.ResourceGroup
	inst := provider.Instance{ID: name, Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool, State: provider.StateCreated, Created: now}
	// Listed as coming up while it is made, so that a pass in the
	// meantime neither starts another nor deletes it.
	p.book.Launched(seenVM{Inst: inst, Data: where{group: group, spot: spot}})
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	id, err := p.opt.API.Create(cctx, group, name, res)
	cancel()
	if err != nil {
		if kind, _ := kindOf(err); kind == errOther {
			// Not known to have failed: it may come up; the listing
			// will tell.
			return provider.Instance{}, err
		}
		p.book.Failed(name)
		return provider.Instance{}, err
	}
	// Held before the VM is made: it may ask as soon as it boots.
	if err := p.hold(id, spec); err != nil {
		// A VM that could never take its runner's assignment.
		if derr := p.deleteVM(ctx, group, name, spec.Name); derr != nil {
			err = fmt.Errorf("%w; and deleting VM %s failed: %w", err, name, derr)
		}
		return provider.Instance{}, provider.Rejected(err)
	}
	if err := p.made(ctx, group, name); err != nil {
		p.desk.Drop(strings.ToLower(id))
		if kind, _ := kindOf(err); kind == errOther && ctx.Err() != nil {
			return provider.Instance{}, err // the listing will tell
		}
		p.book.Failed(name)
		// A VM that failed stays, failed, until deleted; if this
		// deletion fails, the listing shows it and the pool deletes it.
		_ = p.deleteVM(ctx, group, name, spec.Name)
		return provider.Instance{}, err
	}
	p.opt.Logger.Info("VM created", "runner", spec.Name, "vm", name, "size", size, "location", loc, "market", market(spot))
	if p.scheduled() {
		p.deadlines.add(loc, vmID(p.opt.Subscription, group, name), now.Add(p.opt.Lifetime))
	}
	return inst, nil
}

// made waits until the subscription's listing, which the VMs being made
// share (one listing a PollInterval, however many wait), shows a VM
// made, or failed: then its error code and message say why
// (ProvisioningState/failed/<code>). A listing that fails is asked again
// later and later; while Compute throttles listings (a policy of their
// own, whose Retry-After can be twenty minutes), the VM is read by
// itself, a cheap read of another policy.
func (p *Provider) made(ctx context.Context, group, name string) error {
	ctx, cancel := context.WithTimeout(ctx, CreateTimeout)
	defer cancel()
	wait := PollInterval
	for {
		lctx, cancel := context.WithTimeout(ctx, CallTimeout)
		all, _, err := p.opt.Listing.Get(lctx, PollInterval, p.opt.now, p.opt.API.List)
		cancel()
		if k, _ := kindOf(err); k == errThrottle {
			cctx, cancel := context.WithTimeout(ctx, CallTimeout)
			v, gerr := p.opt.API.Get(cctx, group, name)
			cancel()
			if gerr == nil {
				all, err = []*armcompute.VirtualMachine{v}, nil
			}
		}
		if err == nil {
			wait = PollInterval
			for _, v := range all {
				if !strings.EqualFold(deref(v.Name), name) || !strings.EqualFold(groupOf(deref(v.ID)), group) {
					continue
				}
				if done, err := outcome(v); done {
					return err
				}
			}
		} else {
			wait = min(2*wait, time.Minute)
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = fmt.Errorf("VM %s was not made within %s", name, CreateTimeout)
			}
			return fmt.Errorf("%w (%w)", ctx.Err(), briefError{err})
		case <-time.After(wait):
		}
	}
}

// outcome says whether a VM's creation has ended, and how: made
// (provisioning succeeded, or it runs), or failed.
func outcome(v *armcompute.VirtualMachine) (bool, error) {
	props := v.Properties
	if props == nil {
		return false, nil
	}
	if iv := props.InstanceView; iv != nil {
		for _, st := range iv.Statuses {
			code := deref(st.Code)
			if c, ok := strings.CutPrefix(code, "ProvisioningState/failed"); ok {
				return true, &provisionFailed{code: strings.TrimPrefix(c, "/"), message: deref(st.Message)}
			}
			if strings.EqualFold(code, "ProvisioningState/succeeded") || strings.EqualFold(code, "PowerState/running") {
				return true, nil
			}
		}
	}
	switch strings.ToLower(deref(props.ProvisioningState)) {
	case "succeeded":
		return true, nil
	case "failed":
		return true, &provisionFailed{}
	}
	return false, nil
}

// provisionFailed is a creation Azure took and then failed: the VM's
// resource is there, failed, until deleted.
type provisionFailed struct{ code, message string }

func (e *provisionFailed) Error() string {
	switch {
	case e.code == "":
		return "provisioning failed"
	case e.message == "":
		return e.code
	}
	return e.code + ": " + e.message
}

// MaxScheduled is the furthest ahead Compute Schedule deallocates a VM
// (14 days: Azure/azure-cli-extensions, src/computeschedule/README.md).
const MaxScheduled = 14 * 24 * time.Hour

// scheduled says whether the pool's VMs get a deallocation at their
// deadline.
func (p *Provider) scheduled() bool { return p.opt.Lifetime <= MaxScheduled-time.Hour }

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

var unsafeName = lazyregexp.New(`[^a-z0-9-]+`)

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
// deallocation, submitted for its deadline, is left: at that time it
// finds no VM, which costs nothing.
func (p *Provider) deleteVM(ctx context.Context, group, id, runner string) error {
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
