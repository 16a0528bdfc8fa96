// Package ec2sim is a stand-in for Amazon EC2 for tests: the Query API
// (RunInstances, DescribeInstances with filters and pages,
// TerminateInstances, CreateTags, DescribeSpotInstanceRequests, and the
// instances' EBS volumes: DescribeVolumes, DeleteVolume, and the Spot
// price history) as the EC2 API reference documents it, with its error
// codes and its request rate buckets, behind the SDK's base endpoint; the
// Price List Query API's on-demand prices and Parameter Store, each on an
// endpoint of its own; and instances that boot.
// With a Docker engine, an instance is a container of the image its AMI
// maps to, which runs its user data as cloud-init would and reads a
// stand-in instance metadata service of its own (IMDSv2: session tokens,
// instance-id, spot/instance-action, rebalance recommendations). A test
// takes capacity away, injects errors, adds latency, and gives spot
// interruption notices.
//
// No EC2 emulator can be had here (moto and LocalStack are Python), so
// this is hand-written; it covers what runfleet calls, to the letter.
package ec2sim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/xml"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moby/moby/client"
	"golang.org/x/time/rate"
)

// Credentials the stand-in accepts (any secret: it checks the key id).
const (
	AccessKey = "ec2sim-test-key-id"
	SecretKey = "ec2sim-secret-key-not-a-real-one"
)

// Options configure a Server.
type Options struct {
	// Docker boots instances as containers; nil: instances run nothing.
	Docker *client.Client
	// HostAddr is how a container reaches this host
	// (host.docker.internal).
	HostAddr string
	// Latency is added to every API answer.
	Latency time.Duration
	// Unthrottled turns the request rate buckets off.
	Unthrottled bool
	Logger      *slog.Logger
	// Engine, where set, is the host engine's socket, given to each
	// instance at /var/run/docker.sock as the engine of its own that a
	// real instance would run once Docker is installed, with /tmp
	// shared: a container the instance starts is the host's, so a path
	// it is given must be the same on both, and /tmp is where
	// Atlassian's runner keeps its work (WORKING_DIRECTORY=/tmp).
	Engine string
	// SSMHost is the address Parameter Store's stand-in listens on and
	// is named by in SSMURL (127.0.0.1 when empty): one that the
	// instances' containers reach too, Docker's bridge, where they use
	// it.
	SSMHost string
}

// Server is the stand-in.
type Server struct {
	URL     string
	opt     Options
	srv     *http.Server
	ln      net.Listener
	id      string
	latency atomic.Int64

	mu          sync.Mutex
	instances   map[string]*Instance
	order       []string
	volumes     map[string]*Volume
	devices     map[string][]BlockDevice // AMI -> its block device mapping
	tokens      map[string]string        // client token -> instance id
	images      map[string]string        // AMI -> Docker image ("" boots nothing)
	params      map[string]string        // Systems Manager parameter -> the AMI it names
	subnets     map[string]string        // subnet -> zone
	noCap       map[string]bool          // "<market> <type> <zone>", "<market> <type>", "<market>"
	capacity    map[string]int           // "<market> <type>": instances left to launch, where limited
	spotPrice   map[string]float64       // by instance type; DefaultSpotPrice otherwise
	spotChanges map[string][]spotPoint   // by instance type: each SetSpotPrice
	started     time.Time
	pricing     *pricingState
	faults      map[string][]string
	calls       map[string]int
	buckets     map[string]*rate.Limiter
	resources   map[string]*rate.Limiter // resource token buckets
	ssm         *ssmState
	ssmURL      string
	ident       identity // signs instance identity documents
	identities  int      // identity document signatures read
	wg          sync.WaitGroup
	closing     bool
	quit        chan struct{} // closed by Close: pending interruptions end
	down        bool          // every API call answers 503 Unavailable
}

