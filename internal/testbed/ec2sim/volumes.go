package ec2sim

import (
	"cmp"
	"encoding/xml"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Volume is one EBS volume of the stand-in: made at launch from the AMI's
// block device mapping and the request's, attached to its instance, and,
// when the instance is terminated, deleted with it or left "available"
// (EBS User Guide, "Preserve data when an instance is terminated":
// DeleteOnTermination decides, per volume).
type Volume struct {
	ID, Zone, Type string
	State          string // in-use, available
	SizeGB         int
	Tags           map[string]string
	// Instance and Device are its attachment ("" once detached).
	Instance, Device    string
	DeleteOnTermination bool
	Created             time.Time
}

// BlockDevice is one EBS volume in an AMI's block device mapping.
type BlockDevice struct {
	Device              string
	SizeGB              int
	Type                string // gp3 when empty
	DeleteOnTermination bool
}

// rootDevice is an AMI's mapping unless SetImageDevices gave one: an 8 GiB
// root volume at /dev/sda1 deleted with its instance, as Canonical's
// Ubuntu AMIs map theirs.
var rootDevice = []BlockDevice{{Device: "/dev/sda1", SizeGB: 8, DeleteOnTermination: true}}

// SetImageDevices gives an AMI its block device mapping: a custom image
// may map a data volume that outlives its instance (DeleteOnTermination
// false).
func (s *Server) SetImageDevices(ami string, devs ...BlockDevice) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.devices[ami] = slices.Clone(devs)
}

// Volumes lists the volumes not deleted, oldest first.
func (s *Server) Volumes() []Volume {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Volume, 0, len(s.volumes))
	for _, v := range s.volumes {
		c := *v
		c.Tags = maps.Clone(v.Tags)
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Volume) int { return a.Created.Compare(b.Created) })
	return out
}

// mapping is a launch's volumes: the AMI's devices, each as the request's
// BlockDeviceMapping.N for the same device changes it, then the request's
// other devices. A request's volume says nothing of DeleteOnTermination
// takes the AMI's for its device, else false, as a volume attached to a
// running instance (RunInstances, BlockDeviceMapping; EbsBlockDevice,
// DeleteOnTermination). NoDevice drops the AMI's device. Called with s.mu
// held.
func (s *Server) mapping(form url.Values, ami string) ([]BlockDevice, *apiError) {
	devs, ok := s.devices[ami]
	if !ok {
		devs = rootDevice
	}
	devs = slices.Clone(devs)
	for i := 1; ; i++ {
		p := "BlockDeviceMapping." + strconv.Itoa(i)
		name := form.Get(p + ".DeviceName")
		if name == "" {
			if form.Has(p+".Ebs.VolumeSize") || form.Has(p+".NoDevice") {
				return nil, &apiError{http.StatusBadRequest, "InvalidBlockDeviceMapping", "The device name must be given for each block device mapping."}
			}
			return devs, nil
		}
		j := slices.IndexFunc(devs, func(d BlockDevice) bool { return d.Device == name })
		if form.Has(p + ".NoDevice") {
			if j >= 0 {
				devs = slices.Delete(devs, j, j+1)
			}
			continue
		}
		d := BlockDevice{Device: name}
		if j >= 0 {
			d = devs[j]
		}
		if v := form.Get(p + ".Ebs.VolumeSize"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 16384 {
				return nil, badParam("Invalid value '%s' for volume size.", v)
			}
			if j >= 0 && n < devs[j].SizeGB {
				return nil, &apiError{http.StatusBadRequest, "InvalidBlockDeviceMapping",
					fmt.Sprintf("Volume of size %dGB is smaller than snapshot, expect size >= %dGB", n, devs[j].SizeGB)}
			}
			d.SizeGB = n
		}
		if v := form.Get(p + ".Ebs.VolumeType"); v != "" {
			d.Type = v
		}
		if v := form.Get(p + ".Ebs.DeleteOnTermination"); v != "" {
			d.DeleteOnTermination = v == "true"
		}
		if d.SizeGB == 0 {
			return nil, &apiError{http.StatusBadRequest, "InvalidBlockDeviceMapping", fmt.Sprintf("The volume for device %s needs a size.", name)}
		}
		if j >= 0 {
			devs[j] = d
		} else {
			devs = append(devs, d)
		}
	}
}

// attachVolumes makes an instance's volumes, in use by it. Called with
// s.mu held.
func (s *Server) attachVolumes(in *Instance, devs []BlockDevice, tags map[string]string) {
	for _, d := range devs {
		v := &Volume{ID: "vol-" + randHex(9)[:17], Zone: in.Zone, Type: cmp.Or(d.Type, "gp3"), State: "in-use", SizeGB: d.SizeGB, Tags: maps.Clone(tags),
			Instance: in.ID, Device: d.Device, DeleteOnTermination: d.DeleteOnTermination, Created: time.Now()}
		s.volumes[v.ID] = v
	}
}

// releaseVolumes deletes a terminated instance's volumes marked so, and
// leaves the others available. Called with s.mu held.
func (s *Server) releaseVolumes(id string) {
	for vid, v := range s.volumes {
		switch {
		case v.Instance != id:
		case v.DeleteOnTermination:
			delete(s.volumes, vid)
		default:
			v.State, v.Instance, v.Device = "available", "", ""
		}
	}
}

