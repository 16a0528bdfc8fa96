// Package gcesim is a stand-in for Compute Engine for tests: the REST
// calls runfleet makes (instances insert, bulkInsert (bulk.go), get, list
// and aggregatedList with filter, maxResults and pageToken, delete; zone
// operations get and wait, aggregated operations with a filter) as the
// API reference documents them, their error bodies and reasons, the
// per-minute rate quotas by group and region (quota.go; 403
// rateLimitExceeded), and OAuth: a service account's key (Credentials)
// whose JWT is exchanged at the stand-in's token URI for the bearer token
// every call must carry. Instances boot: with a Docker
// engine, each is a container of the image its source image maps to,
// running its startup-script as the guest agent would, beside a
// stand-in metadata server (Metadata-Flavor: Google; instance/preempted,
// instance/maintenance-event, attributes) that a test can mark
// preempted. A test takes capacity or quota away, adds latency, injects
// errors and takes the API down.
//
// No Compute Engine emulator can be had here, so this is hand-written;
// it covers what runfleet calls. Request and answer bodies are the
// published schema's (computepb, through protojson).
package gcesim

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/golang-jwt/jwt/v4"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/simserve"
)

// Project is the stand-in's project.
const Project = "runfleet-e2e"

// ClientEmail is the service account whose key Credentials holds.
const ClientEmail = "runfleet@" + Project + ".iam.gserviceaccount.com"

// Zones the stand-in offers.
var Zones = []string{"us-central1-a", "us-central1-b", "us-central1-c", "us-east1-c", "us-west1-b", "europe-west1-d", "europe-north1-a"}

// Options configure a Server.
type Options struct {
	// Docker boots instances as containers; nil: instances run nothing.
	Docker *client.Client
	// HostAddr is how a container reaches this host
	// (host.docker.internal).
	HostAddr string
	// Latency is added to every API answer.
	Latency time.Duration
	// Quotas are the project's rate quotas, requests a minute by group
	// (QuotaReadsPerRegion, ...): 1,500 for a group not given.
	Quotas map[string]int
	// WaitMax is how long an operation's wait holds (2 minutes).
	WaitMax time.Duration
	Logger  *slog.Logger
}

// Server is the stand-in.
type Server struct {
	URL     string
	opt     Options
	ts      *httptest.Server
	key     *rsa.PrivateKey
	keyID   string
	id      *signer // Google's key for instance identity tokens
	latency atomic.Int64

	mu         sync.Mutex
	tokens     map[string]time.Time
	scopes     map[string]string    // by token: the scopes it was granted
	instances  map[string]*Instance // by zone/name
	order      []*Instance
	disks      map[string]*Disk // by zone/name
	ops        map[string]*op   // by name
	opOrder    []*op
	requests   map[string]*op // requestId -> op
	images     map[string]string
	noCap      map[string]bool // "<model> <type> <zone>", with "" for any
	room       map[string]int  // the same keys: instances that still fit
	noQuota    map[string]bool // regions
	faults     map[string][]fault
	calls      map[string]int
	minute     time.Time
	used       map[quota]int // requests this minute
	down       bool
	closing    bool
	wg         sync.WaitGroup
	changed    *sync.Cond
	projectNum string
	identities int
}

type fault struct {
	status int
	reason string
}

