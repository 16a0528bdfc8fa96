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
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
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
	API            API
	SubscriptionID string
	Manager        string
	Pool           string
	Section        Section
	// IdleTimeout and Lifetime are the VM side's: a VM powers off when
	// no job came within IdleTimeout, and at Lifetime after it was
	// asked for whatever it runs.
	IdleTimeout, Lifetime time.Duration
	Calls                 *atomic.Int64 // requests sent, when counted
	Logger                *slog.Logger
	now                   func() time.Time
}

// Provider is one pool's VMs.
type Provider struct {
	opt   Options
	image Image
	key   string // the admin's authorised key when the pool gives none
	watch vm.Poller
	fresh sync.Mutex // one list at a time

	mu       sync.Mutex
	seen     map[string]seenVM // by VM name, from the last list
	seenAt   time.Time
	launched map[string]seenVM    // by name: asked for, not yet listed
	gone     map[string]time.Time // names deleted here, hidden from List
	evicted  map[string]string    // spot VMs deleted by Azure: name → runner
}

type seenVM struct {
	inst  provider.Instance
	group string
	spot  bool
}

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
	p := &Provider{opt: o, image: img, key: key, seen: map[string]seenVM{}, launched: map[string]seenVM{},
		gone: map[string]time.Time{}, evicted: map[string]string{}}
	p.watch = vm.Poller{Interval: o.Section.PollInterval.Duration, What: "listing VMs", Logger: o.Logger, Poll: p.poll}
	return p, nil
}

var (
	_ provider.Provider    = (*Provider)(nil)
	_ provider.Watcher     = (*Provider)(nil)
	_ provider.Preempter   = (*Provider)(nil)
	_ provider.Describer   = (*Provider)(nil)
	_ provider.CallCounter = (*Provider)(nil)
)

func (p *Provider) Traits() provider.Traits {
	return provider.Traits{Preemptible: p.opt.Section.Spot}
}

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
	if inst, ok := p.live(spec.Name); ok {
		return inst, nil
	}
	s := p.opt.Section
	script, err := customData(s, spec, p.opt.now(), p.opt.IdleTimeout, p.opt.Lifetime)
	if err != nil {
		return provider.Instance{}, fmt.Errorf("%w: %w", provider.ErrRejected, err)
	}
	markets := []bool{s.Spot}
	if s.Spot && s.SpotFallback == FallbackOnDemand {
		markets = append(markets, false)
	}
	var tried, fatal []string
	for _, spot := range markets {
		for _, size := range s.VMSizes {
			for _, loc := range s.Locations {
				inst, err := p.create(ctx, spec, script, size, loc, spot)
				if err == nil {
					return inst, nil
				}
				kind, code := kindOf(err)
				switch kind {
				case errCapacity:
					tried = append(tried, fmt.Sprintf("%s %s in %s: %s", market(spot), size, loc, code))
					p.opt.Logger.Info("no capacity; trying the next", "runner", spec.Name, "size", size, "location", loc, "market", market(spot), "code", code)
					continue
				case errFatal, errNotFound:
					// A size or image not offered in one location is
					// refused there: the others are tried, and the pool
					// halts only if all refuse.
					fatal = append(fatal, fmt.Sprintf("%s in %s: %s", size, loc, brief(err)))
					continue
				case errThrottle:
					return provider.Instance{}, fmt.Errorf("create VM: Azure Resource Manager's request limit is spent (%s); the pool backs off: %s", code, brief(err))
				}
				return provider.Instance{}, fmt.Errorf("create VM: %s: %w", brief(err), err)
			}
		}
	}
	if len(tried) == 0 && len(fatal) > 0 {
		return provider.Instance{}, fmt.Errorf("%w: create VM: %s", provider.ErrRejected, strings.Join(fatal, "; "))
	}
	why := "no capacity: " + strings.Join(append(tried, fatal...), "; ")
	if s.Spot && s.SpotFallback != FallbackOnDemand {
		why += " (spot_fallback: on_demand would start a regular VM)"
	}
	return provider.Instance{}, errors.New(why)
}

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
	p.mu.Lock()
	p.launched[name] = seenVM{inst: inst, group: p.opt.Section.ResourceGroup, spot: spot}
	p.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, CreateTimeout)
	err := p.opt.API.Create(cctx, p.opt.Section.ResourceGroup, name, res)
	cancel()
	if err != nil {
		if kind, _ := kindOf(err); kind == errOther {
			// Not known to have failed: it may come up; the listing
			// will tell.
			return provider.Instance{}, err
		}
		p.mu.Lock()
		delete(p.launched, name)
		p.mu.Unlock()
		// A VM refused after its resource was made (an allocation
		// failure) stays, failed, until deleted; if this deletion
		// fails, the listing shows it and the pool deletes it.
		var made *madeFailed
		if errors.As(err, &made) {
			_ = p.deleteVM(ctx, p.opt.Section.ResourceGroup, name, spec.Name)
		}
		return provider.Instance{}, err
	}
	p.opt.Logger.Info("VM created", "runner", spec.Name, "vm", name, "size", size, "location", loc, "market", market(spot))
	return inst, nil
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

// live returns the runner's VM when one is coming up or running.
func (p *Provider) live(name string) (provider.Instance, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, sv := range p.view() {
		if sv.inst.Name == name && sv.inst.State != provider.StateExited {
			return sv.inst, true
		}
	}
	return provider.Instance{}, false
}

// Delete deletes the runner's VMs; their NICs, public addresses and
// disks go with them. One already gone is no error. The deletion is not
// waited for: a VM being deleted is hidden from List, and listed again
// should the deletion fail.
func (p *Provider) Delete(ctx context.Context, name string) error {
	p.mu.Lock()
	var found []seenVM
	for _, sv := range p.view() {
		if sv.inst.Name == name {
			found = append(found, sv)
		}
	}
	p.mu.Unlock()
	if len(found) == 0 {
		// Not seen here: made by an earlier manager, not listed yet.
		var err error
		if found, err = p.list(ctx, p.opt.Manager, p.opt.Pool, name); err != nil {
			return err
		}
	}
	var errs []error
	for _, sv := range found {
		if err := p.deleteVM(ctx, sv.group, sv.inst.ID, name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// deleteVM starts a VM's deletion and hides it from List.
func (p *Provider) deleteVM(ctx context.Context, group, id, runner string) error {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	err := p.opt.API.Delete(cctx, group, id)
	cancel()
	if k, _ := kindOf(err); err != nil && k != errNotFound {
		return fmt.Errorf("delete VM %s: %s", id, brief(err))
	}
	p.mu.Lock()
	p.gone[id] = p.opt.now()
	delete(p.launched, id)
	p.mu.Unlock()
	p.opt.Logger.Info("VM deleted", "runner", runner, "vm", id)
	return nil
}

// view merges what was listed with what was asked for since, less what
// was deleted here. Called with p.mu held.
func (p *Provider) view() []seenVM {
	out := make([]seenVM, 0, len(p.seen)+len(p.launched))
	for name, sv := range p.seen {
		if _, hidden := p.gone[name]; !hidden {
			out = append(out, sv)
		}
	}
	for name, sv := range p.launched {
		if _, listed := p.seen[name]; !listed {
			out = append(out, sv)
		}
	}
	slices.SortFunc(out, func(a, b seenVM) int { return strings.Compare(a.inst.ID, b.inst.ID) })
	return out
}
