package azure

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/arm"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/cloud"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/azidentity"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/devtestlabs/armdevtestlabs"
	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/version"
)

func init() { provider.Register("azure", driver{}) }

// driver is the registry's entry for Azure VMs, configured by the pool's
// `azure:` section.
type driver struct{}

// The environment CML's Azure credentials come in: a service principal's
// secret.
const (
	ClientIDEnv       = "AZURE_CLIENT_ID"
	ClientSecretEnv   = "AZURE_CLIENT_SECRET"
	TenantIDEnv       = "AZURE_TENANT_ID"
	SubscriptionIDEnv = "AZURE_SUBSCRIPTION_ID"
)

// Where `runfleet runner --cloud=azure` finds what CML's options cannot
// say: the resource group and subnet its VM goes in (CML makes a network
// per runner; runfleet takes one made once), and an endpoint that
// replaces Azure Resource Manager's.
const (
	ResourceGroupEnv = "RUNFLEET_AZURE_RESOURCE_GROUP"
	SubnetEnv        = "RUNFLEET_AZURE_SUBNET"
	EndpointEnv      = "RUNFLEET_AZURE_ENDPOINT"
)

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section)
	return err
}

// Open finds the credentials and the subscription (no call: a token is
// asked for at the first request) and makes the pool's provider.
func (driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section)
	if err != nil {
		return nil, err
	}
	calls := new(atomic.Int64)
	api, sub, err := Client(s, calls, nil)
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
		API: api, Subscription: sub, Manager: c.Manager, Pool: c.Pool, Section: s, Listing: sharedListings.Get(sub + " " + or(s.Endpoint, os.Getenv(EndpointEnv))),
		IdleTimeout: vm.InstanceIdle(s.IdleTimeout.Duration, c.IdleTimeout, DefaultIdleTimeout), Lifetime: life, Calls: calls,
		Prices: &RetailPrices{URL: or(s.RetailPricesURL, DefaultRetailPricesURL), Client: &http.Client{Timeout: 30 * time.Second}},
		Logger: log.With("provider", "azure", "pool", c.Pool, "subscription", sub),
	})
}

// Client is Azure Resource Manager's API for the section: its
// credentials and subscription, within the subscription's request limits
// (limits; nil: the ones shared by the clients of the subscription and
// endpoint). calls, when set, counts the requests sent.
func Client(s Section, calls *atomic.Int64, limits *Limits) (API, string, error) {
	sub := or(s.SubscriptionID, os.Getenv(SubscriptionIDEnv))
	if sub == "" {
		return nil, "", errors.New("azure.subscription_id: not set, and AZURE_SUBSCRIPTION_ID is not either")
	}
	if !uuidRE.MatchString(sub) {
		return nil, "", fmt.Errorf("%s: %q is not a subscription id (a GUID)", SubscriptionIDEnv, sub)
	}
	cfg := cloud.AzurePublic
	if endpoint := or(s.Endpoint, os.Getenv(EndpointEnv)); endpoint != "" {
		cfg = cloud.Configuration{ActiveDirectoryAuthorityHost: cfg.ActiveDirectoryAuthorityHost, Services: map[cloud.ServiceName]cloud.ServiceConfiguration{
			cloud.ResourceManager: {Endpoint: strings.TrimRight(endpoint, "/"), Audience: cfg.Services[cloud.ResourceManager].Audience},
		}}
	}
	if host := or(s.AuthorityHost, os.Getenv("AZURE_AUTHORITY_HOST")); host != "" {
		cfg.ActiveDirectoryAuthorityHost = strings.TrimRight(host, "/") + "/"
	}
	cred, err := credential(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("azure: credentials: %w", err)
	}
	if limits == nil {
		limits = sharedLimits.Get(sub + " " + cfg.Services[cloud.ResourceManager].Endpoint)
	}
	opts := &arm.ClientOptions{ClientOptions: policy.ClientOptions{
		Cloud: cfg, PerRetryPolicies: []policy.Policy{&meter{limits: limits, calls: calls}},
		Telemetry: policy.TelemetryOptions{ApplicationID: applicationID()},
	}}
	vms, err := armcompute.NewVirtualMachinesClient(sub, cred, opts)
	if err != nil {
		return nil, "", fmt.Errorf("azure: %w", err)
	}
	sched, err := armdevtestlabs.NewGlobalSchedulesClient(sub, cred, opts)
	if err != nil {
		return nil, "", fmt.Errorf("azure: %w", err)
	}
	skus, err := armcompute.NewResourceSKUsClient(sub, cred, opts)
	if err != nil {
		return nil, "", fmt.Errorf("azure: %w", err)
	}
	// Compute Schedule's calls are hand-written (sdkAPI.Deallocate) on
	// the pipeline an SDK client would have.
	armc, err := arm.NewClient("computeschedule.ScheduledActionsClient", "v1.0.0", cred, opts)
	if err != nil {
		return nil, "", fmt.Errorf("azure: %w", err)
	}
	return sdkAPI{vms: vms, skus: skus, sched: sched, arm: armc, sub: sub}, sub, nil
}