// volumeFilters are the filters of DescribeVolumes the stand-in knows
// (EC2 API reference, DescribeVolumes).
var volumeFilters = regexp.MustCompile(`^(tag:.+|tag-key|status|attachment\.instance-id|attachment\.delete-on-termination|availability-zone|volume-type|volume-id)$`)

var volumeID = regexp.MustCompile(`^vol-[0-9a-f]{8,17}$`)

// describeVolumes answers DescribeVolumes: by VolumeId.N or by filters,
// in pages of MaxResults (5 to 500; not with VolumeId).
func (s *Server) describeVolumes(form url.Values) (any, *apiError) {
	d, aerr := describeParams(form, "VolumeId", "volumeSet", volumeFilters, 5, 500)
	if aerr != nil {
		return nil, aerr
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range d.ids {
		if _, ok := s.volumes[id]; !ok {
			return nil, &apiError{http.StatusBadRequest, "InvalidVolume.NotFound", fmt.Sprintf("The volume '%s' does not exist.", id)}
		}
	}
	var match []*Volume
	for _, v := range s.volumes {
		if (len(d.ids) == 0 || slices.Contains(d.ids, v.ID)) && matchFilters(d.filters, v.filterValues) {
			match = append(match, v)
		}
	}
	slices.SortFunc(match, func(a, b *Volume) int { return a.Created.Compare(b.Created) })
	resp := volumesResponse{RequestID: requestID()}
	from, to, next := d.page(len(match))
	resp.NextToken = next
	for _, v := range match[from:to] {
		resp.Volumes = append(resp.Volumes, v.xml())
	}
	return resp, nil
}

// filterValues is what the volume says of a filter name.
func (v *Volume) filterValues(name string) []string {
	switch {
	case strings.HasPrefix(name, "tag:"):
		if t, ok := v.Tags[name[4:]]; ok {
			return []string{t}
		}
	case name == "tag-key":
		return slices.Collect(maps.Keys(v.Tags))
	case name == "status":
		return []string{v.State}
	case name == "attachment.instance-id":
		return []string{v.Instance}
	case name == "attachment.delete-on-termination":
		return []string{strconv.FormatBool(v.DeleteOnTermination)}
	case name == "availability-zone":
		return []string{v.Zone}
	case name == "volume-type":
		return []string{v.Type}
	case name == "volume-id":
		return []string{v.ID}
	}
	return nil
}

// deleteVolume answers DeleteVolume: a volume attached to an instance is
// refused (VolumeInUse), one unknown is InvalidVolume.NotFound (EC2 API
// reference, DeleteVolume; "Error codes for the Amazon EC2 API").
func (s *Server) deleteVolume(form url.Values) (any, *apiError) {
	id := form.Get("VolumeId")
	switch {
	case id == "":
		return nil, &apiError{http.StatusBadRequest, "MissingParameter", "The request must contain the parameter VolumeId"}
	case !volumeID.MatchString(id):
		return nil, &apiError{http.StatusBadRequest, "InvalidVolumeID.Malformed", fmt.Sprintf("Invalid id: \"%s\"", id)}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.volumes[id]
	switch {
	case !ok:
		return nil, &apiError{http.StatusBadRequest, "InvalidVolume.NotFound", fmt.Sprintf("The volume '%s' does not exist.", id)}
	case v.State == "in-use":
		return nil, &apiError{http.StatusBadRequest, "VolumeInUse", fmt.Sprintf("Volume %s is currently attached to %s", id, v.Instance)}
	}
	delete(s.volumes, id)
	return simpleResponse{XMLName: xml.Name{Local: "DeleteVolumeResponse"}, RequestID: requestID(), Return: true}, nil
}

type volumesResponse struct {
	XMLName   xml.Name    `xml:"DescribeVolumesResponse"`
	RequestID string      `xml:"requestId"`
	Volumes   []volumeXML `xml:"volumeSet>item"`
	NextToken string      `xml:"nextToken,omitempty"`
}

type volumeXML struct {
	ID          string          `xml:"volumeId"`
	Size        int             `xml:"size"`
	Zone        string          `xml:"availabilityZone"`
	Status      string          `xml:"status"`
	CreateTime  string          `xml:"createTime"`
	Attachments []attachmentXML `xml:"attachmentSet>item"`
	Type        string          `xml:"volumeType"`
	Tags        []tagXML        `xml:"tagSet>item"`
}

type attachmentXML struct {
	VolumeID            string `xml:"volumeId"`
	InstanceID          string `xml:"instanceId"`
	Device              string `xml:"device"`
	Status              string `xml:"status"`
	DeleteOnTermination bool   `xml:"deleteOnTermination"`
}

// xml is the volume as DescribeVolumes shows it. Called with s.mu held.
func (v *Volume) xml() volumeXML {
	x := volumeXML{ID: v.ID, Size: v.SizeGB, Zone: v.Zone, Status: v.State, CreateTime: v.Created.UTC().Format(time.RFC3339), Type: v.Type}
	if v.Instance != "" {
		x.Attachments = []attachmentXML{{VolumeID: v.ID, InstanceID: v.Instance, Device: v.Device, Status: "attached", DeleteOnTermination: v.DeleteOnTermination}}
	}
	for _, k := range slices.Sorted(maps.Keys(v.Tags)) {
		x.Tags = append(x.Tags, tagXML{k, v.Tags[k]})
	}
	return x
}
