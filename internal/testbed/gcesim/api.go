package gcesim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

const base = "/compute/v1/projects/{project}"

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /token", s.token)
	mux.HandleFunc("GET "+CertsPath, s.certs)
	mux.HandleFunc("GET /v1/services/{service}/skus", s.listSKUs)
	route := func(pattern, method string, h func(*http.Request) (proto.Message, *apiError)) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			if !s.authorized(r) {
				(&apiError{http.StatusUnauthorized, "authError", "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential."}).write(w)
				return
			}
			if e := s.admit(method, r); e != nil {
				e.write(w)
				return
			}
			if p := r.PathValue("project"); p != Project {
				notFound("projects/" + p).write(w)
				return
			}
			if z := r.PathValue("zone"); z != "" && !slices.Contains(Zones, z) {
				notFound("projects/" + Project + "/zones/" + z).write(w)
				return
			}
			out, e := h(r)
			if e != nil {
				e.write(w)
				return
			}
			b, _ := protojson.Marshal(out)
			w.Header().Set("Content-Type", "application/json; charset=UTF-8")
			_, _ = w.Write(b)
		})
	}
	route("POST "+base+"/zones/{zone}/instances", "instances.insert", s.insert)
	route("POST "+base+"/zones/{zone}/instances/bulkInsert", "instances.bulkInsert", s.bulkInsert)
	route("GET "+base+"/zones/{zone}/instances", "instances.list", s.list)
	route("GET "+base+"/zones/{zone}/instances/{name}", "instances.get", s.get)
	route("DELETE "+base+"/zones/{zone}/instances/{name}", "instances.delete", s.delete)
	route("GET "+base+"/aggregated/instances", "instances.aggregatedList", s.aggregated)
	route("GET "+base+"/zones/{zone}/operations/{op}", "zoneOperations.get", s.getOp)
	route("POST "+base+"/zones/{zone}/operations/{op}/wait", "zoneOperations.wait", s.waitOp)
	route("GET "+base+"/aggregated/operations", "globalOperations.aggregatedList", s.aggregatedOps)
	route("GET "+base+"/aggregated/disks", "disks.aggregatedList", s.aggregatedDisks)
	route("DELETE "+base+"/zones/{zone}/disks/{name}", "disks.delete", s.deleteDisk)
	route("GET "+base+"/zones/{zone}/machineTypes/{name}", "machineTypes.get", s.machineType)
	return mux
}

var (
	nameRE     = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
	labelKey   = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,62}$`)
	labelValue = regexp.MustCompile(`^[a-z0-9_-]{0,63}$`)
	machineRE  = regexp.MustCompile(`^(?:https://[^/]+/compute/v1/projects/[^/]+/)?zones/([^/]+)/machineTypes/([a-z0-9-]+)$`)
	accelRE    = regexp.MustCompile(`^(?:https://[^/]+/compute/v1/projects/[^/]+/)?zones/([^/]+)/acceleratorTypes/([a-z0-9-]+)$`)
	diskTypeRE = regexp.MustCompile(`^(?:https://[^/]+/compute/v1/projects/[^/]+/)?zones/([^/]+)/diskTypes/([a-z-]+)$`)
)

// selfLink is a resource's URL.
func (s *Server) selfLink(parts ...string) string {
	return s.URL + "/compute/v1/projects/" + Project + "/" + strings.Join(parts, "/")
}

