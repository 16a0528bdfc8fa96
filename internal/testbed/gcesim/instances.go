package gcesim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	"github.com/runfleet/runfleet/internal/testbed/vmboot"
)

// Instance is one stand-in instance.
type Instance struct {
	Name, Zone, Type, Model string // Model: SPOT or STANDARD
	// SourceImage is its boot disk's, as the insert named it (an image
	// family's newest, for a family).
	SourceImage              string
	Status                   string
	Labels, Metadata         map[string]string
	Accelerators             int
	Created, Stopping, Ended time.Time
	// Deleted is when it was deleted (by a call, a preemption, its
	// maxRunDuration); Preempted whether it was preempted.
	Deleted   time.Time
	Preempted bool
	// Console is what the instance printed, kept when it ends.
	Console string

	self      string
	id        uint64
	res       *computepb.Instance
	machine   *vmboot.Machine
	finishing bool
}

// Disk is a boot disk.
type Disk struct {
	Name, Zone, Instance string
	Labels               map[string]string
	AutoDelete           bool
}

func (in *Instance) key() string { return in.Zone + "/" + in.Name }

var nextID atomic.Uint64

// newInstance records an instance and its boot disk. Called with s.mu
// held.
func (s *Server) newInstance(res *computepb.Instance, zone string) *Instance {
	m := machineRE.FindStringSubmatch(res.GetMachineType())
	in := &Instance{Name: res.GetName(), SourceImage: res.GetDisks()[0].GetInitializeParams().GetSourceImage(), Zone: zone, Type: m[2], Model: res.GetScheduling().GetProvisioningModel(),
		Labels: res.GetLabels(), Metadata: map[string]string{}, Created: time.Now(), res: res,
		self: s.selfLink("zones", zone, "instances", res.GetName()), id: 1e18 + nextID.Add(1)}
	if in.Model == "" {
		in.Model = "STANDARD"
	}
	for _, a := range res.GetGuestAccelerators() {
		in.Accelerators += int(a.GetAcceleratorCount())
	}
	for _, it := range res.GetMetadata().GetItems() {
		in.Metadata[it.GetKey()] = it.GetValue()
	}
	res.Id = proto.Uint64(in.id)
	res.Zone = proto.String(s.selfLink("zones", zone))
	res.SelfLink = proto.String(in.self)
	res.CreationTimestamp = proto.String(in.Created.Format(time.RFC3339))
	res.Kind = proto.String("compute#instance")
	d := res.GetDisks()[0]
	d.Source = proto.String(s.selfLink("zones", zone, "disks", in.Name))
	d.DeviceName = proto.String(in.Name)
	d.Type = proto.String("PERSISTENT")
	s.disks[zone+"/"+in.Name] = &Disk{Name: in.Name, Zone: zone, Instance: in.Name, Labels: d.GetInitializeParams().GetLabels(), AutoDelete: d.GetAutoDelete()}
	for i, nic := range res.GetNetworkInterfaces() {
		nic.Name = proto.String("nic" + strconv.Itoa(i))
		nic.NetworkIP = proto.String(fmt.Sprintf("10.128.%d.%d", in.id%250, i+2))
	}
	s.instances[in.key()] = in
	s.order = append(s.order, in)
	in.setStatus("PROVISIONING")
	return in
}

// setStatus changes the status. Called with s.mu held.
func (in *Instance) setStatus(status string) {
	if in.Status == "TERMINATED" && status == "STOPPING" {
		return
	}
	in.Status = status
	in.res.Status = proto.String(status)
	if status == "STOPPING" && in.Stopping.IsZero() {
		in.Stopping = time.Now()
	}
}

// proto is the instance as the API returns it. Called with s.mu held.
func (in *Instance) proto() *computepb.Instance { return proto.Clone(in.res).(*computepb.Instance) }

// fields are what a filter may name. Called with s.mu held.
func (in *Instance) fields() map[string]string {
	f := map[string]string{"name": in.Name, "status": in.Status, "zone": in.Zone}
	for k, v := range in.Labels {
		f["labels."+k] = v
	}
	return f
}

// op is a zone operation.
type op struct {
	name, typ, zone, target, status, message string
	id                                       uint64
	insert, start, end                       time.Time
	targetID                                 uint64 // the instance's id, as an insert's operation names it
	errCodes, errMsgs                        []string
	httpStatus                               int
	bulk                                     *computepb.InstancesBulkInsertOperationMetadata // a bulk insert's, once done
}