// New starts the stand-in on a free port of all addresses.
func New(o Options) (*Server, error) {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.HostAddr == "" {
		o.HostAddr = "host.docker.internal"
	}
	if o.WaitMax == 0 {
		o.WaitMax = 2 * time.Minute
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	id, err := newSigner()
	if err != nil {
		return nil, err
	}
	s := &Server{opt: o, key: key, keyID: randHex(20), id: id, tokens: map[string]time.Time{}, scopes: map[string]string{},
		instances: map[string]*Instance{}, disks: map[string]*Disk{}, ops: map[string]*op{}, requests: map[string]*op{},
		images: map[string]string{}, noCap: map[string]bool{}, room: map[string]int{}, noQuota: map[string]bool{}, faults: map[string][]fault{},
		calls: map[string]int{}, used: map[quota]int{}, projectNum: "424242424242"}
	s.changed = sync.NewCond(&s.mu)
	s.latency.Store(int64(o.Latency))
	var url string
	s.ts, url, _ = simserve.New(s.routes(), "")
	s.URL = url
	s.ts.Start()
	return s, nil
}

// Close stops the API and ends every instance still up.
func (s *Server) Close() {
	s.mu.Lock()
	s.closing = true
	live := append([]*Instance(nil), s.order...)
	s.changed.Broadcast()
	s.mu.Unlock()
	s.ts.Close()
	for _, in := range live {
		s.end(in, true)
	}
	s.wg.Wait()
}

// Credentials is a service account key file for the stand-in, as
// GOOGLE_APPLICATION_CREDENTIALS names one or CML's
// GOOGLE_APPLICATION_CREDENTIALS_DATA holds it.
func (s *Server) Credentials() []byte {
	der, _ := x509.MarshalPKCS8PrivateKey(s.key)
	b, _ := json.Marshal(map[string]string{
		"type": "service_account", "project_id": Project, "private_key_id": s.keyID,
		"private_key":  string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})),
		"client_email": ClientEmail, "client_id": "1000000000000000000001",
		"token_uri": s.URL + "/token", "auth_uri": "https://accounts.google.com/o/oauth2/auth",
	})
	return b
}

// PrivateKeyID is the key's id, which is in Credentials: a test looks
// for it where no credential may be.
func (s *Server) PrivateKeyID() string { return s.keyID }

// AddImage maps a source image to the Docker image its instances boot
// ("" for instances that run nothing).
func (s *Server) AddImage(image, dockerImage string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.images[image] = dockerImage
}

// SetLatency changes the latency added to every answer.
func (s *Server) SetLatency(d time.Duration) { s.latency.Store(int64(d)) }

// NoCapacity takes capacity away: of a provisioning model ("SPOT",
// "STANDARD"), for one machine type, in one zone ("" for all). An insert
// it meets fails in its operation with ZONE_RESOURCE_POOL_EXHAUSTED.
func (s *Server) NoCapacity(model, typ, zone string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noCap[model+" "+typ+" "+zone] = true
}

// LimitCapacity leaves room for n more instances of a provisioning
// model, machine type and zone ("" for any); the next are refused as
// NoCapacity refuses them. A bulk insert gets what room there is.
func (s *Server) LimitCapacity(model, typ, zone string, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.room[model+" "+typ+" "+zone] = n
}

// NoQuota spends a region's CPU quota: an insert there fails in its
// operation with QUOTA_EXCEEDED.
func (s *Server) NoQuota(region string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noQuota[region] = true
}

// RestoreCapacity gives back what NoCapacity, LimitCapacity and NoQuota
// took.
func (s *Server) RestoreCapacity() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.noCap)
	clear(s.room)
	clear(s.noQuota)
}

// SetDown makes the API answer every call 503 (the instances and their
// metadata servers go on), or brings it back.
func (s *Server) SetDown(down bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = down
}

// Fail makes the next calls of a method (instances.insert, ...) answer
// with an HTTP error of this status and reason, one each.
func (s *Server) Fail(method string, status int, reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[method] = append(s.faults[method], fault{status, reason})
}

// Calls returns how many requests each method got.
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}