// New starts the stand-in on a free port of all addresses.
func New(o Options) (*Server, error) {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.HostAddr == "" {
		o.HostAddr = "host.docker.internal"
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{
		opt: o, ln: ln, id: randHex(4), quit: make(chan struct{}), started: time.Now(), spotChanges: map[string][]spotPoint{},
		URL:       "http://" + ln.Addr().String(),
		instances: map[string]*Instance{}, tokens: map[string]string{}, volumes: map[string]*Volume{}, devices: map[string][]BlockDevice{},
		images: map[string]string{}, params: map[string]string{}, noCap: map[string]bool{}, capacity: map[string]int{}, spotPrice: map[string]float64{}, faults: map[string][]string{},
		calls: map[string]int{}, buckets: map[string]*rate.Limiter{}, resources: map[string]*rate.Limiter{},
		subnets: map[string]string{
			"subnet-0a000000000000001": "us-east-1a", "subnet-0b000000000000002": "us-east-1b",
			"subnet-0c000000000000003": "us-east-1c",
		},
	}
	s.latency.Store(int64(o.Latency))
	if s.ident, err = newIdentity(); err != nil {
		_ = ln.Close()
		return nil, err
	}
	if err := s.startSSM(); err != nil {
		_ = ln.Close()
		return nil, err
	}
	if err := s.startPricing(); err != nil {
		_ = ln.Close()
		_ = s.ssm.srv.Close()
		return nil, err
	}
	s.srv = &http.Server{Handler: http.HandlerFunc(s.serve), ReadHeaderTimeout: 10 * time.Second}
	go s.srv.Serve(ln)
	return s, nil
}

// Close stops the API and terminates every instance still up.
func (s *Server) Close() {
	s.mu.Lock()
	s.closing = true
	close(s.quit)
	var live []*Instance
	for _, in := range s.instances {
		live = append(live, in)
	}
	s.mu.Unlock()
	_ = s.srv.Close()
	_ = s.ssm.srv.Close()
	_ = s.pricing.srv.Close()
	for _, in := range live {
		s.stopInstance(in, "", "")
	}
	s.wg.Wait()
	s.removeLeftovers()
}

// removeLeftovers removes any container of this server's instances still
// there once every instance has ended, as nothing of a terminated
// instance stays on EC2.
func (s *Server) removeLeftovers() {
	if s.opt.Docker == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := s.opt.Docker.ContainerList(ctx, client.ContainerListOptions{All: true, Filters: make(client.Filters).Add("label", LabelServer+"="+s.id)})
	if err != nil {
		s.opt.Logger.Warn("ec2sim: list the instances' containers", "err", err)
		return
	}
	for _, c := range res.Items {
		s.opt.Logger.Warn("ec2sim: an instance's container outlived it", "container", c.Names)
		_, _ = s.opt.Docker.ContainerRemove(ctx, c.ID, client.ContainerRemoveOptions{Force: true})
	}
}

// AddImage maps an AMI to the Docker image its instances boot ("" for
// instances that run nothing).
func (s *Server) AddImage(ami, image string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.images[ami] = image
}

// AddParameter makes a Systems Manager parameter name an AMI, as AWS's
// and Canonical's public parameters do (/aws/service/...), for images
// given as resolve:ssm:<name>.
func (s *Server) AddParameter(name, ami string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.params[name] = ami
}

// SetLatency changes the latency added to every answer.
func (s *Server) SetLatency(d time.Duration) { s.latency.Store(int64(d)) }

// NoCapacity takes capacity away: of a market ("spot", "on-demand"),
// for one instance type, or in one zone too ("" for all).
func (s *Server) NoCapacity(market, typ, zone string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noCap[strings.TrimSpace(market+" "+typ+" "+zone)] = true
}

// DefaultSpotPrice is the Spot price (USD an hour) of an instance type
// that SetSpotPrice has not priced.
const DefaultSpotPrice = 0.10

// SetSpotPrice sets an instance type's Spot price (USD an hour) from
// now on: its price history keeps the change.
func (s *Server) SetSpotPrice(typ string, price float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.spotPrice[typ] = price
	s.spotChanges[typ] = append(s.spotChanges[typ], spotPoint{time.Now(), price})
}

// SetDown makes the API answer every call 503 Unavailable (an outage of
// EC2's endpoint; the instances and their metadata services go on), or
// brings it back.
func (s *Server) SetDown(down bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = down
}

// LimitCapacity leaves n instances of a type in a market ("spot",
// "on-demand") to launch, in every zone.
func (s *Server) LimitCapacity(market, typ string, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.capacity[market+" "+typ] = n
}

// RestoreCapacity gives back all the capacity NoCapacity took.
func (s *Server) RestoreCapacity() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.noCap)
	clear(s.capacity)
}

// Fail makes the next calls of an action answer with these error codes,
// one each.
func (s *Server) Fail(action string, codes ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[action] = append(s.faults[action], codes...)
}

// Calls returns how many requests each action got.
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}

