package gcp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"cloud.google.com/go/auth"
	"cloud.google.com/go/auth/credentials"
	"cloud.google.com/go/auth/httptransport"
	billing "cloud.google.com/go/billing/apiv1"
	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/api/option"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/version"
)

func init() { provider.Register("gcp", driver{}) }

// driver is the registry's entry for Compute Engine instances,
// configured by the pool's `gcp:` section.
type driver struct{}

// CredentialsDataEnv is CML's variable holding the credentials' JSON
// itself.
const CredentialsDataEnv = "GOOGLE_APPLICATION_CREDENTIALS_DATA"

// EndpointEnv is gcloud's override of Compute Engine's endpoint
// (https://HOST/compute/v1/), taken when the section names none, as by
// `runfleet runner --cloud=gcp`.
const EndpointEnv = "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"

func or(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
}

// Scope is the OAuth scope the manager asks for: Compute Engine only.
const Scope = "https://www.googleapis.com/auth/compute"

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section)
	return err
}

// Open finds the credentials and the project (no call: a token is asked
// for at the first request) and makes the pool's provider.
func (driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section)
	if err != nil {
		return nil, err
	}
	calls := new(atomic.Int64)
	// The clients may keep the context for their credentials' refreshes:
	// it outlives the opening.
	api, project, err := Client(context.WithoutCancel(ctx), s, calls, nil)
	if err != nil {
		return nil, err
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	life := c.MaxLifetime
	if life == 0 {
		life = DefaultLifetime
	}
	return New(Options{
		API: api, Project: project, Manager: c.Manager, Pool: c.Pool, Section: s, Listing: sharedListings.Get(project + " " + s.Endpoint + " " + c.Manager),
		IdleTimeout: vm.InstanceIdle(s.IdleTimeout.Duration, c.IdleTimeout, DefaultIdleTimeout), Lifetime: life, Calls: calls,
		Catalog: catalogOf(context.WithoutCancel(ctx), s, log),
		Logger:  log.With("provider", "gcp", "pool", c.Pool, "project", project),
	}), nil
}

// BillingEndpointEnv is gcloud's override of the Cloud Billing API's
// endpoint, taken when the section names none.
const BillingEndpointEnv = "CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING"

// catalogOf is the Cloud Billing Catalog's client, with the same
// credentials as Compute Engine's but for the billing scope alone
// (BillingScope); nil, said in the log, where it cannot be made: the
// records then stay unpriced, nothing else is affected.
func catalogOf(ctx context.Context, s Section, log *slog.Logger) Catalog {
	creds, err := findCredentials(s, BillingScope)
	if err == nil {
		var hc *http.Client
		if hc, err = httptransport.NewClient(&httptransport.Options{Credentials: creds, DisableTelemetry: true}); err == nil {
			opts := []option.ClientOption{option.WithHTTPClient(hc)}
			if endpoint := or(s.BillingEndpoint, strings.TrimSuffix(strings.TrimRight(os.Getenv(BillingEndpointEnv), "/"), "/v1")); endpoint != "" {
				opts = append(opts, option.WithEndpoint(strings.TrimRight(endpoint, "/")))
			}
			var c *billing.CloudCatalogClient
			if c, err = billing.NewCloudCatalogRESTClient(ctx, opts...); err == nil {
				return catalogClient{c}
			}
		}
	}
	log.Warn("the Cloud Billing Catalog cannot be read: the pool's records are priced only from price_per_hour or prices", "err", err)
	return nil
}

// Client is Compute Engine's API for the section: its credentials and
// project, within the project's request quotas (limits; nil: the ones
// shared by the clients of the project and endpoint). calls, when set,
// counts the requests sent.
func Client(ctx context.Context, s Section, calls *atomic.Int64, limits *Limits) (API, string, error) {
	creds, err := findCredentials(s, Scope)
	if err != nil {
		return nil, "", fmt.Errorf("gcp: credentials: %w", err)
	}
	project := s.Project
	if project == "" {
		project, _ = creds.ProjectID(ctx)
	}
	if project == "" {
		project = os.Getenv("GOOGLE_CLOUD_PROJECT")
	}
	if project == "" {
		return nil, "", errors.New("gcp.project: not set, and neither the credentials nor GOOGLE_CLOUD_PROJECT give one")
	}
	if limits == nil {
		limits = sharedLimits.Make(project+" "+s.Endpoint+" "+fmt.Sprint(s.RequestQuotas), func() *Limits {
			return newLimits(s.RequestQuotas, time.Now)
		})
	}
	base := http.DefaultTransport.(*http.Transport).Clone()
	hc, err := httptransport.NewClient(&httptransport.Options{
		Credentials: creds, BaseRoundTripper: &meter{base: base, limits: limits, calls: calls}, DisableTelemetry: true,
	})
	if err != nil {
		return nil, "", fmt.Errorf("gcp: %w", err)
	}
	opts := []option.ClientOption{option.WithHTTPClient(hc)}
	if endpoint := or(s.Endpoint, strings.TrimSuffix(strings.TrimRight(os.Getenv(EndpointEnv), "/"), "/compute/v1")); endpoint != "" {
		opts = append(opts, option.WithEndpoint(strings.TrimRight(endpoint, "/")))
	}
	instances, err := compute.NewInstancesRESTClient(ctx, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("gcp: %w", err)
	}
	ops, err := compute.NewZoneOperationsRESTClient(ctx, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("gcp: %w", err)
	}
	all, err := compute.NewGlobalOperationsRESTClient(ctx, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("gcp: %w", err)
	}
	disks, err := compute.NewDisksRESTClient(ctx, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("gcp: %w", err)
	}
	types, err := compute.NewMachineTypesRESTClient(ctx, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("gcp: %w", err)
	}
	return restAPI{instances: instances, disks: disks, ops: ops, zoneOps: all, types: types}, project, nil
}

