package azure

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider/vm"
)

// Section is a pool's `azure:` section: where its VMs run and what they
// are. Credentials are never written here: they come from CML's
// AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID (a service
// principal), or azidentity's default chain (workload identity, the
// manager's managed identity, the Azure CLI's login).
type Section struct {
	// SubscriptionID is the pool's subscription; AZURE_SUBSCRIPTION_ID
	// when empty.
	SubscriptionID string `json:"subscription_id"`
	// ResourceGroup holds the pool's VMs (and their NICs, public
	// addresses and disks, deleted with them).
	ResourceGroup string `json:"resource_group"`
	// Locations are tried in order when one has no capacity.
	Locations []string `json:"locations"`
	// Subnets are the subnet (resource ID) of each location's VMs;
	// Subnet is the one of a single location.
	Subnets map[string]string `json:"subnets"`
	Subnet  string            `json:"subnet"`
	// Endpoint replaces Azure Resource Manager's (a sovereign cloud, a
	// stand-in); AuthorityHost Entra ID's (AZURE_AUTHORITY_HOST when
	// empty).
	Endpoint      string `json:"endpoint"`
	AuthorityHost string `json:"authority_host"`
	// RetailPricesURL replaces the Retail Prices API's
	// (DefaultRetailPricesURL; a mirror, a stand-in), from which the
	// VMs' prices are read for their records where the pool sets none.
	RetailPricesURL string `json:"retail_prices_url"`

	// Image is the OS disk's image: a marketplace URN
	// (Publisher:Offer:Sku:Version) or an image or gallery image
	// version's resource ID. It must hold the forge's agent, runfleet
	// (which starts the agent and powers the machine off) and whatever
	// the jobs need.
	Image string `json:"image"`
	// VMSizes are tried in order when one has no capacity
	// (Standard_NC4as_T4_v3, Standard_D8s_v5).
	VMSizes []string `json:"vm_sizes"`
	Disk    Disk     `json:"disk"`
	// PublicIP gives the VM a public address (true when not given),
	// which it needs to reach the forge without a NAT gateway.
	PublicIP *bool `json:"public_ip"`
	// Identity is a user-assigned managed identity (its resource ID)
	// that gives jobs a cloud identity. Without one a VM holds no cloud
	// credential at all.
	Identity string `json:"identity"`
	// HandoffURL is the manager's webhook listener as the VMs reach it
	// (http://10.0.0.4:8080). With it, no credential is put in a VM's
	// custom data: the VM proves who it is with its attested data and
	// takes its runner's assignment from the manager once (vm.Desk).
	HandoffURL string `json:"handoff_url"`
	// AttestedRoots is a PEM file of the roots the attested data's
	// certificates chain to (the system's when empty).
	AttestedRoots string            `json:"attested_roots"`
	Tags          map[string]string `json:"tags"`

	// Spot asks for Spot VMs, deleted when Azure evicts them, at most
	// MaxPrice dollars an hour (-1, the default: up to the pay-as-you-go
	// price). SpotFallback "on_demand" starts a regular VM when no size
	// or location has spot capacity.
	Spot         bool     `json:"spot"`
	SpotFallback string   `json:"spot_fallback"`
	MaxPrice     *float64 `json:"max_price"`

	// AdminUser is the VM's administrator (password login is off).
	AdminUser string `json:"admin_user"`
	// StartupScript runs as root before the agent starts (installs,
	// mounts); a failing one powers the VM off.
	StartupScript string `json:"startup_script"`
	// SSHPublicKey is authorised for AdminUser and root; without one,
	// nobody can log in.
	SSHPublicKey string `json:"ssh_public_key"`
	// Runfleet is runfleet on the image ("runfleet" in its PATH).
	Runfleet string `json:"runfleet"`
	// Install is what a stock image lacks, fetched and checked by the
	// boot script before it starts anything: runfleet and the forge's
	// agent (vm.Install).
	Install vm.Install `json:"install"`
	// Workdir is the agent's working directory on the VM.
	Workdir string `json:"workdir"`
	// IdleTimeout powers a VM off when no job came within it, also when
	// the manager is gone (the pool's idle_timeout and a minute, or 5m,
	// when not given).
	IdleTimeout config.Duration `json:"idle_timeout"`
	// PollInterval is how often the pool's VMs are listed (5s).
	PollInterval config.Duration `json:"poll_interval"`
}

// Disk is the OS disk, deleted with the VM.
type Disk struct {
	SizeGB int    `json:"size_gb"`
	Type   string `json:"type"` // StandardSSD_LRS when empty
}

// Defaults.
const (
	DefaultWorkdir      = "/var/lib/runfleet/work"
	DefaultPollInterval = 5 * time.Second
	DefaultIdleTimeout  = 5 * time.Minute // CML's --idle-timeout
	// DefaultLifetime is a VM's deadline when the pool sets no
	// max_lifetime: no machine runs for ever.
	DefaultLifetime  = 24 * time.Hour
	DefaultDiskType  = "StandardSSD_LRS"
	DefaultAdminUser = "runfleet"
	FallbackOnDemand = "on_demand"
)

