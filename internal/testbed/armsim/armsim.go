// Package armsim is a stand-in for Azure's VMs for tests: armcompute's
// own fake VirtualMachinesServer (package fake), its methods kept here
// on a model of VMs with their NICs, public addresses and OS disks,
// wired in-process through a client's options (Transport) or served
// over HTTPS as Azure Resource Manager answers: the VM calls runfleet
// makes, their long-running operations (polled as the fake poller
// protocol has them, with Retry-After), error bodies and codes
// (SkuNotAvailable, AllocationFailed, OperationNotAllowed for a spent
// quota, 429 with Retry-After from ARM's token buckets), and Entra ID's
// client-credentials token endpoint, whose bearer token every call must
// carry. VMs boot: with a Docker engine, each is a container of the
// image its image reference maps to, running its custom data as
// cloud-init would, beside a stand-in Instance Metadata Service
// (instance/compute, Scheduled Events) that a test can mark for
// eviction.
//
// No Azure emulator can be had here; the fake servers are Azure's own,
// and what they leave out (the model, the HTTP front, tokens, limits)
// is hand-written.
package armsim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/pem"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7/fake"
	"github.com/moby/moby/client"
	"golang.org/x/time/rate"
)

// The stand-in's subscription, tenant, service principal and resource
// group.
const (
	Subscription = "00000000-0000-4000-8000-000000000042"
	Tenant       = "11111111-1111-4111-8111-111111111111"
	ClientID     = "22222222-2222-4222-8222-222222222222"
	Group        = "runfleet-e2e"
)

// Locations the stand-in offers.
var Locations = []string{"eastus", "westus2", "northeurope", "westeurope"}

// Options configure a Server.
type Options struct {
	// Docker boots VMs as containers; nil: VMs run nothing.
	Docker *client.Client
	// HostAddr is how a container reaches this host
	// (host.docker.internal).
	HostAddr string
	// Latency is added to every API answer.
	Latency time.Duration
	// CreatePolls is how many polls a VM's creation answers in progress
	// (2), each with a Retry-After of PollAfter (1s).
	CreatePolls int
	PollAfter   time.Duration
	Logger      *slog.Logger
	// EventsDelay is how long a VM's Scheduled Events take to answer
	// after its first call, which enables them: every call until then
	// waits (90 s when 0; Azure says the first call can take up to two
	// minutes, learn.microsoft.com/azure/virtual-machines/linux/
	// scheduled-events, "Enabling and disabling Scheduled Events").
	EventsDelay time.Duration
}

// Server is the stand-in.
type Server struct {
	// URL is Azure Resource Manager's endpoint and Entra ID's authority
	// host, over HTTPS; CAFile holds its certificate.
	URL, CAFile string
	opt         Options
	ts          *httptest.Server
	secret      string
	latency     atomic.Int64
	fake        *fake.VirtualMachinesServerTransport
	listMu      sync.Mutex // one listing through the fake's pager at a time

	mu           sync.Mutex
	tokens       map[string]time.Time
	vms          map[string]*VM // by group/name
	order        []*VM
	images       map[string]string
	subnets      map[string]string // subnet ID → location
	groups       map[string]bool
	noCap        map[string]bool // "<priority> <size> <location>", with "" for any
	noSKU        map[string]bool // "<size> <location>"
	noQuota      map[string]bool // locations
	faults       map[string][]fault
	calls        map[string]int
	lro          map[string]string        // path → the API whose operation it polls
	scheds       map[string]*Schedule     // by group/name
	deallocs     []*Deallocation          // submitted to Compute Schedule
	compute      map[string]*rate.Limiter // Compute's policies: by name, and "<name> <vm>"
	offset       atomic.Int64             // Advance's, in nanoseconds
	quit         chan struct{}
	buckets      map[string]*rate.Limiter
	down         bool
	wg           sync.WaitGroup
	dir          string
	pki          *pki // what signs the VMs' attested data
	attestations int
}

type fault struct {
	status int
	code   string
}

// New starts the stand-in on a free port of all addresses.
func New(o Options) (*Server, error) {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.HostAddr == "" {
		o.HostAddr = "host.docker.internal"
	}
	if o.CreatePolls == 0 {
		o.CreatePolls = 2
	}
	if o.PollAfter == 0 {
		o.PollAfter = time.Second
	}
	dir, err := os.MkdirTemp("", "armsim")
	if err != nil {
		return nil, err
	}
	s := &Server{opt: o, secret: "sp-secret-" + randHex(16), tokens: map[string]time.Time{}, vms: map[string]*VM{},
		images: map[string]string{}, subnets: map[string]string{}, groups: map[string]bool{Group: true},
		noCap: map[string]bool{}, noSKU: map[string]bool{}, noQuota: map[string]bool{}, faults: map[string][]fault{},
		calls: map[string]int{}, lro: map[string]string{}, scheds: map[string]*Schedule{}, compute: map[string]*rate.Limiter{}, quit: make(chan struct{}), dir: dir,
		buckets: map[string]*rate.Limiter{
			// Azure Resource Manager's documented token buckets.
			"read": rate.NewLimiter(25, 250), "write": rate.NewLimiter(10, 200), "delete": rate.NewLimiter(10, 200),
		}}
	if s.pki, err = newPKI(dir); err != nil {
		return nil, err
	}
	s.latency.Store(int64(o.Latency))
	for _, loc := range Locations {
		s.subnets[SubnetID(loc)] = loc
	}
	s.fake = fake.NewVirtualMachinesServerTransport(s.server())
	s.wg.Go(func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-s.quit:
				return
			case <-t.C:
				s.fireSchedules()
				s.fireDeallocations()
			}
		}
	})
	s.ts = httptest.NewUnstartedServer(s.routes())
	s.ts.StartTLS()
	s.URL = s.ts.URL
	s.CAFile = filepath.Join(dir, "ca.pem")
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.ts.Certificate().Raw})
	if err := os.WriteFile(s.CAFile, ca, 0o644); err != nil {
		return nil, err
	}
	return s, nil
}