// buckets are the request token buckets of the EC2 API reference's
// "Request throttling" page: size and refill per second.
var bucketSizes = map[string][2]float64{
	"RunInstances":                 {5, 2},
	"TerminateInstances":           {100, 5},
	"CreateTags":                   {100, 10},
	"DescribeInstances":            {100, 20},
	"DescribeSpotInstanceRequests": {100, 20},
	// A non-mutating action and a mutating one
	// (ec2/latest/devguide/ec2-api-throttling.html).
	"DescribeVolumes":           {100, 20},
	"DescribeInstanceAttribute": {100, 20},
	"DescribeInstanceTypes":     {100, 20},
	"DescribeSpotPriceHistory":  {100, 20},
	"DeleteVolume":              {200, 5},
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	if d := time.Duration(s.latency.Load()); d > 0 {
		time.Sleep(d)
	}
	if r.Method != http.MethodPost {
		writeError(w, http.StatusBadRequest, "InvalidAction", "the Query API takes POST here")
		return
	}
	if err := r.ParseForm(); err != nil {
		writeError(w, http.StatusBadRequest, "MalformedQueryString", err.Error())
		return
	}
	form := r.PostForm
	action := form.Get("Action")
	if !strings.HasPrefix(r.Header.Get("Authorization"), "AWS4-HMAC-SHA256 Credential="+AccessKey+"/") {
		writeError(w, http.StatusUnauthorized, "AuthFailure", "AWS was not able to validate the provided access credentials")
		return
	}
	s.mu.Lock()
	s.calls[action]++
	if s.down {
		s.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "Unavailable", "The service is unavailable. Please try again shortly.")
		return
	}
	var fault string
	if q := s.faults[action]; len(q) > 0 {
		fault, s.faults[action] = q[0], q[1:]
	}
	b := s.bucket(action)
	s.mu.Unlock()
	if fault != "" {
		status := http.StatusBadRequest
		if fault == "RequestLimitExceeded" || fault == "Unavailable" || fault == "InternalError" {
			status = http.StatusServiceUnavailable
		}
		writeError(w, status, fault, "injected by the test")
		return
	}
	if b != nil && !b.Allow() {
		writeError(w, http.StatusServiceUnavailable, "RequestLimitExceeded", "Request limit exceeded.")
		return
	}
	var out any
	var err *apiError
	switch action {
	case "RunInstances":
		out, err = s.runInstances(form)
	case "DescribeInstances":
		out, err = s.describeInstances(form)
	case "TerminateInstances":
		out, err = s.terminateInstances(form)
	case "CreateTags":
		out, err = s.createTags(form)
	case "DescribeSpotInstanceRequests":
		out, err = s.describeSpotRequests(form)
	case "DescribeVolumes":
		out, err = s.describeVolumes(form)
	case "DeleteVolume":
		out, err = s.deleteVolume(form)
	case "DescribeInstanceAttribute":
		out, err = s.describeAttribute(form)
	case "DescribeInstanceTypes":
		out, err = s.describeInstanceTypes(form)
	case "DescribeSpotPriceHistory":
		s.mu.Lock()
		out, err = s.describeSpotPriceHistory(form)
		s.mu.Unlock()
	default:
		err = &apiError{http.StatusBadRequest, "InvalidAction", fmt.Sprintf("The action %s is not valid for this web service.", action)}
	}
	if err != nil {
		writeError(w, err.status, err.code, err.msg)
		return
	}
	w.Header().Set("Content-Type", "text/xml;charset=UTF-8")
	_, _ = w.Write([]byte(xml.Header))
	_ = xml.NewEncoder(w).Encode(out)
}

// resourceSizes are the resource token buckets of the same page, beside
// the request ones: each instance launched or terminated takes a token,
// however many a request names ("Resource rate limiting": RunInstances'
// holds 1,000 and refills 2 a second, so a request for 100 instances is
// one request token and 100 resource ones).
var resourceSizes = map[string][2]float64{
	"RunInstances":       {1000, 2},
	"TerminateInstances": {1000, 20},
}

// takeResources takes n resource tokens of an action, or says the request
// is throttled as EC2 says it (RequestLimitExceeded). Called with s.mu
// held.
func (s *Server) takeResources(action string, n int) *apiError {
	size, ok := resourceSizes[action]
	if !ok || s.opt.Unthrottled {
		return nil
	}
	b := s.resources[action]
	if b == nil {
		b = rate.NewLimiter(rate.Limit(size[1]), int(size[0]))
		s.resources[action] = b
	}
	if !b.AllowN(time.Now(), n) {
		return &apiError{http.StatusServiceUnavailable, "RequestLimitExceeded", "Request limit exceeded."}
	}
	return nil
}

// bucket is an action's rate limiter. Called with s.mu held.
func (s *Server) bucket(action string) *rate.Limiter {
	size, ok := bucketSizes[action]
	if !ok || s.opt.Unthrottled {
		return nil
	}
	b := s.buckets[action]
	if b == nil {
		b = rate.NewLimiter(rate.Limit(size[1]), int(size[0]))
		s.buckets[action] = b
	}
	return b
}

type apiError struct {
	status    int
	code, msg string
}

func badParam(format string, a ...any) *apiError {
	return &apiError{http.StatusBadRequest, "InvalidParameterValue", fmt.Sprintf(format, a...)}
}