// newOp starts an operation. Called with s.mu held.
func (s *Server) newOp(typ, zone, target string) *op {
	o := &op{name: "operation-" + strconv.FormatInt(time.Now().UnixMilli(), 10) + "-" + randHex(6), typ: typ, zone: zone,
		target: target, status: "PENDING", id: 2e18 + nextID.Add(1), insert: time.Now()}
	s.ops[o.name] = o
	s.opOrder = append(s.opOrder, o)
	return o
}

func (o *op) run(s *Server) {
	s.mu.Lock()
	o.status, o.start = "RUNNING", time.Now()
	s.changed.Broadcast()
	s.mu.Unlock()
}

// done ends the operation, in error when code is given.
func (o *op) done(s *Server, e *opErr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o.status, o.end = "DONE", time.Now()
	if e != nil {
		o.errCodes, o.errMsgs, o.httpStatus = []string{e.code}, []string{e.msg}, e.status
	}
	s.changed.Broadcast()
}

type opErr struct {
	code, msg string
	status    int
}

// proto is the operation as the API returns it. Called with s.mu held.
func (o *op) proto() *computepb.Operation {
	p := &computepb.Operation{Kind: proto.String("compute#operation"), Id: proto.Uint64(o.id), Name: proto.String(o.name),
		OperationType: proto.String(o.typ), TargetLink: proto.String(o.target), Status: computepb.Operation_Status(computepb.Operation_Status_value[o.status]).Enum(),
		InsertTime: proto.String(o.insert.Format(time.RFC3339)), Zone: proto.String(zoneLink(o.target)), Progress: proto.Int32(0),
		SelfLink: proto.String(zoneLink(o.target) + "/operations/" + o.name)}
	if o.targetID != 0 {
		p.TargetId = proto.Uint64(o.targetID)
	}
	if o.message != "" {
		p.StatusMessage = proto.String(o.message)
	}
	if !o.start.IsZero() {
		p.StartTime = proto.String(o.start.Format(time.RFC3339))
	}
	if o.status == "DONE" {
		p.Progress, p.EndTime = proto.Int32(100), proto.String(o.end.Format(time.RFC3339))
	}
	if o.bulk != nil {
		p.InstancesBulkInsertOperationMetadata = proto.Clone(o.bulk).(*computepb.InstancesBulkInsertOperationMetadata)
	}
	if len(o.errCodes) > 0 {
		p.Error = &computepb.Error{}
		for i, c := range o.errCodes {
			p.Error.Errors = append(p.Error.Errors, &computepb.Errors{Code: proto.String(c), Message: proto.String(o.errMsgs[i])})
		}
		p.HttpErrorStatusCode = proto.Int32(int32(o.httpStatus))
		p.HttpErrorMessage = proto.String(http.StatusText(o.httpStatus))
	}
	return p
}

func zoneLink(target string) string {
	for _, kind := range []string{"/instances/", "/disks/"} {
		if i := strings.Index(target, kind); i >= 0 {
			return target[:i]
		}
	}
	return target
}

// provision places an instance: capacity and quota are decided here,
// and a placed instance boots.
func (s *Server) provision(in *Instance, o *op, image string) {
	defer s.wg.Done()
	time.Sleep(50 * time.Millisecond)
	o.run(s)
	time.Sleep(100 * time.Millisecond)
	s.mu.Lock()
	fail := s.place(in)
	if fail != nil {
		s.unmake(in)
		s.mu.Unlock()
		o.done(s, fail)
		return
	}
	in.setStatus("STAGING")
	s.mu.Unlock()
	o.done(s, nil)
	s.run(in, image)
}

// run starts a placed instance: its maxRunDuration, then its machine.
func (s *Server) run(in *Instance, image string) {
	if d := in.res.GetScheduling().GetMaxRunDuration(); d != nil {
		time.AfterFunc(time.Duration(d.GetSeconds())*time.Second, func() { s.terminationAction(in) })
	}
	s.boot(in, image)
}

// place decides whether an instance can be placed, and takes its room
// when LimitCapacity counts it. Called with s.mu held.
func (s *Server) place(in *Instance) *opErr {
	if s.noQuota[region(in.Zone)] {
		return &opErr{"QUOTA_EXCEEDED", fmt.Sprintf("Quota 'CPUS' exceeded.  Limit: 24.0 in region %s.", region(in.Zone)), http.StatusForbidden}
	}
	keys := in.capacityKeys()
	for _, k := range keys {
		if n, counted := s.room[k]; s.noCap[k] || counted && n == 0 {
			return &opErr{"ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", fmt.Sprintf("The zone 'projects/%s/zones/%s' does not have enough resources available to fulfill the request.  '(resource type:compute)'.", Project, in.Zone), http.StatusServiceUnavailable}
		}
	}
	for _, k := range keys {
		if n, counted := s.room[k]; counted {
			s.room[k] = n - 1
		}
	}
	return nil
}