// insert checks an instance as Compute Engine does and starts its
// operation; the placement (capacity, quota) is decided in the
// operation.
func (s *Server) insert(r *http.Request) (proto.Message, *apiError) {
	zone := r.PathValue("zone")
	body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	var in computepb.Instance
	if err := protojson.Unmarshal(body, &in); err != nil {
		return nil, invalid("Invalid JSON payload received. %v", err)
	}
	if e := s.check(&in, zone); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	reqID := r.URL.Query().Get("requestId")
	if o, ok := s.requests[reqID]; ok && reqID != "" {
		return o.proto(), nil // the same request again: the same operation
	}
	if _, taken := s.instances[zone+"/"+in.GetName()]; taken {
		return nil, &apiError{http.StatusConflict, "alreadyExists", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' already exists", Project, zone, in.GetName())}
	}
	image, known := s.images[in.GetDisks()[0].GetInitializeParams().GetSourceImage()]
	if !known {
		return nil, notFound(in.GetDisks()[0].GetInitializeParams().GetSourceImage())
	}
	inst := s.newInstance(&in, zone)
	o := s.newOp("insert", zone, inst.self)
	o.targetID = inst.id
	if reqID != "" {
		s.requests[reqID] = o
	}
	s.wg.Add(1)
	go s.provision(inst, o, image)
	return o.proto(), nil
}

// check validates an instance as the API reference and Compute Engine's
// answers say.
func (s *Server) check(in *computepb.Instance, zone string) *apiError {
	if !nameRE.MatchString(in.GetName()) {
		return invalid("Invalid value for field 'resource.name': '%s'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'", in.GetName())
	}
	m := machineRE.FindStringSubmatch(in.GetMachineType())
	if m == nil {
		return invalid("Invalid value for field 'resource.machineType': '%s'. Must be a URL to a valid Compute resource of the correct type.", in.GetMachineType())
	}
	if m[1] != zone {
		return invalid("Invalid value for field 'resource.machineType': '%s'. Machine type specified '%s' is in a different scope than the instance.", in.GetMachineType(), m[2])
	}
	if !offered(m[2], zone) {
		return invalid("Invalid value for field 'resource.machineType': '%s'. Machine type with name '%s' does not exist in zone '%s'.", in.GetMachineType(), m[2], zone)
	}
	if len(in.GetDisks()) != 1 || !in.GetDisks()[0].GetBoot() || in.GetDisks()[0].GetInitializeParams().GetSourceImage() == "" {
		return invalid("Invalid value for field 'resource.disks': one boot disk with a source image is required here")
	}
	if dt := in.GetDisks()[0].GetInitializeParams().GetDiskType(); dt != "" {
		if d := diskTypeRE.FindStringSubmatch(dt); d == nil || d[1] != zone {
			return invalid("Invalid value for field 'resource.disks[0].initializeParams.diskType': '%s'.", dt)
		}
	}
	if n := len(in.GetLabels()); n > 64 {
		return invalid("Invalid value for field 'resource.labels': %d labels, at most 64", n)
	}
	for k, v := range in.GetLabels() {
		if !labelKey.MatchString(k) || !labelValue.MatchString(v) {
			return invalid("Invalid value for field 'resource.labels': '%s'. Label keys and values must conform to the label format.", k)
		}
	}
	for _, it := range in.GetMetadata().GetItems() {
		if len(it.GetValue()) > 256<<10 {
			return invalid("Invalid value for field 'resource.metadata': metadata value of '%s' exceeds 256 KB", it.GetKey())
		}
	}
	sc := in.GetScheduling()
	terminate := sc.GetOnHostMaintenance() == computepb.Scheduling_TERMINATE.String()
	for _, a := range in.GetGuestAccelerators() {
		if g := accelRE.FindStringSubmatch(a.GetAcceleratorType()); g == nil || g[1] != zone || a.GetAcceleratorCount() < 1 {
			return invalid("Invalid value for field 'resource.guestAccelerators[0].acceleratorType': '%s'.", a.GetAcceleratorType())
		}
		if !terminate {
			return invalid("Instances with guest accelerators do not support live migration.")
		}
	}
	if sc.GetProvisioningModel() == computepb.Scheduling_SPOT.String() && (!terminate || sc.GetAutomaticRestart()) {
		return invalid("Invalid value for field 'resource.scheduling': Spot VMs must have onHostMaintenance TERMINATE and automaticRestart false.")
	}
	if sc.GetMaxRunDuration() != nil && sc.GetInstanceTerminationAction() == "" {
		return invalid("Invalid value for field 'resource.scheduling.instanceTerminationAction': required with maxRunDuration.")
	}
	return nil
}

func (s *Server) get(r *http.Request) (proto.Message, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	in, ok := s.instances[r.PathValue("zone")+"/"+r.PathValue("name")]
	if !ok {
		return nil, notFound(fmt.Sprintf("projects/%s/zones/%s/instances/%s", Project, r.PathValue("zone"), r.PathValue("name")))
	}
	return in.proto(), nil
}

func (s *Server) delete(r *http.Request) (proto.Message, *apiError) {
	zone, name := r.PathValue("zone"), r.PathValue("name")
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.requests[r.URL.Query().Get("requestId")]; ok {
		return o.proto(), nil
	}
	in, ok := s.instances[zone+"/"+name]
	if !ok {
		return nil, notFound(fmt.Sprintf("projects/%s/zones/%s/instances/%s", Project, zone, name))
	}
	o := s.newOp("delete", zone, in.self)
	if id := r.URL.Query().Get("requestId"); id != "" {
		s.requests[id] = o
	}
	in.setStatus("STOPPING")
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		o.run(s)
		s.end(in, true)
		o.done(s, nil)
	}()
	return o.proto(), nil
}

