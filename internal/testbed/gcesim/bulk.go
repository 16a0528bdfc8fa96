package gcesim

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// bulkInsert is instances.bulkInsert in a zone, as the REST reference
// (compute/docs/reference/rest/v1/instances/bulkInsert) and "About bulk
// creation of VMs" (compute/docs/instances/multiple/about-bulk-creation)
// describe it:
//   - one request however many instances, metered as one insert;
//   - up to 5,000 instances a call; count is the most to make, minCount
//     the fewest (count when not given): when fewer than minCount can be
//     placed none are made and those made are deleted (the rollback),
//     otherwise what could be placed is made and the operation ends
//     without error, its instancesBulkInsertOperationMetadata saying
//     how many (perLocationStatus, keyed zones/<zone>);
//   - the instances are identical but for perInstanceProperties, keyed
//     by the instance's name (a hostname is all a value may hold);
//   - instanceProperties names its machine type by name only: a URL
//     "will result in an INTERNAL_ERROR" (computepb, InstanceProperties);
//     accelerator and disk types are names too, as in a template.
//
// namePattern is not offered here: runfleet names each instance, and a
// request with it is refused, not half-served.
func (s *Server) bulkInsert(r *http.Request) (proto.Message, *apiError) {
	zone := r.PathValue("zone")
	body, _ := io.ReadAll(io.LimitReader(r.Body, 4<<20))
	var req computepb.BulkInsertInstanceResource
	if err := protojson.Unmarshal(body, &req); err != nil {
		return nil, invalid("Invalid JSON payload received. %v", err)
	}
	names, e := bulkNames(&req)
	if e != nil {
		return nil, e
	}
	props := req.GetInstanceProperties()
	if strings.Contains(props.GetMachineType(), "/") {
		return nil, &apiError{http.StatusInternalServerError, "backendError", "Internal error. Please try again or contact Google Support. (INTERNAL_ERROR: instanceProperties.machineType must be a machine type's name)"}
	}
	ins := make([]*computepb.Instance, len(names))
	for i, name := range names {
		ins[i] = fromProperties(props, name, zone)
		if e := s.check(ins[i], zone); e != nil {
			e.message = strings.ReplaceAll(e.message, "'resource.", "'resource.instanceProperties.")
			return nil, e
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	reqID := r.URL.Query().Get("requestId")
	if o, ok := s.requests[reqID]; ok && reqID != "" {
		return o.proto(), nil
	}
	for _, name := range names {
		if _, taken := s.instances[zone+"/"+name]; taken {
			return nil, &apiError{http.StatusConflict, "alreadyExists", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' already exists", Project, zone, name)}
		}
	}
	image, known := s.images[props.GetDisks()[0].GetInitializeParams().GetSourceImage()]
	if !known {
		return nil, notFound(props.GetDisks()[0].GetInitializeParams().GetSourceImage())
	}
	made := make([]*Instance, len(ins))
	for i, in := range ins {
		made[i] = s.newInstance(in, zone)
	}
	o := s.newOp("bulkInsert", zone, s.selfLink("zones", zone, "instances"))
	if reqID != "" {
		s.requests[reqID] = o
	}
	s.wg.Add(1)
	go s.provisionBulk(made, int(req.GetMinCount()), o, image)
	return o.proto(), nil
}

// bulkNames checks count, minCount and the names.
func bulkNames(req *computepb.BulkInsertInstanceResource) ([]string, *apiError) {
	if req.NamePattern != nil {
		return nil, invalid("Invalid value for field 'resource.namePattern': the stand-in names instances by perInstanceProperties only")
	}
	if req.InstanceProperties == nil {
		return nil, invalid("Required field 'resource.instanceProperties' not specified (or sourceInstanceTemplate)")
	}
	names := slices.Sorted(func(yield func(string) bool) {
		for k := range req.GetPerInstanceProperties() {
			if !yield(k) {
				return
			}
		}
	})
	count := req.GetCount()
	if req.MinCount == nil {
		req.MinCount = proto.Int64(count)
	}
	switch {
	case count < 1 || count > 5000:
		return nil, invalid("Invalid value for field 'resource.count': '%d'. Must be between 1 and 5000.", count)
	case req.GetMinCount() < 1 || req.GetMinCount() > count:
		return nil, invalid("Invalid value for field 'resource.minCount': '%d'. Must be between 1 and count.", req.GetMinCount())
	case int64(len(names)) != count:
		return nil, invalid("Invalid value for field 'resource.count': '%d'. perInstanceProperties names %d instances and no namePattern names the rest.", count, len(names))
	}
	for _, n := range names {
		if !nameRE.MatchString(n) {
			return nil, invalid("Invalid value for field 'resource.perInstanceProperties': '%s'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'", n)
		}
	}
	return names, nil
}

// fromProperties is the instance instanceProperties describe, with its
// types made the zone's.
func fromProperties(props *computepb.InstanceProperties, name, zone string) *computepb.Instance {
	p := proto.Clone(props).(*computepb.InstanceProperties)
	in := &computepb.Instance{
		Name: proto.String(name), MachineType: proto.String("zones/" + zone + "/machineTypes/" + p.GetMachineType()),
		Labels: p.Labels, Metadata: p.Metadata, Disks: p.Disks, NetworkInterfaces: p.NetworkInterfaces,
		Scheduling: p.Scheduling, ServiceAccounts: p.ServiceAccounts, Tags: p.Tags, GuestAccelerators: p.GuestAccelerators,
	}
	for _, a := range in.GuestAccelerators {
		if t := a.GetAcceleratorType(); !strings.Contains(t, "/") {
			a.AcceleratorType = proto.String("zones/" + zone + "/acceleratorTypes/" + t)
		}
	}
	for _, d := range in.Disks {
		if t := d.GetInitializeParams().GetDiskType(); t != "" && !strings.Contains(t, "/") {
			d.InitializeParams.DiskType = proto.String("zones/" + zone + "/diskTypes/" + t)
		}
	}
	return in
}

// provisionBulk places a bulk insert's instances: those that fit, when
// at least minCount do; none otherwise.
func (s *Server) provisionBulk(ins []*Instance, minCount int, o *op, image string) {
	defer s.wg.Done()
	time.Sleep(50 * time.Millisecond)
	o.run(s)
	time.Sleep(100 * time.Millisecond)
	s.mu.Lock()
	var placed []*Instance
	var fail *opErr
	for _, in := range ins {
		if e := s.place(in); e != nil {
			fail = e
			s.unmake(in)
			continue
		}
		placed = append(placed, in)
	}
	status := &computepb.BulkInsertOperationStatus{TargetVmCount: proto.Int32(int32(len(ins))), Status: proto.String("DONE")}
	if len(placed) < minCount {
		for _, in := range placed {
			s.release(in)
			s.unmake(in)
		}
		status.DeletedVmCount, status.CreatedVmCount = proto.Int32(int32(len(placed))), proto.Int32(0)
		placed = nil
	} else {
		fail = nil
		status.CreatedVmCount = proto.Int32(int32(len(placed)))
	}
	status.FailedToCreateVmCount = proto.Int32(int32(len(ins) - len(placed)))
	o.bulk = &computepb.InstancesBulkInsertOperationMetadata{PerLocationStatus: map[string]*computepb.BulkInsertOperationStatus{"zones/" + o.zone: status}}
	for _, in := range placed {
		in.setStatus("STAGING")
	}
	s.mu.Unlock()
	o.done(s, fail)
	for _, in := range placed {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.run(in, image)
		}()
	}
}
