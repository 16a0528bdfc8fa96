package gcp

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"path"
	"strings"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider/vm"
)

// Section is a pool's `gcp:` section: where its instances run and what
// they are. Credentials are never written here: they come from
// credentials_file, CML's GOOGLE_APPLICATION_CREDENTIALS_DATA (the JSON
// itself), or Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS,
// gcloud's, the manager's own service account).
type Section struct {
	// Project is the pool's project; the credentials' project or
	// GOOGLE_CLOUD_PROJECT when empty.
	Project string `json:"project"`
	// Zones are tried in order when one has no capacity.
	Zones []string `json:"zones"`
	// Endpoint replaces Compute Engine's (a Private Service Connect
	// endpoint, a stand-in).
	Endpoint string `json:"endpoint"`
	// BillingEndpoint replaces the Cloud Billing API's (a stand-in),
	// whose catalog prices the instances' records where the pool sets
	// no price.
	BillingEndpoint string `json:"billing_endpoint"`
	// CredentialsFile is a service account key or another credential
	// configuration file.
	CredentialsFile string `json:"credentials_file"`

	// Image is the boot disk's image (projects/P/global/images/NAME or
	// .../images/family/F). It must hold the forge's agent, runfleet
	// (which starts the agent and powers the machine off) and whatever
	// the jobs need.
	Image string `json:"image"`
	// MachineTypes are tried in order when one has no capacity
	// (n1-standard-8, g2-standard-4, custom-8-53248).
	MachineTypes []string    `json:"machine_types"`
	Accelerator  Accelerator `json:"accelerator"`
	Disk         Disk        `json:"disk"`
	// Network and Subnetwork: the project's default network when empty.
	Network    string `json:"network"`
	Subnetwork string `json:"subnetwork"`
	// ExternalIP gives the instance a public address (true when not
	// given), which it needs to reach the forge without Cloud NAT.
	ExternalIP *bool `json:"external_ip"`
	// NetworkTags are the instance's firewall tags.
	NetworkTags []string `json:"network_tags"`
	// ServiceAccount (an email) gives jobs a cloud identity, with Scopes
	// (cloud-platform when empty). Without one an instance holds no
	// cloud credential at all.
	ServiceAccount string            `json:"service_account"`
	Scopes         []string          `json:"scopes"`
	Labels         map[string]string `json:"labels"`
	// HandoffURL is the manager's webhook listener as the instances
	// reach it (http://10.128.0.2:8080). With it, no credential is put
	// in an instance's metadata: the instance proves who it is with its
	// identity token, which needs a service account (one with no roles
	// will do), and takes its runner's assignment from the manager once
	// (vm.Desk).
	HandoffURL string `json:"handoff_url"`
	// IdentityCerts is where the manager fetches the keys Google signs
	// identity tokens with (GoogleCerts when empty): a mirror, for a
	// manager that cannot reach www.googleapis.com.
	IdentityCerts string `json:"identity_certs"`

	// Spot asks for Spot VMs, deleted when Compute Engine takes them
	// back. SpotFallback "on_demand" starts a standard instance when no
	// type or zone has spot capacity.
	Spot         bool   `json:"spot"`
	SpotFallback string `json:"spot_fallback"`

	// StartupScript runs as root before the agent starts (installs,
	// mounts); a failing one powers the instance off.
	StartupScript string `json:"startup_script"`
	// SSHPublicKey is added to root's authorized keys.
	SSHPublicKey string `json:"ssh_public_key"`
	// Runfleet is runfleet on the image ("runfleet" in its PATH).
	Runfleet string `json:"runfleet"`
	// Install is what a stock image lacks, fetched and checked by the
	// boot script before it starts anything: runfleet and the forge's
	// agent (vm.Install).
	Install vm.Install `json:"install"`
	// Workdir is the agent's working directory on the instance.
	Workdir string `json:"workdir"`
	// IdleTimeout powers an instance off when no job came within it,
	// also when the manager is gone (the pool's idle_timeout and a
	// minute, or 5m, when not given).
	IdleTimeout config.Duration `json:"idle_timeout"`
	// PollInterval is how often the pool's instances are listed (5s).
	PollInterval config.Duration `json:"poll_interval"`
	// RequestQuotas are the project's rate quotas, requests a minute by
	// group (reads_per_region, writes_per_region, global_reads,
	// global_writes), where they are not 1,500: as the console's Quotas
	// page shows them. Every pool of a project should give the same.
	RequestQuotas map[string]int `json:"request_quotas"`
}

