package aws

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"path"
	"strconv"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider/vm"
)

// Section is a pool's `aws:` section: where its instances run and what
// they are. Credentials are never written here: they come from the SDK's
// standard chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile,
// the manager's own instance role).
type Section struct {
	// Region is the pool's region; AWS_REGION or the profile's when
	// empty.
	Region string `json:"region"`
	// Profile is a profile of the shared config files.
	Profile string `json:"profile"`
	// Endpoint replaces EC2's endpoint (a VPC endpoint, a stand-in).
	Endpoint string `json:"endpoint"`
	// SSMEndpoint replaces Systems Manager's, for the manager and the
	// instances both (a VPC endpoint, a stand-in).
	SSMEndpoint string `json:"ssm_endpoint"`
	// PricingEndpoint replaces the Price List Query API's (a stand-in),
	// from which instances' on-demand prices are read for their records
	// where the pool sets no price.
	PricingEndpoint string `json:"pricing_endpoint"`

	// Image is the AMI. It must hold the forge's agent, runfleet (which
	// starts the agent and powers the machine off) and whatever the
	// jobs need.
	Image string `json:"image"`
	// LaunchTemplate is used instead of, or under, the settings here.
	LaunchTemplate LaunchTemplate `json:"launch_template"`
	// InstanceTypes are tried in order when one has no capacity.
	InstanceTypes []string `json:"instance_types"`
	// Subnets are tried in order too (each is in one zone); the
	// default VPC's when empty.
	Subnets        []string `json:"subnets"`
	SecurityGroups []string `json:"security_groups"`
	// InstanceProfile (a name or an ARN) gives jobs an IAM role. Without
	// one an instance holds no cloud credential at all.
	InstanceProfile string            `json:"instance_profile"`
	KeyName         string            `json:"key_name"`
	RootVolume      RootVolume        `json:"root_volume"`
	Tags            map[string]string `json:"tags"`
	// HandoffURL is the manager's webhook listener as the instances
	// reach it (https://10.0.0.5:8443). With it an instance takes its
	// runner's assignment from the manager, once, proving who it is
	// with its signed instance identity document (identity.go), and no
	// instance profile is needed; without it, an instance profile's
	// pool takes it from Parameter Store (handoff.go).
	HandoffURL string `json:"handoff_url"`
	// IdentityCerts is a PEM file with AWS's "RSA" certificate for the
	// pool's region, which the identity documents' signatures are
	// checked with (EC2 User Guide, "AWS public certificates for
	// instance identity document signatures"). Required with
	// HandoffURL: AWS publishes them in its documentation only.
	IdentityCerts string `json:"identity_certs"`

	// Spot asks for spot capacity, at most SpotMaxPrice (USD an hour;
	// the on-demand price when empty). SpotFallback "on_demand" starts
	// an on-demand instance when no type or subnet has spot capacity.
	Spot         bool   `json:"spot"`
	SpotMaxPrice string `json:"spot_max_price"`
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
	// also when the manager is gone (the pool's idle_timeout, or 5m,
	// when not given).
	IdleTimeout config.Duration `json:"idle_timeout"`
	// PollInterval is how often the pool's instances and spot requests
	// are described (5s).
	PollInterval config.Duration `json:"poll_interval"`
}

// LaunchTemplate names a launch template by id or by name.
type LaunchTemplate struct {
	ID      string `json:"id"`
	Name    string `json:"name"`
	Version string `json:"version"` // a number, $Latest or $Default
}

func (l LaunchTemplate) given() bool { return l.ID != "" || l.Name != "" }

// RootVolume sizes the root EBS volume.
type RootVolume struct {
	SizeGB int    `json:"size_gb"`
	Type   string `json:"type"`   // gp3 when a size is given
	Device string `json:"device"` // the AMI's root device, /dev/sda1 when empty
}

// Defaults.
const (
	DefaultWorkdir      = "/var/lib/runfleet/work"
	DefaultPollInterval = 5 * time.Second
	DefaultIdleTimeout  = 5 * time.Minute // CML's --idle-timeout
	// DefaultLifetime is an instance's deadline when the pool sets no
	// max_lifetime: no machine runs for ever.
	DefaultLifetime  = 24 * time.Hour
	FallbackOnDemand = "on_demand"
)

var (
	instanceType = lazyregexp.New(`^[a-z][a-z0-9-]*\.[a-z0-9-]+$`)
	region       = lazyregexp.New(`^[a-z]{2}(-[a-z]+)+-\d+$`)
	ids          = map[string]*lazyregexp.Regexp{
		// An AMI, or a Systems Manager parameter that names one, which
		// RunInstances resolves at launch (EC2 User Guide, "Reference AMIs
		// using Systems Manager parameters").
		"image":           lazyregexp.New(`^(ami-[0-9a-f]{8,17}|resolve:ssm:[A-Za-z0-9_./-]+(:\d+)?)$`),
		"subnet":          lazyregexp.New(`^subnet-[0-9a-f]{8,17}$`),
		"security group":  lazyregexp.New(`^sg-[0-9a-f]{8,17}$`),
		"launch template": lazyregexp.New(`^lt-[0-9a-f]{8,17}$`),
	}
	volumeTypes = map[string]bool{"gp2": true, "gp3": true, "io1": true, "io2": true, "st1": true, "sc1": true, "standard": true}
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
	if s.RootVolume.SizeGB > 0 && s.RootVolume.Type == "" {
		s.RootVolume.Type = "gp3"
	}
	if s.RootVolume.Device == "" {
		s.RootVolume.Device = "/dev/sda1"
	}
	return s, config.Within("aws", errors.Join(decodeErr, s.check()))
}