// capacityKeys are the keys of NoCapacity and LimitCapacity an instance
// meets.
func (in *Instance) capacityKeys() []string {
	return []string{in.Model + "  ", in.Model + " " + in.Type + " ", in.Model + "  " + in.Zone, in.Model + " " + in.Type + " " + in.Zone, "  " + in.Zone}
}

// release gives back the room a placed instance took, when a bulk
// insert's rollback deletes it. Called with s.mu held.
func (s *Server) release(in *Instance) {
	for _, k := range in.capacityKeys() {
		if n, counted := s.room[k]; counted {
			s.room[k] = n + 1
		}
	}
}

// unmake removes an instance that was not placed. Called with s.mu
// held.
func (s *Server) unmake(in *Instance) {
	delete(s.instances, in.key())
	delete(s.disks, in.key())
	in.Deleted = time.Now()
}

// boot runs the instance: a container with its startup-script and a
// metadata server, or, without an image, nothing but the state.
func (s *Server) boot(in *Instance, image string) {
	if s.opt.Docker == nil || image == "" {
		time.Sleep(200 * time.Millisecond)
		s.mu.Lock()
		if in.Status == "STAGING" {
			in.setStatus("RUNNING")
		}
		s.mu.Unlock()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m, err := vmboot.Create(ctx, vmboot.Options{
		Docker: s.opt.Docker, HostAddr: s.opt.HostAddr, Name: "gcesim-" + in.Zone + "-" + in.Name, Image: image, Hostname: in.Name,
		Labels: map[string]string{"gcesim.instance": in.self}, Script: []byte(in.Metadata["startup-script"]),
		Metadata: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.metadata(in, w, r) }),
		Env:      func(hostPort string) []string { return []string{"GCE_METADATA_HOST=" + hostPort} },
	})
	if err != nil {
		s.opt.Logger.Error("gcesim: instance did not boot", "instance", in.Name, "err", err)
		s.stopped(in, "")
		return
	}
	s.mu.Lock()
	in.machine = m
	stopping := in.Status != "STAGING"
	s.mu.Unlock()
	if !stopping {
		if err := m.Start(ctx); err != nil {
			s.opt.Logger.Error("gcesim: instance did not start", "instance", in.Name, "err", err)
		}
		s.mu.Lock()
		if in.Status == "STAGING" {
			in.setStatus("RUNNING")
		}
		s.mu.Unlock()
	}
	m.Wait()
	s.stopped(in, m.Finish())
}

// stopped records that an instance's machine is off: a guest power-off
// leaves it TERMINATED (stopped, its disk kept), as on Compute Engine.
func (s *Server) stopped(in *Instance, console string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	in.Console, in.machine = console, nil
	in.Ended = time.Now()
	in.setStatus("TERMINATED")
	in.res.LastStopTimestamp = proto.String(in.Ended.Format(time.RFC3339))
	s.changed.Broadcast()
}

// end stops an instance's machine and, when deleted, removes it and its
// auto-delete disks.
func (s *Server) end(in *Instance, deleted bool) {
	s.mu.Lock()
	m := in.machine
	if in.Status != "TERMINATED" {
		in.setStatus("STOPPING")
	}
	s.mu.Unlock()
	if m != nil {
		m.Stop()
	}
	for start := time.Now(); time.Since(start) < time.Minute; time.Sleep(20 * time.Millisecond) {
		s.mu.Lock()
		off := in.machine == nil && in.Status != "STAGING" && in.Status != "PROVISIONING" || s.opt.Docker == nil
		s.mu.Unlock()
		if off {
			break
		}
	}
	if !deleted {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.instances[in.key()]; ok {
		delete(s.instances, in.key())
		in.Deleted = time.Now()
		if d := s.disks[in.key()]; d != nil && d.AutoDelete {
			delete(s.disks, in.key())
		}
		s.detachDisk(in)
	}
}

// terminationAction applies an instance's instanceTerminationAction
// (at its maxRunDuration, or after a preemption).
func (s *Server) terminationAction(in *Instance) {
	s.mu.Lock()
	_, live := s.instances[in.key()]
	live = live && !s.closing
	action := in.res.GetScheduling().GetInstanceTerminationAction()
	s.mu.Unlock()
	if live {
		s.end(in, action == computepb.Scheduling_DELETE.String())
	}
}

// Preempt takes a Spot instance back as Compute Engine does: its
// metadata server says preempted, a compute.instances.preempted
// operation is recorded, the instance is STOPPING, and after (30 s on
// Compute Engine) it is stopped and its termination action applied.
func (s *Server) Preempt(name string, after time.Duration) error {
	s.mu.Lock()
	var in *Instance
	for _, i := range s.instances {
		if i.Name == name {
			in = i
		}
	}
	if in == nil || in.Model != "SPOT" || in.Status != "RUNNING" {
		s.mu.Unlock()
		return fmt.Errorf("gcesim: %s is not a running Spot instance", name)
	}
	in.Preempted = true
	o := s.newOp("compute.instances.preempted", in.Zone, in.self)
	o.status, o.start, o.end, o.message = "DONE", o.insert, o.insert, "Instance was preempted."
	in.setStatus("STOPPING")
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		time.Sleep(after)
		s.terminationAction(in)
	}()
	return nil
}