// listed is one page of instances, filtered.
func (s *Server) listed(r *http.Request, zone string) ([]*Instance, string, *apiError) {
	q := r.URL.Query()
	f, err := parseFilter(q.Get("filter"))
	if err != nil {
		return nil, "", invalid("Invalid list filter expression '%s'.", q.Get("filter"))
	}
	max := 500
	if v := q.Get("maxResults"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > 500 {
			return nil, "", invalid("Invalid value for field 'maxResults': '%s'. Must be less than or equal to 500", v)
		}
		if n > 0 {
			max = n
		}
	}
	start := 0
	if tok := q.Get("pageToken"); tok != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(tok, "p"))
		if err != nil || !strings.HasPrefix(tok, "p") {
			return nil, "", invalid("Invalid value for field 'pageToken': '%s'.", tok)
		}
		start = n
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var all []*Instance
	for _, in := range s.order {
		if _, live := s.instances[in.key()]; live && (zone == "" || in.Zone == zone) && f.match(in.fields()) {
			all = append(all, in)
		}
	}
	if start > len(all) {
		start = len(all)
	}
	end := min(start+max, len(all))
	next := ""
	if end < len(all) {
		next = "p" + strconv.Itoa(end)
	}
	return all[start:end], next, nil
}

func (s *Server) list(r *http.Request) (proto.Message, *apiError) {
	page, next, e := s.listed(r, r.PathValue("zone"))
	if e != nil {
		return nil, e
	}
	out := &computepb.InstanceList{Kind: proto.String("compute#instanceList"), Id: proto.String("projects/" + Project + "/zones/" + r.PathValue("zone") + "/instances"),
		SelfLink: proto.String(s.selfLink("zones", r.PathValue("zone"), "instances"))}
	s.mu.Lock()
	for _, in := range page {
		out.Items = append(out.Items, in.proto())
	}
	s.mu.Unlock()
	if next != "" {
		out.NextPageToken = proto.String(next)
	}
	return out, nil
}

// aggregated lists every zone's instances: each zone of the page, and a
// NO_RESULTS_ON_PAGE warning for the zones without any.
func (s *Server) aggregated(r *http.Request) (proto.Message, *apiError) {
	page, next, e := s.listed(r, "")
	if e != nil {
		return nil, e
	}
	out := &computepb.InstanceAggregatedList{Kind: proto.String("compute#instanceAggregatedList"), Id: proto.String("projects/" + Project + "/aggregated/instances"),
		SelfLink: proto.String(s.selfLink("aggregated", "instances")), Items: map[string]*computepb.InstancesScopedList{}}
	s.mu.Lock()
	for _, in := range page {
		key := "zones/" + in.Zone
		if out.Items[key] == nil {
			out.Items[key] = &computepb.InstancesScopedList{}
		}
		out.Items[key].Instances = append(out.Items[key].Instances, in.proto())
	}
	s.mu.Unlock()
	for _, z := range Zones {
		if key := "zones/" + z; out.Items[key] == nil {
			out.Items[key] = &computepb.InstancesScopedList{Warning: noResults(key)}
		}
	}
	if next != "" {
		out.NextPageToken = proto.String(next)
	}
	return out, nil
}

func noResults(scope string) *computepb.Warning {
	return &computepb.Warning{Code: proto.String("NO_RESULTS_ON_PAGE"), Message: proto.String("There are no results for scope '" + scope + "' on this page."),
		Data: []*computepb.Data{{Key: proto.String("scope"), Value: proto.String(scope)}}}
}

func (s *Server) getOp(r *http.Request) (proto.Message, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.ops[r.PathValue("op")]
	if !ok || o.zone != r.PathValue("zone") {
		return nil, notFound(fmt.Sprintf("projects/%s/zones/%s/operations/%s", Project, r.PathValue("zone"), r.PathValue("op")))
	}
	return o.proto(), nil
}

