package gcesim

import (
	"net/http"
	"slices"
	"strings"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"
)

// machineInfo is what machineTypes.get tells of a predefined type, as far
// as a pool reads it: vCPUs, memory and the GPUs the type carries. The
// figures are Compute Engine's own ("General-purpose machine family",
// "Accelerator-optimized machine family" and "GPU machine types",
// docs.cloud.google.com/compute/docs). An N1 type carries no GPU: one is
// attached to it (guestAccelerators).
type machineInfo struct {
	cpus     int32
	memoryMB int32
	gpus     int32
	gpuType  string // the accelerator type: nvidia-l4, nvidia-tesla-a100
}

var machineInfos = map[string]machineInfo{
	"e2-micro":       {2, 1024, 0, ""},
	"e2-small":       {2, 2048, 0, ""},
	"e2-medium":      {2, 4096, 0, ""},
	"e2-standard-2":  {2, 8192, 0, ""},
	"e2-standard-4":  {4, 16384, 0, ""},
	"n1-standard-1":  {1, 3840, 0, ""},
	"n1-standard-2":  {2, 7680, 0, ""},
	"n1-standard-4":  {4, 15360, 0, ""},
	"n1-standard-8":  {8, 30720, 0, ""},
	"n1-standard-16": {16, 61440, 0, ""},
	"n2-standard-8":  {8, 32768, 0, ""},
	"g2-standard-4":  {4, 16384, 1, "nvidia-l4"},
	"g2-standard-8":  {8, 32768, 1, "nvidia-l4"},
	"g2-standard-24": {24, 98304, 2, "nvidia-l4"},
	"g2-standard-48": {48, 196608, 4, "nvidia-l4"},
	"g2-standard-96": {96, 393216, 8, "nvidia-l4"},
	"a2-highgpu-1g":  {12, 87040, 1, "nvidia-tesla-a100"},
	"a2-highgpu-2g":  {24, 174080, 2, "nvidia-tesla-a100"},
	"a2-highgpu-4g":  {48, 348160, 4, "nvidia-tesla-a100"},
	"a2-highgpu-8g":  {96, 696320, 8, "nvidia-tesla-a100"},
	"a2-ultragpu-1g": {12, 174080, 1, "nvidia-a100-80gb"},
	"a3-highgpu-8g":  {208, 1916928, 8, "nvidia-h100-80gb"},
}

// gpuZones are the zones of the stand-in that offer each accelerator,
// and so the types that carry it: a GPU is offered in some zones of some
// regions only ("GPU regions and zones",
// docs.cloud.google.com/compute/docs/gpus/gpu-regions-zones), and
// machineTypes.get answers 404 in a zone that does not offer the type,
// an insert there 400. The stand-in's other types are in every zone.
var gpuZones = map[string][]string{
	"nvidia-l4":         {"us-central1-a", "us-central1-b", "us-central1-c", "us-east1-c", "us-west1-b"},
	"nvidia-tesla-a100": {"us-central1-a", "us-central1-b", "us-central1-c", "us-west1-b"},
	"nvidia-a100-80gb":  {"us-central1-a", "us-central1-c"},
	"nvidia-h100-80gb":  {"us-central1-a", "us-central1-c"},
}

// offered says whether a zone offers a machine type the stand-in knows;
// one it does not know is offered everywhere.
func offered(typ, zone string) bool {
	info, ok := machineInfos[typ]
	return !ok || info.gpus == 0 || slices.Contains(gpuZones[info.gpuType], zone)
}

// machineType answers machineTypes.get (compute/docs/reference/rest/v1/machineTypes/get).
func (s *Server) machineType(r *http.Request) (proto.Message, *apiError) {
	zone, name := r.PathValue("zone"), r.PathValue("name")
	info, ok := machineInfos[name]
	if !ok || !offered(name, zone) {
		return nil, notFound("projects/" + Project + "/zones/" + zone + "/machineTypes/" + name)
	}
	mt := &computepb.MachineType{
		Kind: proto.String("compute#machineType"), Name: proto.String(name), Zone: proto.String(zone),
		GuestCpus: proto.Int32(info.cpus), MemoryMb: proto.Int32(info.memoryMB),
		IsSharedCpu: proto.Bool(strings.HasPrefix(name, "e2-") && info.memoryMB < 8192),
		SelfLink:    proto.String(s.selfLink("zones", zone, "machineTypes", name)),
	}
	if info.gpus > 0 {
		mt.Accelerators = []*computepb.Accelerators{{GuestAcceleratorType: proto.String(info.gpuType), GuestAcceleratorCount: proto.Int32(info.gpus)}}
	}
	return mt, nil
}