// metadata answers the instance's metadata server: every request needs
// Metadata-Flavor: Google (403 otherwise), and every answer carries it.
func (s *Server) metadata(in *Instance, w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Metadata-Flavor", "Google")
	if r.Header.Get("Metadata-Flavor") != "Google" {
		http.Error(w, "Missing Metadata-Flavor:Google header.", http.StatusForbidden)
		return
	}
	p, ok := strings.CutPrefix(r.URL.Path, "/computeMetadata/v1/")
	if !ok || r.Method != http.MethodGet {
		http.NotFound(w, r)
		return
	}
	if p == "instance/service-accounts/default/identity" {
		s.identity(in, w, r)
		return
	}
	s.mu.Lock()
	v, found := in.metadataPath(p)
	s.mu.Unlock()
	if !found {
		http.NotFound(w, r)
		return
	}
	if q := r.URL.Query(); q.Get("wait_for_change") == "true" {
		v, found = s.waitForChange(r.Context(), in, p, v, q.Get("last_etag"), q.Get("timeout_sec"))
		if !found {
			http.NotFound(w, r)
			return
		}
	}
	w.Header().Set("ETag", etag(v))
	w.Header().Set("Content-Type", "application/text")
	_, _ = io.WriteString(w, v)
}

// waitForChange holds a request until the value's ETag is not lastETag,
// or for timeout_sec, or until the client goes, and returns the value
// then, as the metadata server answers wait_for_change=true: at once when
// last_etag is already stale; a request without it waits for the next
// change (https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange;
// instance/preempted is watched so, .../instances/spot#detect-preemption).
func (s *Server) waitForChange(ctx context.Context, in *Instance, p, v, lastETag, timeoutSec string) (string, bool) {
	if lastETag == "" {
		lastETag = etag(v)
	}
	if n, err := strconv.Atoi(timeoutSec); err == nil && n > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(n)*time.Second)
		defer cancel()
	}
	for etag(v) == lastETag {
		select {
		case <-ctx.Done():
			return v, true
		case <-time.After(100 * time.Millisecond):
		}
		s.mu.Lock()
		nv, found := in.metadataPath(p)
		s.mu.Unlock()
		if !found {
			return "", false
		}
		v = nv
	}
	return v, true
}

// etag is a value's ETag: opaque, and changed with the value.
func etag(v string) string {
	h := sha256.Sum256([]byte(v))
	return hex.EncodeToString(h[:8])
}

// metadataPath answers one path. Called with s.mu held.
func (in *Instance) metadataPath(p string) (string, bool) {
	switch p {
	case "instance/preempted":
		if in.Preempted {
			return "TRUE", true
		}
		return "FALSE", true
	case "instance/maintenance-event":
		return "NONE", true
	case "instance/name", "instance/hostname":
		return in.Name, true
	case "instance/id":
		return strconv.FormatUint(in.id, 10), true
	case "instance/zone":
		return "projects/424242424242/zones/" + in.Zone, true
	case "instance/machine-type":
		return "projects/424242424242/machineTypes/" + in.Type, true
	case "instance/scheduling/provisioning-model":
		return in.Model, true
	case "project/project-id":
		return Project, true
	}
	if key, ok := strings.CutPrefix(p, "instance/attributes/"); ok {
		v, found := in.Metadata[key]
		return v, found
	}
	return "", false
}

// MetadataHandler is the metadata server that instance name's machine
// reaches, for a test that plays the machine on this host; nil when there
// is no such instance.
func (s *Server) MetadataHandler(name string) http.Handler {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, in := range s.instances {
		if in.Name == name {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.metadata(in, w, r) })
		}
	}
	return nil
}