// credentialTypes are the credential files taken: a service account's
// key, a user's, workload identity federation, impersonation.
var credentialTypes = map[string]credentials.CredType{
	"service_account": credentials.ServiceAccount, "authorized_user": credentials.AuthorizedUser,
	"external_account": credentials.ExternalAccount, "impersonated_service_account": credentials.ImpersonatedServiceAccount,
}

// findCredentials reads credentials_file, then CML's
// GOOGLE_APPLICATION_CREDENTIALS_DATA, then Application Default
// Credentials.
func findCredentials(s Section, scope string) (*auth.Credentials, error) {
	opts := &credentials.DetectOptions{Scopes: []string{scope}}
	var b []byte
	switch {
	case s.CredentialsFile != "":
		var err error
		if b, err = os.ReadFile(s.CredentialsFile); err != nil {
			return nil, err
		}
	case os.Getenv(CredentialsDataEnv) != "":
		b = []byte(os.Getenv(CredentialsDataEnv))
	default:
		return credentials.DetectDefault(opts)
	}
	var head struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, errors.New("not a credentials JSON file") // never the contents
	}
	typ, ok := credentialTypes[head.Type]
	if !ok {
		return nil, fmt.Errorf("type %q is not a service account, user, external or impersonated account", head.Type)
	}
	return credentials.NewCredentialsFromJSON(typ, b, opts)
}

// Listing is a manager's instances in a project as last listed (one
// aggregated call, a heavy-weight read), shared by the manager's pools
// there.
type Listing = provider.Listing[[]*computepb.Instance]

// sharedListings are the listings a manager's pools of one project and
// endpoint share.
var sharedListings = vm.Shared[*Listing]{New: func() *Listing { return &Listing{} }}

// sharedLimits are the limits the pools of one project and endpoint share.
var sharedLimits = vm.Shared[*Limits]{New: NewLimits}

// meter waits for each request's turn within its quota group and counts
// what is sent; it sits under the credentials, so token requests to the
// OAuth server are neither.
type meter struct {
	base   http.RoundTripper
	limits *Limits
	calls  *atomic.Int64
}

func (m *meter) RoundTrip(r *http.Request) (*http.Response, error) {
	q := quotaOf(r)
	if err := m.limits.wait(r.Context(), q); err != nil {
		return nil, err
	}
	if m.calls != nil {
		m.calls.Add(1)
	}
	// runfleet/<version> ahead of the client library's own name: the REST
	// clients take no User-Agent option with a client of our own.
	r = r.Clone(r.Context())
	r.Header.Set("User-Agent", strings.TrimSpace(version.UserAgent()+" "+r.Header.Get("User-Agent")))
	res, err := m.base.RoundTrip(r)
	if err == nil && rateLimited(res) {
		m.limits.hold(q)
	}
	return res, err
}

// cmlTables are CML's aliases on GCP, from the iterative provider's
// tables: its regions are zones, and a GPU size is a machine type and
// its accelerators (machine+accelerator*count); --cloud-gpu beside a
// machine type attaches one of that accelerator (k80, v100 and t4 are
// NVIDIA's Tesla models).
var cmlTables = vm.Tables{
	WithGPU: func(typ, gpu string) string {
		if g, ok := map[string]string{"k80": "nvidia-tesla-k80", "v100": "nvidia-tesla-v100", "t4": "nvidia-tesla-t4"}[gpu]; ok {
			gpu = g
		}
		return typ + "+" + gpu + "*1"
	},
	Cloud:         "GCP",
	DefaultRegion: "us-west",
	Regions:       map[string]string{"us-east": "us-east1-c", "us-west": "us-west1-b", "eu-north": "europe-north1-a", "eu-west": "europe-west1-d"},
	Types: map[string]string{
		"s": "g1-small", "m": "e2-custom-8-32768", "l": "e2-custom-32-131072", "xl": "n2-custom-64-262144",
		"m+t4":  "n1-standard-4+nvidia-tesla-t4*1",
		"m+k80": "custom-8-53248+nvidia-tesla-k80*1", "l+k80": "custom-32-131072+nvidia-tesla-k80*4", "xl+k80": "custom-64-212992-ext+nvidia-tesla-k80*8",
		"m+v100": "custom-8-65536-ext+nvidia-tesla-v100*1", "l+v100": "custom-32-262144-ext+nvidia-tesla-v100*4", "xl+v100": "custom-64-524288-ext+nvidia-tesla-v100*8",
	},
}