// waitOp answers once the operation is done, or after WaitMax, done or
// not, as zoneOperations.wait does.
func (s *Server) waitOp(r *http.Request) (proto.Message, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.ops[r.PathValue("op")]
	if !ok || o.zone != r.PathValue("zone") {
		return nil, notFound(fmt.Sprintf("projects/%s/zones/%s/operations/%s", Project, r.PathValue("zone"), r.PathValue("op")))
	}
	deadline := time.Now().Add(s.opt.WaitMax)
	stop := time.AfterFunc(s.opt.WaitMax, func() { s.mu.Lock(); s.changed.Broadcast(); s.mu.Unlock() })
	defer stop.Stop()
	ctx := r.Context()
	defer context.AfterFunc(ctx, func() { s.mu.Lock(); s.changed.Broadcast(); s.mu.Unlock() })()
	for o.status != "DONE" && time.Now().Before(deadline) && ctx.Err() == nil && !s.closing {
		s.changed.Wait()
	}
	return o.proto(), nil
}

// aggregatedOps lists the operations of every zone matching the filter.
func (s *Server) aggregatedOps(r *http.Request) (proto.Message, *apiError) {
	f, err := parseFilter(r.URL.Query().Get("filter"))
	if err != nil {
		return nil, invalid("Invalid list filter expression '%s'.", r.URL.Query().Get("filter"))
	}
	out := &computepb.OperationAggregatedList{Kind: proto.String("compute#operationAggregatedList"), Id: proto.String("projects/" + Project + "/aggregated/operations"),
		SelfLink: proto.String(s.selfLink("aggregated", "operations")), Items: map[string]*computepb.OperationsScopedList{}}
	s.mu.Lock()
	for _, o := range s.opOrder {
		if !f.match(map[string]string{"operationType": o.typ, "status": o.status, "targetLink": o.target, "name": o.name}) {
			continue
		}
		key := "zones/" + o.zone
		if out.Items[key] == nil {
			out.Items[key] = &computepb.OperationsScopedList{}
		}
		out.Items[key].Operations = append(out.Items[key].Operations, o.proto())
	}
	s.mu.Unlock()
	for _, z := range Zones {
		if key := "zones/" + z; out.Items[key] == nil {
			out.Items[key] = &computepb.OperationsScopedList{Warning: noResults(key)}
		}
	}
	return out, nil
}

// filter is a list filter of the forms Compute Engine documents:
// `field = value` or `field != value`, the value quoted or not, joined by
// AND or written side by side in parentheses.
type filter []cond

type cond struct {
	field, value string
	not          bool
}

var condRE = regexp.MustCompile(`^\(?\s*([a-zA-Z][a-zA-Z0-9_.-]*)\s*(=|!=)\s*("(?:[^"\\]|\\.)*"|[^\s()"]+)\s*\)?$`)

func parseFilter(s string) (filter, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	var parts []string
	if strings.Contains(s, " AND ") {
		parts = strings.Split(s, " AND ")
	} else {
		parts = regexp.MustCompile(`\)\s+\(`).Split(s, -1)
		for i := range parts {
			if i > 0 {
				parts[i] = "(" + parts[i]
			}
			if i < len(parts)-1 {
				parts[i] += ")"
			}
		}
	}
	var f filter
	for _, p := range parts {
		m := condRE.FindStringSubmatch(strings.TrimSpace(p))
		if m == nil {
			return nil, fmt.Errorf("bad filter %q", p)
		}
		v := m[3]
		if strings.HasPrefix(v, `"`) {
			if err := json.Unmarshal([]byte(v), &v); err != nil {
				return nil, err
			}
		}
		f = append(f, cond{field: m[1], value: v, not: m[2] == "!="})
	}
	return f, nil
}

func (f filter) match(fields map[string]string) bool {
	for _, c := range f {
		v, ok := fields[c.field]
		if (ok && v == c.value) == c.not {
			return false
		}
	}
	return true
}

// Instances returns copies of every instance ever inserted, in order,
// deleted ones included (Deleted set).
func (s *Server) Instances() []Instance {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Instance, 0, len(s.order))
	for _, in := range s.order {
		c := *in
		c.machine, c.res = nil, proto.Clone(in.res).(*computepb.Instance)
		out = append(out, c)
	}
	return out
}

// Disks returns the disks that exist.
func (s *Server) Disks() []Disk {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Disk, 0, len(s.disks))
	for _, d := range s.disks {
		out = append(out, *d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