func (s Section) check() error {
	errs := []error{s.Install.Check()}
	add := func(field, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...)))
	}
	if s.Region != "" && !region.MatchString(s.Region) {
		add("region", "%q is not a region (us-east-1, eu-west-2, ...)", s.Region)
	}
	for _, e := range [][2]string{{"ssm_endpoint", s.SSMEndpoint}, {"pricing_endpoint", s.PricingEndpoint}} {
		field, v := e[0], e[1]
		if v == "" {
			continue
		}
		if u, err := url.Parse(v); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add(field, "%q is not an http(s) URL", v)
		}
	}
	s.checkHandoff(add)
	if s.Endpoint != "" {
		if u, err := url.Parse(s.Endpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add("endpoint", "%q is not an http(s) URL", s.Endpoint)
		}
	}
	switch {
	case s.Image == "" && !s.LaunchTemplate.given():
		add("image", "is required (an AMI id, ami-..., or resolve:ssm:<parameter>), unless a launch_template gives it")
	case s.Image != "" && !ids["image"].MatchString(s.Image):
		add("image", "%q is not an AMI id (ami-...) or resolve:ssm:<parameter>", s.Image)
	}
	lt := s.LaunchTemplate
	switch {
	case lt.ID != "" && lt.Name != "":
		add("launch_template", "give id or name, not both")
	case lt.ID != "" && !ids["launch template"].MatchString(lt.ID):
		add("launch_template.id", "%q is not a launch template id (lt-...)", lt.ID)
	case lt.Version != "" && !lt.given():
		add("launch_template.version", "needs an id or a name")
	}
	if v := lt.Version; v != "" && v != "$Latest" && v != "$Default" {
		if n, err := strconv.Atoi(v); err != nil || n < 1 {
			add("launch_template.version", "%q is not a version number, $Latest or $Default", v)
		}
	}
	if len(s.InstanceTypes) == 0 && !lt.given() {
		add("instance_types", "at least one is required (t3.medium, g4dn.xlarge, ...), unless a launch_template gives it")
	}
	for i, t := range s.InstanceTypes {
		if !instanceType.MatchString(t) {
			add(fmt.Sprintf("instance_types[%d]", i), "%q is not an instance type (family.size: g4dn.xlarge)", t)
		}
	}
	for i, sub := range s.Subnets {
		if !ids["subnet"].MatchString(sub) {
			add(fmt.Sprintf("subnets[%d]", i), "%q is not a subnet id (subnet-...)", sub)
		}
	}
	for i, sg := range s.SecurityGroups {
		if !ids["security group"].MatchString(sg) {
			add(fmt.Sprintf("security_groups[%d]", i), "%q is not a security group id (sg-...)", sg)
		}
	}
	if v := s.RootVolume; v.SizeGB < 0 || v.SizeGB > 65536 {
		add("root_volume.size_gb", "%d is not between 1 and 65536", v.SizeGB)
	} else if v.Type != "" && !volumeTypes[v.Type] {
		add("root_volume.type", "%q is not an EBS volume type (gp3, gp2, io2, io1, st1, sc1, standard)", v.Type)
	}
	if s.SpotMaxPrice != "" {
		if p, err := strconv.ParseFloat(s.SpotMaxPrice, 64); err != nil || p <= 0 {
			add("spot_max_price", "%q is not a price in USD an hour (0.35)", s.SpotMaxPrice)
		} else if !s.Spot {
			add("spot_max_price", "is set, but spot is not")
		}
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
	for k := range s.Tags {
		if len(k) == 0 || len(k) > 128 || len(s.Tags[k]) > 256 {
			add("tags."+k, "tag keys are 1 to 128 characters, values at most 256")
		} else if len(k) >= 4 && k[:4] == "aws:" || len(k) >= 9 && k[:9] == "runfleet:" {
			add("tags."+k, "the prefixes aws: and runfleet: are reserved")
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

// checkHandoff checks handoff_url and identity_certs, whose file is read
// here so that a pool whose instances could never be verified does not
// start.
func (s Section) checkHandoff(add func(field, format string, a ...any)) {
	if h := s.HandoffURL; h != "" {
		if u, err := url.Parse(h); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			add("handoff_url", "%q is not an http(s) URL without a query (the manager's listen address as the instances reach it)", h)
		}
		if s.IdentityCerts == "" {
			add("handoff_url", "needs identity_certs: a PEM file with AWS's RSA certificate for the pool's region, which signs the instances' identity documents (%s)", CertsDoc)
		}
	}
	if c := s.IdentityCerts; c != "" {
		if s.HandoffURL == "" {
			add("identity_certs", "is set, but handoff_url is not")
		} else if _, err := LoadIdentityCerts(c); err != nil {
			add("identity_certs", "%v", err)
		}
	}
}
