package gcesim

import (
	"fmt"
	"maps"
	"net/http"
	"slices"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"
)

// KeepDisk marks an instance's boot disk to be kept when the instance is
// deleted, as instances.setDiskAutoDelete with autoDelete=false does
// (compute/docs/reference/rest/v1/instances/setDiskAutoDelete; a
// person keeping it to look into a failure): deleted, the instance leaves
// it, labelled as it was, with no user.
func (s *Server) KeepDisk(instance string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.disks {
		if d.Instance == instance {
			d.AutoDelete = false
			if in := s.instances[d.Zone+"/"+instance]; in != nil {
				in.res.GetDisks()[0].AutoDelete = proto.Bool(false)
			}
			return nil
		}
	}
	return fmt.Errorf("gcesim: no disk of instance %s", instance)
}

// fields are what a list filter may name of a disk.
func (d *Disk) fields() map[string]string {
	f := map[string]string{"name": d.Name, "zone": d.Zone, "status": "READY"}
	for k, v := range d.Labels {
		f["labels."+k] = v
	}
	return f
}

// proto is the disk as the API returns it. Called with s.mu held.
func (s *Server) diskProto(d *Disk) *computepb.Disk {
	p := &computepb.Disk{Kind: proto.String("compute#disk"), Name: proto.String(d.Name), Zone: proto.String(s.selfLink("zones", d.Zone)),
		SelfLink: proto.String(s.selfLink("zones", d.Zone, "disks", d.Name)), Status: proto.String("READY"), Labels: d.Labels}
	if d.Instance != "" {
		p.Users = []string{s.selfLink("zones", d.Zone, "instances", d.Instance)}
	}
	return p
}

// aggregatedDisks answers disks.aggregatedList: every zone's disks that
// match the filter, in one page (the stand-in's disks are few), and a
// NO_RESULTS_ON_PAGE warning for the zones without any.
func (s *Server) aggregatedDisks(r *http.Request) (proto.Message, *apiError) {
	f, err := parseFilter(r.URL.Query().Get("filter"))
	if err != nil {
		return nil, invalid("Invalid list filter expression '%s'.", r.URL.Query().Get("filter"))
	}
	out := &computepb.DiskAggregatedList{Kind: proto.String("compute#diskAggregatedList"), Id: proto.String("projects/" + Project + "/aggregated/disks"),
		SelfLink: proto.String(s.selfLink("aggregated", "disks")), Items: map[string]*computepb.DisksScopedList{}}
	s.mu.Lock()
	for _, k := range slices.Sorted(maps.Keys(s.disks)) {
		d := s.disks[k]
		if !f.match(d.fields()) {
			continue
		}
		key := "zones/" + d.Zone
		if out.Items[key] == nil {
			out.Items[key] = &computepb.DisksScopedList{}
		}
		out.Items[key].Disks = append(out.Items[key].Disks, s.diskProto(d))
	}
	s.mu.Unlock()
	for _, z := range Zones {
		if key := "zones/" + z; out.Items[key] == nil {
			out.Items[key] = &computepb.DisksScopedList{Warning: noResults(key)}
		}
	}
	return out, nil
}

// deleteDisk answers disks.delete: a disk an instance uses is refused
// with 400 resourceInUseByAnotherResource (the disks.delete reference:
// a disk can be deleted only when no instance has it attached); otherwise
// an operation deletes it.
func (s *Server) deleteDisk(r *http.Request) (proto.Message, *apiError) {
	zone, name := r.PathValue("zone"), r.PathValue("name")
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.requests[r.URL.Query().Get("requestId")]; ok {
		return o.proto(), nil
	}
	d, ok := s.disks[zone+"/"+name]
	if !ok {
		return nil, notFound(fmt.Sprintf("projects/%s/zones/%s/disks/%s", Project, zone, name))
	}
	if _, used := s.instances[zone+"/"+d.Instance]; used && d.Instance != "" {
		return nil, &apiError{http.StatusBadRequest, "resourceInUseByAnotherResource",
			fmt.Sprintf("The disk resource 'projects/%s/zones/%s/disks/%s' is already being used by 'projects/%s/zones/%s/instances/%s'", Project, zone, name, Project, zone, d.Instance)}
	}
	o := s.newOp("delete", zone, s.selfLink("zones", zone, "disks", name))
	if id := r.URL.Query().Get("requestId"); id != "" {
		s.requests[id] = o
	}
	delete(s.disks, zone+"/"+name)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		o.run(s)
		o.done(s, nil)
	}()
	return o.proto(), nil
}

// detachDisk leaves a deleted instance's disk without a user when it is
// not deleted with it. Called with s.mu held.
func (s *Server) detachDisk(in *Instance) {
	if d := s.disks[in.key()]; d != nil && !d.AutoDelete && d.Instance == in.Name {
		d.Instance = ""
	}
}