// token answers the OAuth 2.0 JWT bearer grant of a service account
// (RFC 7523, as Google's token endpoint takes it): the assertion must be
// signed by the account's key, issued by its email, for this audience.
func (s *Server) token(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil || r.PostForm.Get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer" {
		oauthError(w, "unsupported_grant_type", "Invalid grant_type")
		return
	}
	claims := jwt.MapClaims{}
	_, err := jwt.ParseWithClaims(r.PostForm.Get("assertion"), claims, func(t *jwt.Token) (any, error) {
		if _, ok := t.Method.(*jwt.SigningMethodRSA); !ok {
			return nil, fmt.Errorf("alg %v", t.Header["alg"])
		}
		return &s.key.PublicKey, nil
	})
	if err != nil || claims["iss"] != ClientEmail || claims["aud"] != s.URL+"/token" || claims["scope"] == nil {
		oauthError(w, "invalid_grant", "Invalid JWT Signature.")
		return
	}
	tok := "ya29.gcesim-" + randHex(24)
	scope, _ := claims["scope"].(string)
	s.mu.Lock()
	s.tokens[tok] = time.Now().Add(time.Hour)
	s.scopes[tok] = scope
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"access_token": tok, "expires_in": 3599, "token_type": "Bearer"})
}

func oauthError(w http.ResponseWriter, code, desc string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadRequest)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": code, "error_description": desc})
}

// tokenScopes are the scopes of a request's bearer token, if it is valid.
func (s *Server) tokenScopes(r *http.Request) (string, bool) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	s.mu.Lock()
	defer s.mu.Unlock()
	exp, known := s.tokens[tok]
	if !ok || !known || !time.Now().Before(exp) {
		return "", false
	}
	return s.scopes[tok], true
}

// authorized checks the bearer token.
func (s *Server) authorized(r *http.Request) bool {
	_, ok := s.tokenScopes(r)
	return ok
}

// apiError is Compute Engine's error body.
type apiError struct {
	status  int
	reason  string
	message string
}

func (e *apiError) write(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"code": e.status, "message": e.message,
		"errors": []map[string]string{{"message": e.message, "domain": "global", "reason": e.reason}},
	}})
}

func notFound(what string) *apiError {
	return &apiError{http.StatusNotFound, "notFound", fmt.Sprintf("The resource '%s' was not found", what)}
}

func invalid(format string, a ...any) *apiError {
	return &apiError{http.StatusBadRequest, "invalid", fmt.Sprintf(format, a...)}
}

// admit counts a call and applies the outage, injected faults and the
// per-minute quotas, which refill at each minute's start.
func (s *Server) admit(method string, r *http.Request) *apiError {
	if d := time.Duration(s.latency.Load()); d > 0 {
		time.Sleep(d)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls[method]++
	if s.down {
		return &apiError{http.StatusServiceUnavailable, "backendError", "The service is currently unavailable."}
	}
	if q := s.faults[method]; len(q) > 0 {
		f := q[0]
		s.faults[method] = q[1:]
		return &apiError{f.status, f.reason, "injected by the test"}
	}
	s.window()
	q := quotaOf(r)
	limit := s.opt.Quotas[q.group]
	if limit == 0 {
		limit = DefaultQuota
	}
	if s.used[q] >= limit {
		return &apiError{http.StatusForbidden, "rateLimitExceeded", fmt.Sprintf("Quota exceeded for quota metric '%s' and limit '%s per project' of service 'compute.googleapis.com' for consumer 'project_number:%s'.", q.metric(), q.metric(), s.projectNum)}
	}
	s.used[q]++
	return nil
}

// window starts a new minute's count when the minute has changed.
// Called with s.mu held.
func (s *Server) window() {
	if minute := time.Now().Truncate(time.Minute); !minute.Equal(s.minute) {
		s.minute = minute
		clear(s.used)
	}
}

// SpendQuota spends a group's quota (in region, for a regional group)
// for the rest of the minute, as another client of the project would.
func (s *Server) SpendQuota(group, region string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.window()
	limit := s.opt.Quotas[group]
	if limit == 0 {
		limit = DefaultQuota
	}
	s.used[quota{group, region}] = limit
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// region is a zone's region.
func region(zone string) string {
	if i := strings.LastIndexByte(zone, '-'); i > 0 {
		return zone[:i]
	}
	return zone
}