// Accelerator is the GPUs each instance gets: nvidia-tesla-t4,
// nvidia-l4, nvidia-tesla-a100, ... (G2 and A2/A3 types carry theirs
// already and need none).
type Accelerator struct {
	Type  string `json:"type"`
	Count int    `json:"count"`
}

// Disk is the boot disk, deleted with the instance.
type Disk struct {
	SizeGB int    `json:"size_gb"`
	Type   string `json:"type"` // pd-balanced when empty
}

// Defaults.
const (
	DefaultWorkdir      = "/var/lib/runfleet/work"
	DefaultPollInterval = 5 * time.Second
	DefaultIdleTimeout  = 5 * time.Minute // CML's --idle-timeout
	// DefaultLifetime is an instance's deadline when the pool sets no
	// max_lifetime: no machine runs for ever.
	DefaultLifetime  = 24 * time.Hour
	DefaultDiskType  = "pd-balanced"
	FallbackOnDemand = "on_demand"
)

var (
	zoneRE    = lazyregexp.New(`^[a-z]+-[a-z]+\d+-[a-z]$`)
	projectRE = lazyregexp.New(`^[a-z][-a-z0-9]{4,28}[a-z0-9]$|^[a-z][-a-z0-9.:]{4,62}$`)
	// A machine type: predefined (n1-standard-8) or custom
	// (custom-8-53248, n2-custom-64-262144-ext).
	machineRE = lazyregexp.New(`^[a-z][a-z0-9]*(-[a-z0-9]+)+$`)
	nameRE    = lazyregexp.New(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
	imageRE   = lazyregexp.New(`^(https://[^/]+/compute/v1/)?projects/[^/]+/global/images/(family/)?[a-z]([-a-z0-9]*[a-z0-9])?$`)
	diskTypes = map[string]bool{"pd-standard": true, "pd-balanced": true, "pd-ssd": true, "pd-extreme": true,
		"hyperdisk-balanced": true, "hyperdisk-throughput": true, "hyperdisk-extreme": true}
	labelKeyRE   = lazyregexp.New(`^[a-z][a-z0-9_-]{0,62}$`)
	labelValueRE = lazyregexp.New(`^[a-z0-9_-]{0,63}$`)
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
	if !s.PollInterval.Given() {
		s.PollInterval = config.D(DefaultPollInterval)
	}
	if s.Disk.Type == "" {
		s.Disk.Type = DefaultDiskType
	}
	if s.ExternalIP == nil {
		yes := true
		s.ExternalIP = &yes
	}
	if s.ServiceAccount != "" && len(s.Scopes) == 0 {
		s.Scopes = []string{"https://www.googleapis.com/auth/cloud-platform"}
	}
	if s.Accelerator.Type != "" && s.Accelerator.Count == 0 {
		s.Accelerator.Count = 1
	}
	return s, config.Within("gcp", errors.Join(decodeErr, s.check()))
}

func (s Section) check() error {
	errs := []error{s.Install.Check()}
	add := func(field, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...)))
	}
	if s.Project != "" && !projectRE.MatchString(s.Project) {
		add("project", "%q is not a project id (6 to 30 lowercase letters, digits and hyphens)", s.Project)
	}
	if len(s.Zones) == 0 {
		add("zones", "at least one is required (us-central1-a, europe-west4-b, ...)")
	}
	for i, z := range s.Zones {
		if !zoneRE.MatchString(z) {
			add(fmt.Sprintf("zones[%d]", i), "%q is not a zone (us-central1-a)", z)
		}
	}
	if s.BillingEndpoint != "" {
		if u, err := url.Parse(s.BillingEndpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add("billing_endpoint", "%q is not an http(s) URL", s.BillingEndpoint)
		}
	}
	if s.Endpoint != "" {
		if u, err := url.Parse(s.Endpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add("endpoint", "%q is not an http(s) URL", s.Endpoint)
		}
	}
	switch {
	case s.Image == "":
		add("image", "is required (projects/P/global/images/NAME or projects/P/global/images/family/F)")
	case !imageRE.MatchString(s.Image):
		add("image", "%q is not an image (projects/P/global/images/NAME or projects/P/global/images/family/F)", s.Image)
	}
	if len(s.MachineTypes) == 0 {
		add("machine_types", "at least one is required (n1-standard-8, g2-standard-4, custom-8-53248, ...)")
	}
	for i, t := range s.MachineTypes {
		if !machineRE.MatchString(t) {
			add(fmt.Sprintf("machine_types[%d]", i), "%q is not a machine type (n1-standard-8, custom-8-53248)", t)
		}
	}
	if a := s.Accelerator; a.Type != "" && !nameRE.MatchString(a.Type) {
		add("accelerator.type", "%q is not an accelerator type (nvidia-tesla-t4, nvidia-l4)", a.Type)
	} else if a.Count < 0 || a.Count > 16 || a.Count > 0 && a.Type == "" {
		add("accelerator.count", "%d: give a type, and 1 to 16", a.Count)
	}
	if d := s.Disk; d.SizeGB < 0 || d.SizeGB > 65536 {
		add("disk.size_gb", "%d is not between 10 and 65536", d.SizeGB)
	} else if d.SizeGB > 0 && d.SizeGB < 10 {
		add("disk.size_gb", "%d is under Compute Engine's 10 GB", d.SizeGB)
	}
	if !diskTypes[s.Disk.Type] {
		add("disk.type", "%q is not a disk type (pd-balanced, pd-ssd, pd-standard, hyperdisk-balanced, ...)", s.Disk.Type)
	}
	if sa := s.ServiceAccount; sa != "" && sa != "default" && !strings.Contains(sa, "@") {
		add("service_account", "%q is not a service account's email (or default)", sa)
	}
	if h := s.HandoffURL; h != "" {
		if u, err := url.Parse(h); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			add("handoff_url", "%q is not an http(s) URL without a query (the manager's listen address as the instances reach it)", h)
		}
		if s.ServiceAccount == "" {
			add("handoff_url", "needs service_account: an instance proves who it is with its service account's identity token (an account with no roles will do)")
		}
	}
	if c := s.IdentityCerts; c != "" {
		if u, err := url.Parse(c); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add("identity_certs", "%q is not an http(s) URL", c)
		} else if s.HandoffURL == "" {
			add("identity_certs", "is set, but handoff_url is not")
		}
	}
	if len(s.Scopes) > 0 && s.ServiceAccount == "" {
		add("scopes", "are set, but service_account is not")
	}
	errs = append(errs, checkQuotas(s.RequestQuotas))
	switch s.SpotFallback {
	case "", "none":
	case FallbackOnDemand:
		if !s.Spot {
			add("spot_fallback", "is set, but spot is not")
		}
	default:
		add("spot_fallback", "%q must be on_demand or none", s.SpotFallback)
	}
	for k, v := range s.Labels {
		switch {
		case !labelKeyRE.MatchString(k):
			add("labels."+k, "label keys are lowercase letters, digits, _ and -, starting with a letter, at most 63")
		case !labelValueRE.MatchString(v):
			add("labels."+k, "%q: label values are lowercase letters, digits, _ and -, at most 63", v)
		case strings.HasPrefix(k, "runfleet"):
			add("labels."+k, "the prefix runfleet is reserved")
		}
	}
	if len(s.Labels) > 64-3 {
		add("labels", "%d labels: Compute Engine takes 64, and runfleet adds 3", len(s.Labels))
	}
	for i, tag := range s.NetworkTags {
		if !nameRE.MatchString(tag) {
			add(fmt.Sprintf("network_tags[%d]", i), "%q is not a network tag (lowercase letters, digits, -)", tag)
		}
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