// applicationID is runfleet/<version> for the SDK's User-Agent, which
// takes at most 24 characters there: a long pseudo-version is cut.
func applicationID() string {
	ua := version.UserAgent()
	return ua[:min(len(ua), 24)]
}

// credential is CML's service principal (AZURE_CLIENT_ID,
// AZURE_CLIENT_SECRET, AZURE_TENANT_ID), or else azidentity's default
// chain.
func credential(cfg cloud.Configuration) (azcore.TokenCredential, error) {
	opts := azcore.ClientOptions{Cloud: cfg}
	if os.Getenv(ClientSecretEnv) == "" {
		return azidentity.NewDefaultAzureCredential(&azidentity.DefaultAzureCredentialOptions{ClientOptions: opts})
	}
	var missing []string
	for _, env := range []string{ClientIDEnv, TenantIDEnv} {
		if os.Getenv(env) == "" {
			missing = append(missing, env)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%s is set, but %s is not", ClientSecretEnv, strings.Join(missing, " and "))
	}
	// Instance discovery asks Microsoft's public authority about the
	// configured one, which an authority of a private cloud (or a
	// stand-in) is not known to.
	custom := cfg.ActiveDirectoryAuthorityHost != cloud.AzurePublic.ActiveDirectoryAuthorityHost
	return azidentity.NewClientSecretCredential(os.Getenv(TenantIDEnv), os.Getenv(ClientIDEnv), os.Getenv(ClientSecretEnv),
		&azidentity.ClientSecretCredentialOptions{ClientOptions: opts, DisableInstanceDiscovery: custom})
}

// Limits keeps a manager's requests within Azure Resource Manager's
// documented limits ("Understand how Azure Resource Manager throttles
// requests", the regional token buckets since 2024): per subscription
// and service principal, reads a bucket of 250 refilled at 25 a second,
// writes and deletes each a bucket of 200 refilled at 10 a second.
// Pools of one subscription share them. A 429 that comes anyway is
// retried after its Retry-After by the SDK (3 times, each wait at most a
// minute), then backed off by the pool. Behind those, Compute throttles
// by its own policies (compute-throttling-limits: listing the VMs 300 a
// minute, a VM's own calls 4 to 15 a minute): its 429 says how long to
// wait (up to twenty minutes), and until then nothing of that policy is
// sent (held), from any pool, since each such request would only be
// refused; an answer that says a policy has nothing left holds it for one
// refill.
type Limits struct {
	read, write, delete *rate.Limiter

	mu   sync.Mutex
	held map[string]time.Time // Compute policy (and VM) → until
}

// NewLimits is Azure Resource Manager's documented limits.
func NewLimits() *Limits {
	return &Limits{read: rate.NewLimiter(25, 250), write: rate.NewLimiter(10, 200), delete: rate.NewLimiter(10, 200), held: map[string]time.Time{}}
}

// computeRefill is how long one call of each Compute policy takes to come
// back at the subscription's refill rate (compute-throttling-limits).
var computeRefill = map[string]time.Duration{
	"PutVM": time.Minute / 500, "DeleteVM": time.Minute / 500, "LowCostGetVM": time.Minute / 8000,
	"HighCostGetVM": time.Minute / 300, "GetOperation": time.Minute / 5000,
}

// computePolicy names the Compute policy a request counts against, and
// the VM it names; "" for a request of another provider.
func computePolicy(r *http.Request) (policy, vm string) {
	_, rest, ok := strings.Cut(strings.ToLower(r.URL.Path), "/providers/microsoft.compute/")
	if !ok {
		return "", ""
	}
	name, isVM := strings.CutPrefix(rest, "virtualmachines/")
	switch {
	case r.Method == http.MethodPut && isVM:
		return "PutVM", name
	case r.Method == http.MethodDelete && isVM:
		return "DeleteVM", name
	case r.Method != http.MethodGet:
		return "", ""
	case rest == "virtualmachines":
		return "HighCostGetVM", ""
	case isVM && !strings.Contains(name, "/"):
		return "LowCostGetVM", name
	}
	// An operation's status (Azure-AsyncOperation, Location).
	return "GetOperation", ""
}

// heldError is a request not sent: Compute throttles its policy until a
// time past the request's deadline.
type heldError struct {
	policy string
	until  time.Time
}

// NonRetriable keeps the SDK's retry policy from sending it again at
// once (azcore's errorinfo.NonRetriable).
func (e *heldError) NonRetriable() {}

func (e *heldError) Error() string {
	return fmt.Sprintf("Compute throttles this subscription's %s requests for another %s (its Retry-After); not sent",
		e.policy, time.Until(e.until).Round(time.Second))
}

// wait waits out a hold on the policy (and VM), or says at once that it
// outlasts ctx.
func (l *Limits) wait(ctx context.Context, policy, vm string) error {
	l.mu.Lock()
	until := l.held[policy]
	if t := l.held[policy+" "+vm]; vm != "" && t.After(until) {
		until = t
	}
	l.mu.Unlock()
	d := time.Until(until)
	if d <= 0 {
		return nil
	}
	if dl, ok := ctx.Deadline(); ok && dl.Before(until) {
		return &heldError{policy: policy, until: until}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// note holds a policy after an answer: a 429's Retry-After (the VM's
// own, for a request that names one: the answer does not say which
// level refused), or one refill where a remaining-resource header says
// none is left.
func (l *Limits) note(resp *http.Response, policy, vm string) {
	now := time.Now()
	hold := func(key string, until time.Time) {
		l.mu.Lock()
		if until.After(l.held[key]) {
			l.held[key] = until
		}
		l.mu.Unlock()
	}
	if resp.StatusCode == http.StatusTooManyRequests {
		if secs, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && secs > 0 {
			key := policy
			if vm != "" {
				key += " " + vm
			}
			hold(key, now.Add(time.Duration(secs)*time.Second))
		}
		return
	}
	for _, h := range resp.Header.Values("x-ms-ratelimit-remaining-resource") {
		for _, v := range strings.Split(h, ",") {
			if _, n, ok := strings.Cut(v, ";"); ok && strings.TrimSpace(n) == "0" {
				hold(policy, now.Add(computeRefill[policy]))
			}
		}
	}
}

// sharedLimits are the limits the pools of one subscription and endpoint share.
var sharedLimits = vm.Shared[*Limits]{New: NewLimits}

// meter waits for each request's turn within its bucket and counts what
// is sent, retries and polls included; token requests go through
// azidentity's own pipeline, neither.
type meter struct {
	limits *Limits
	calls  *atomic.Int64
}

func (m *meter) Do(req *policy.Request) (*http.Response, error) {
	lim := m.limits.write
	switch req.Raw().Method {
	case http.MethodGet, http.MethodHead:
		lim = m.limits.read
	case http.MethodDelete:
		lim = m.limits.delete
	}
	if err := lim.Wait(req.Raw().Context()); err != nil {
		return nil, err
	}
	policy, vm := computePolicy(req.Raw())
	if policy != "" {
		if err := m.limits.wait(req.Raw().Context(), policy, vm); err != nil {
			return nil, err
		}
	}
	if m.calls != nil {
		m.calls.Add(1)
	}
	resp, err := req.Next()
	if err == nil && policy != "" {
		m.limits.note(resp, policy, vm)
	}
	return resp, err
}

// cmlTables are CML's aliases on Azure, from the iterative provider's
// tables.
var cmlTables = vm.Tables{
	Cloud:         "Azure",
	DefaultRegion: "us-west",
	Regions:       map[string]string{"us-east": "eastus", "us-west": "westus2", "eu-north": "northeurope", "eu-west": "westeurope"},
	Types: map[string]string{
		"s": "Standard_B1s", "m": "Standard_F8s_v2", "l": "Standard_F32s_v2", "xl": "Standard_F64s_v2",
		"m+t4":  "Standard_NC4as_T4_v3",
		"m+k80": "Standard_NC6", "l+k80": "Standard_NC12", "xl+k80": "Standard_NC24",
		"m+v100": "Standard_NC6s_v3", "l+v100": "Standard_NC12s_v3", "xl+v100": "Standard_NC24s_v3",
	},
}

// The stock images CML's runners boot without --cloud-image, from the
// marketplace: Canonical's Ubuntu 24.04 LTS, and for N-series sizes (with
// GPUs) Microsoft's Ubuntu HPC image with NVIDIA's driver (Ubuntu 22.04).
const (
	StockUbuntu = "Canonical:ubuntu-24_04-lts:server:latest"
	StockGPU    = "microsoft-dsvm:ubuntu-hpc:2204:latest"
)

// StockImage is the stock image for a VM size.
func StockImage(size string) string {
	if strings.HasPrefix(strings.ToLower(size), "standard_n") {
		return StockGPU
	}
	return StockUbuntu
}

// CMLSection takes `--cloud=azure` as CML does (vm.ParseCML): the region
// (a location), the type (a VM size), the disk, spot and its price, the
// startup script, the image, --cloud-permission-set (a user-assigned
// identity's resource ID), --cloud-metadata (tags), --cloud-ssh-private
// (its public key is authorised on the VM). Credentials come from CML's
// AZURE_* variables; the resource group and subnet from
// RUNFLEET_AZURE_RESOURCE_GROUP and RUNFLEET_AZURE_SUBNET.
func (driver) CMLSection(o provider.CMLOptions) (json.RawMessage, bool, error) {
	c := o.Cloud
	if c["cloud"] != "azure" {
		return nil, false, nil
	}
	getenv := o.Getenv
	if getenv == nil {
		getenv = os.LookupEnv
	}
	env := func(k string) string { v, _ := getenv(k); return v }
	cml, err := vm.ParseCML(o, cmlTables)
	errs := []error{err}
	install, err := cml.Stock(o, "azure", StockImage(cml.Type), "an image (Publisher:Offer:Sku:Version, or an image's resource ID)")
	errs = append(errs, err)
	s := Section{Image: cml.Image, Install: install, Locations: []string{cml.Region}, VMSizes: []string{cml.Type}, Spot: cml.Spot,
		StartupScript: cml.StartupScript, SSHPublicKey: cml.SSHPublicKey, Disk: Disk{SizeGB: cml.HDDSizeGB},
		ResourceGroup: env(ResourceGroupEnv), Subnet: env(SubnetEnv), Identity: cml.PermissionSet, Tags: cml.Metadata}
	if s.ResourceGroup == "" {
		errs = append(errs, fmt.Errorf("%s: is required with --cloud=azure: the resource group the runner's VM goes in", ResourceGroupEnv))
	}
	if s.Subnet == "" {
		errs = append(errs, fmt.Errorf("%s: is required with --cloud=azure: the subnet (resource ID) of the runner's VM, in %s", SubnetEnv, cml.Region))
	}
	if p := cml.SpotPrice; p != "" {
		// A negative price is none (vm.ParseCML): Azure's -1, up to the
		// pay-as-you-go price, its default.
		var price float64
		if _, err := fmt.Sscanf(p, "%g", &price); err != nil || price == 0 {
			errs = append(errs, fmt.Errorf("--cloud-spot-price: %q is not dollars an hour, or -1", p))
		}
		s.MaxPrice = &price
	}
	if err := errors.Join(errs...); err != nil {
		return nil, true, err
	}
	b, err := json.Marshal(s)
	return b, true, err
}