var (
	uuidRE     = lazyregexp.New(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
	groupRE    = lazyregexp.New(`^[-\w._()]{0,89}[-\w_()]$`)
	locationRE = lazyregexp.New(`^[a-z][a-z0-9]+$`)
	sizeRE     = lazyregexp.New(`^(Standard|Basic)_[A-Za-z0-9_-]+$`)
	subnetRE   = lazyregexp.New(`(?i)^/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Network/virtualNetworks/[^/]+/subnets/[^/]+$`)
	identityRE = lazyregexp.New(`(?i)^/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.ManagedIdentity/userAssignedIdentities/[^/]+$`)
	imageIDRE  = lazyregexp.New(`(?i)^/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/(images/[^/]+|galleries/[^/]+/images/[^/]+(/versions/[^/]+)?)$`)
	diskTypes  = map[string]bool{"Standard_LRS": true, "StandardSSD_LRS": true, "Premium_LRS": true, "StandardSSD_ZRS": true, "Premium_ZRS": true, "PremiumV2_LRS": true}
	adminRE    = lazyregexp.New(`^[a-z_][a-z0-9_-]{0,31}$`)
	// Names Azure keeps for itself (as the admin user).
	reservedUsers = map[string]bool{"root": true, "admin": true, "administrator": true, "guest": true, "user": true, "test": true, "sys": true}
)

// DecodeSection decodes and checks a pool's section, with defaults.
func DecodeSection(raw json.RawMessage) (Section, error) {
	var s Section
	// An unknown key does not stop the checks: one error names every
	// problem.
	decodeErr := config.DecodeSection(raw, &s)
	if s.Workdir == "" {
		s.Workdir = DefaultWorkdir
	}
	if s.Runfleet == "" {
		s.Runfleet = "runfleet"
	}
	if s.AdminUser == "" {
		s.AdminUser = DefaultAdminUser
	}
	if !s.PollInterval.Given() {
		s.PollInterval = config.D(DefaultPollInterval)
	}
	if s.Disk.Type == "" {
		s.Disk.Type = DefaultDiskType
	}
	if s.PublicIP == nil {
		yes := true
		s.PublicIP = &yes
	}
	if s.MaxPrice == nil {
		upTo := -1.0 // the pay-as-you-go price
		s.MaxPrice = &upTo
	}
	if s.Subnet != "" && len(s.Locations) == 1 && s.Subnets[s.Locations[0]] == "" {
		if s.Subnets == nil {
			s.Subnets = map[string]string{}
		}
		s.Subnets[s.Locations[0]] = s.Subnet
	}
	return s, config.Within("azure", errors.Join(decodeErr, s.check()))
}

// Image is an image reference read from Section.Image.
type Image struct {
	Publisher, Offer, SKU, Version string
	ID                             string
}

// ParseImage reads a marketplace URN or an image's resource ID.
func ParseImage(s string) (Image, error) {
	if strings.HasPrefix(s, "/") {
		if !imageIDRE.MatchString(s) {
			return Image{}, fmt.Errorf("%q is not an image's resource ID (/subscriptions/S/resourceGroups/G/providers/Microsoft.Compute/images/NAME, or a gallery image version's)", s)
		}
		return Image{ID: s}, nil
	}
	parts := strings.Split(s, ":")
	if len(parts) != 4 || slices.ContainsFunc(parts, func(p string) bool { return strings.TrimSpace(p) == "" }) {
		return Image{}, fmt.Errorf("%q is not an image URN (Publisher:Offer:Sku:Version) or resource ID", s)
	}
	return Image{Publisher: parts[0], Offer: parts[1], SKU: parts[2], Version: parts[3]}, nil
}

func (s Section) check() error {
	errs := []error{s.Install.Check()}
	add := func(field, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...)))
	}
	if s.SubscriptionID != "" && !uuidRE.MatchString(s.SubscriptionID) {
		add("subscription_id", "%q is not a subscription id (a GUID)", s.SubscriptionID)
	}
	if h := s.HandoffURL; h != "" {
		if u, err := url.Parse(h); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			add("handoff_url", "%q is not an http(s) URL without a query (the manager's listen address as the VMs reach it)", h)
		}
	}
	if s.AttestedRoots != "" && s.HandoffURL == "" {
		add("attested_roots", "is set, but handoff_url is not")
	}
	switch {
	case s.ResourceGroup == "":
		add("resource_group", "is required: the resource group the pool's VMs go in")
	case !groupRE.MatchString(s.ResourceGroup):
		add("resource_group", "%q is not a resource group name (letters, digits, . _ - ( ), at most 90, not ending in .)", s.ResourceGroup)
	}
	if len(s.Locations) == 0 {
		add("locations", "at least one is required (eastus, westeurope, ...)")
	}
	for i, l := range s.Locations {
		if !locationRE.MatchString(l) {
			add(fmt.Sprintf("locations[%d]", i), "%q is not a location (eastus, westeurope)", l)
		} else if s.Subnets[l] == "" {
			add("subnets."+l, "no subnet for location %s: give its resource ID (subnet: when the pool has one location)", l)
		}
	}
	if s.Subnet != "" && len(s.Locations) > 1 {
		add("subnet", "is for one location; with %d give subnets: {location: ID}", len(s.Locations))
	}
	for l, id := range s.Subnets {
		if !subnetRE.MatchString(id) {
			add("subnets."+l, "%q is not a subnet's resource ID (/subscriptions/S/resourceGroups/G/providers/Microsoft.Network/virtualNetworks/V/subnets/N)", id)
		}
	}
	for _, e := range [][2]string{{"endpoint", s.Endpoint}, {"authority_host", s.AuthorityHost}} {
		if u := e[1]; u != "" {
			if pu, err := url.Parse(u); err != nil || pu.Scheme != "https" || pu.Host == "" {
				add(e[0], "%q is not an https URL (credentials are sent there)", u)
			}
		}
	}
	if u := s.RetailPricesURL; u != "" {
		if pu, err := url.Parse(u); err != nil || (pu.Scheme != "https" && pu.Scheme != "http") || pu.Host == "" || pu.RawQuery != "" {
			add("retail_prices_url", "%q is not an http(s) URL without a query", u)
		}
	}
	if s.Image == "" {
		add("image", "is required (Publisher:Offer:Sku:Version, or an image's resource ID)")
	} else if _, err := ParseImage(s.Image); err != nil {
		add("image", "%v", err)
	}
	if len(s.VMSizes) == 0 {
		add("vm_sizes", "at least one is required (Standard_NC4as_T4_v3, Standard_D8s_v5, ...)")
	}
	for i, t := range s.VMSizes {
		if !sizeRE.MatchString(t) {
			add(fmt.Sprintf("vm_sizes[%d]", i), "%q is not a VM size (Standard_D8s_v5)", t)
		}
	}
	if d := s.Disk; d.SizeGB < 0 || d.SizeGB > 4095 {
		add("disk.size_gb", "%d is not between 30 and 4095", d.SizeGB)
	} else if d.SizeGB > 0 && d.SizeGB < 30 {
		add("disk.size_gb", "%d is under the 30 GB of Azure's Linux images", d.SizeGB)
	}
	if !diskTypes[s.Disk.Type] {
		add("disk.type", "%q is not a disk type (StandardSSD_LRS, Premium_LRS, Standard_LRS, ...)", s.Disk.Type)
	}
	if s.Identity != "" && !identityRE.MatchString(s.Identity) {
		add("identity", "%q is not a user-assigned identity's resource ID", s.Identity)
	}
	if s.MaxPrice != nil && *s.MaxPrice != -1 && *s.MaxPrice <= 0 {
		add("max_price", "%g: give dollars an hour, or -1 for up to the pay-as-you-go price", *s.MaxPrice)
	}
	if s.MaxPrice != nil && *s.MaxPrice != -1 && !s.Spot {
		add("max_price", "is set, but spot is not")
	}
	switch s.SpotFallback {
	case "", "none":
	case FallbackOnDemand:
		if !s.Spot {
			add("spot_fallback", "is set, but spot is not")
		}
	default:
		add("spot_fallback", "%q must be on_demand or none", s.SpotFallback)
	}
	if !adminRE.MatchString(s.AdminUser) || reservedUsers[s.AdminUser] {
		add("admin_user", "%q is not a name Azure takes for a Linux administrator", s.AdminUser)
	}
	for k, v := range s.Tags {
		switch {
		case k == "" || len(k) > 512 || strings.ContainsAny(k, "<>%&\\?/"):
			add("tags."+k, "tag names are 1 to 512 characters without < > %% & \\ ? /")
		case len(v) > 256:
			add("tags."+k, "the value is over Azure's 256 characters")
		case strings.HasPrefix(strings.ToLower(k), "runfleet"):
			add("tags."+k, "the prefix runfleet is reserved")
		}
	}
	if len(s.Tags) > 50-3 {
		add("tags", "%d tags: Azure takes 50, and runfleet adds 3", len(s.Tags))
	}
	if !path.IsAbs(s.Workdir) {
		add("workdir", "%q must be an absolute path", s.Workdir)
	}
	if err := s.IdleTimeout.Check(); err != nil {
		add("idle_timeout", "%v", err)
	}
	if err := s.PollInterval.Check(); err != nil {
		add("poll_interval", "%v", err)
	} else if s.PollInterval.Duration < time.Second {
		add("poll_interval", "%s is under a second", s.PollInterval.Duration)
	}
	return errors.Join(errs...)
}