// HTTPClient is a client of the stand-in's HTTPS front, trusting its
// certificate.
func (s *Server) HTTPClient() *http.Client { return s.ts.Client() }

// Transport is the fake server as a client's transport, in-process: no
// token, no limits, no latency.
func (s *Server) Transport() policy.Transporter { return uncancelled{s.fake, s} }

// uncancelled hands requests to the fake without their cancellation: its
// dispatch (armcompute v7.3.0's fake) closes its result channel when a
// request's context ends first, and the handler's goroutine may then send
// on it, which panics the whole process (a manager killed mid-request did
// so in TestChaosAzureVM). The fake's handlers are in memory and quick.
type uncancelled struct {
	t policy.Transporter
	s *Server
}

func (u uncancelled) Do(r *http.Request) (*http.Response, error) {
	// Auto-shutdown schedules have no fake server (armdevtestlabs v1.0.0
	// predates them), nor has Compute Schedule (no Go module of it is
	// served): the stand-in's own handlers answer, as they do the
	// resource SKUs list, whose fake has no state to read.
	for _, h := range []struct {
		route func(*http.Request) (string, string)
		serve func(http.ResponseWriter, *http.Request, string)
	}{{scheduleRoute, u.s.schedules}, {computeScheduleRoute, u.s.submitDeallocations}, {skusRoute, u.s.skus}} {
		if api, _ := h.route(r); api != "" {
			rec := httptest.NewRecorder()
			u.s.count(api)
			h.serve(rec, r, api)
			resp := rec.Result()
			resp.Request = r
			return resp, nil
		}
	}
	// Counted here, in-process as over HTTP (Calls).
	if api, _ := u.s.route(r); api != "" {
		if strings.HasSuffix(r.URL.Path, "/get/fake/status") {
			api += " poll"
		}
		u.s.count(api)
	}
	resp, err := u.t.Do(r.WithContext(context.WithoutCancel(r.Context())))
	if err == nil {
		u.s.created(r, resp)
	}
	return resp, err
}

// Close stops the API and ends every VM still up.
func (s *Server) Close() {
	s.mu.Lock()
	live := append([]*VM(nil), s.order...)
	s.mu.Unlock()
	s.ts.Close()
	s.pki.aia.Close()
	close(s.quit)
	for _, v := range live {
		s.end(v, true)
	}
	s.wg.Wait()
	os.RemoveAll(s.dir)
}

// SubnetID is the stand-in's subnet in a location.
func SubnetID(location string) string {
	return "/subscriptions/" + Subscription + "/resourceGroups/" + Group + "/providers/Microsoft.Network/virtualNetworks/runfleet-" + location + "/subnets/runners"
}

// Env is the manager's Azure environment as CML gives it: the service
// principal's secret, its tenant and the subscription; the authority is
// the stand-in's, and so is the CA the manager trusts.
func (s *Server) Env() []string {
	return []string{"AZURE_CLIENT_ID=" + ClientID, "AZURE_CLIENT_SECRET=" + s.secret, "AZURE_TENANT_ID=" + Tenant,
		"AZURE_SUBSCRIPTION_ID=" + Subscription, "AZURE_AUTHORITY_HOST=" + s.URL, "SSL_CERT_FILE=" + s.CAFile}
}

// Secret is the service principal's secret: a test looks for it where
// no credential may be.
func (s *Server) Secret() string { return s.secret }

// AddImage maps an image reference (URN or resource ID) to the Docker
// image its VMs boot ("" for VMs that run nothing).
func (s *Server) AddImage(image, dockerImage string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.images[image] = dockerImage
}

// SetEventsDelay changes EventsDelay for the VMs whose Scheduled Events
// are not yet enabled.
func (s *Server) SetEventsDelay(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opt.EventsDelay = d
}

// SetLatency changes the latency added to every answer.
func (s *Server) SetLatency(d time.Duration) { s.latency.Store(int64(d)) }

// NoCapacity takes capacity away: of a priority ("Spot", "Regular"), for
// one size, in one location ("" for all). A creation it meets fails in
// its operation with AllocationFailed.
func (s *Server) NoCapacity(priority, size, location string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noCap[priority+" "+size+" "+location] = true
}

// NoSKU makes a size unavailable in a location: a creation is refused at
// once with SkuNotAvailable.
func (s *Server) NoSKU(size, location string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noSKU[size+" "+location] = true
}

// NoQuota spends a location's vCPU quota: a creation is refused at once
// with OperationNotAllowed, its message naming the quota.
func (s *Server) NoQuota(location string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noQuota[location] = true
}

// RestoreCapacity gives back what NoCapacity, NoSKU and NoQuota took.
func (s *Server) RestoreCapacity() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.noCap)
	clear(s.noSKU)
	clear(s.noQuota)
}

// Fail makes the next n calls of an API ("VirtualMachinesClient.BeginCreateOrUpdate")
// answer an error.
func (s *Server) Fail(api string, n, status int, code string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for range n {
		s.faults[api] = append(s.faults[api], fault{status, code})
	}
}

// SetDown takes the whole API down (503) or brings it back.
func (s *Server) SetDown(down bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = down
}

// Calls counts the API calls answered, by API name
// ("VirtualMachinesClient.NewListAllPager", "VirtualMachinesClient.BeginCreateOrUpdate poll",
// "token").
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.calls)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