// The stock images CML's runners boot without --cloud-image, by image
// family, whose newest image Compute Engine takes: Ubuntu 24.04 LTS, and
// for machines with GPUs Google's Deep Learning VM image with NVIDIA's
// driver and CUDA (Ubuntu 22.04, driver 570).
const (
	StockUbuntu = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"
	StockGPU    = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
)

// gpuMachine is the machine families that come with GPUs (A100, H100,
// L4).
var gpuMachine = lazyregexp.New(`^(a2|a3|g2)-`)

// StockImage is the stock image for a machine type and its accelerator.
func StockImage(typ string, acc Accelerator) string {
	if acc.Type != "" || gpuMachine.MatchString(typ) {
		return StockGPU
	}
	return StockUbuntu
}

// CMLSection takes `--cloud=gcp` as CML does (vm.ParseCML): the region
// (a zone), the type (machine+accelerator*count as CML's table writes
// it), the disk, spot, the startup script, the image, --cloud-permission-set
// (a service account: email[,scopes=a,b]), --cloud-metadata (labels),
// --cloud-ssh-private (its public key is authorised on the instance).
// Credentials come from GOOGLE_APPLICATION_CREDENTIALS_DATA (CML's) or
// Application Default Credentials.
func (driver) CMLSection(o provider.CMLOptions) (json.RawMessage, bool, error) {
	c := o.Cloud
	if c["cloud"] != "gcp" {
		return nil, false, nil
	}
	cml, err := vm.ParseCML(o, cmlTables)
	errs := []error{err}
	typ, acc, err := splitType(cml.Type)
	errs = append(errs, err)
	install, err := cml.Stock(o, "gcp", StockImage(typ, acc), "an image (projects/P/global/images/NAME)")
	errs = append(errs, err)
	if cml.SpotPrice != "" {
		errs = append(errs, errors.New("--cloud-spot-price: Spot VMs on GCP have no maximum price"))
	}
	s := Section{Image: cml.Image, Install: install, Zones: []string{cml.Region}, MachineTypes: []string{typ}, Accelerator: acc, Spot: cml.Spot,
		StartupScript: cml.StartupScript, SSHPublicKey: cml.SSHPublicKey, Disk: Disk{SizeGB: cml.HDDSizeGB}}
	s.ServiceAccount, s.Scopes = permissionSet(cml.PermissionSet)
	if len(cml.Metadata) > 0 {
		s.Labels = cml.Metadata
	}
	if err := errors.Join(errs...); err != nil {
		return nil, true, err
	}
	b, err := json.Marshal(s)
	return b, true, err
}

// splitType reads machine+accelerator*count.
func splitType(t string) (string, Accelerator, error) {
	typ, acc, ok := strings.Cut(t, "+")
	if !ok {
		return typ, Accelerator{}, nil
	}
	name, count, _ := strings.Cut(acc, "*")
	a := Accelerator{Type: name, Count: 1}
	if count != "" {
		if _, err := fmt.Sscanf(count, "%d", &a.Count); err != nil || a.Count < 1 {
			return "", Accelerator{}, fmt.Errorf("--cloud-type: %q: the accelerator count %q is not a number", t, count)
		}
	}
	return typ, a, nil
}

// permissionSet reads CML's --cloud-permission-set on GCP: a service
// account's email, then scopes=, each a URL or gcloud's alias.
func permissionSet(ps string) (string, []string) {
	if ps == "" {
		return "", nil
	}
	parts := strings.Split(ps, ",")
	var scopes []string
	for i, p := range parts[1:] {
		if i == 0 {
			p = strings.TrimPrefix(p, "scopes=")
		}
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if !strings.Contains(p, "://") {
			if alias, ok := scopeAliases[p]; ok {
				p = alias
			}
			p = "https://www.googleapis.com/auth/" + p
		}
		scopes = append(scopes, p)
	}
	return strings.TrimSpace(parts[0]), scopes
}

// scopeAliases are gcloud's scope aliases whose names differ from the
// scopes'.
var scopeAliases = map[string]string{
	"storage-ro": "devstorage.read_only", "storage-rw": "devstorage.read_write", "storage-full": "devstorage.full_control",
	"compute-ro": "compute.readonly", "compute-rw": "compute", "logging-write": "logging.write", "monitoring-write": "monitoring.write",
	"bigquery": "bigquery", "datastore": "datastore", "pubsub": "pubsub",
}