// errorResponse is EC2's error document.
type errorResponse struct {
	XMLName   xml.Name `xml:"Response"`
	Errors    []errXML `xml:"Errors>Error"`
	RequestID string   `xml:"RequestID"`
}

type errXML struct {
	Code    string `xml:"Code"`
	Message string `xml:"Message"`
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "text/xml;charset=UTF-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(xml.Header))
	_ = xml.NewEncoder(w).Encode(errorResponse{Errors: []errXML{{code, msg}}, RequestID: requestID()})
}

func requestID() string {
	b := randHex(16)
	return b[:8] + "-" + b[8:12] + "-" + b[12:16] + "-" + b[16:20] + "-" + b[20:32]
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// list reads a flattened list: prefix.1, prefix.2, ...
func list(form url.Values, prefix string) []string {
	var out []string
	for i := 1; ; i++ {
		v, ok := form[prefix+"."+strconv.Itoa(i)]
		if !ok {
			return out
		}
		out = append(out, v[0])
	}
}

// filter is one Filter.N of a describe.
type filter struct {
	name   string
	values []string
}

func filters(form url.Values) []filter {
	var out []filter
	for i := 1; ; i++ {
		p := "Filter." + strconv.Itoa(i)
		name := form.Get(p + ".Name")
		if name == "" {
			return out
		}
		out = append(out, filter{name, list(form, p+".Value")})
	}
}

// tags reads TagSpecification.N for one resource type.
func tagSpecs(form url.Values, resource string) (map[string]string, *apiError) {
	tags := map[string]string{}
	for i := 1; ; i++ {
		p := "TagSpecification." + strconv.Itoa(i)
		rt := form.Get(p + ".ResourceType")
		if rt == "" {
			return tags, nil
		}
		switch rt {
		case "instance", "volume", "spot-instances-request", "network-interface":
		default:
			return nil, badParam("'%s' is not a valid taggable resource type for this operation.", rt)
		}
		if rt != resource {
			continue
		}
		for j := 1; ; j++ {
			tp := p + ".Tag." + strconv.Itoa(j)
			k, ok := form[tp+".Key"]
			if !ok {
				break
			}
			if strings.HasPrefix(k[0], "aws:") {
				return nil, badParam("Tag keys starting with 'aws:' are reserved for internal use")
			}
			tags[k[0]] = form.Get(tp + ".Value")
		}
	}
}

// describe is what a Describe* call asks for: ids or filters, and a page.
type describe struct {
	ids        []string
	filters    []filter
	start, max int // max 0: every match
}

// describeParams reads a Describe* call's ids (idParam.N), filters (known
// names only) and paging: MaxResults within [lo, hi], not with ids (the
// set named in EC2's refusal), and a NextToken this stand-in gave.
func describeParams(form url.Values, idParam, set string, known *regexp.Regexp, lo, hi int) (describe, *apiError) {
	d := describe{ids: list(form, idParam), filters: filters(form)}
	for _, f := range d.filters {
		if !known.MatchString(f.name) {
			return d, badParam("The filter '%s' is invalid", f.name)
		}
	}
	if v := form.Get("MaxResults"); v != "" {
		if len(d.ids) > 0 {
			return d, &apiError{http.StatusBadRequest, "InvalidParameterCombination", fmt.Sprintf("The parameter %s cannot be used with the parameter maxResults", set)}
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < lo || n > hi {
			return d, badParam("Value ( %s ) for parameter maxResults is invalid. Expecting a value between %d and %d.", v, lo, hi)
		}
		d.max = n
	}
	if tok := form.Get("NextToken"); tok != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(tok, "ec2sim-"))
		if err != nil || !strings.HasPrefix(tok, "ec2sim-") {
			return d, &apiError{http.StatusBadRequest, "InvalidPaginationToken", "The pagination token is invalid."}
		}
		d.start = n
	}
	return d, nil
}

// page is the [from, to) of n matches this call answers with, and the
// token of the next page ("" for none).
func (d describe) page(n int) (from, to int, next string) {
	from, to = min(d.start, n), n
	if d.max > 0 && d.start+d.max < n {
		to = d.start + d.max
		next = "ec2sim-" + strconv.Itoa(to)
	}
	return from, to, next
}

// matchFilters applies describe filters to what have says of each filter
// name: values of one filter are ORed, filters ANDed, * and ? wildcards.
func matchFilters(fs []filter, have func(name string) []string) bool {
	for _, f := range fs {
		if !slices.ContainsFunc(have(f.name), func(h string) bool {
			return slices.ContainsFunc(f.values, func(v string) bool { return wildcard(v, h) })
		}) {
			return false
		}
	}
	return true
}
