package ec2sim

import (
	"encoding/xml"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
)

// typeInfo is what DescribeInstanceTypes tells of a type, as far as a
// pool reads it: vCPUs, memory and GPUs. The figures are EC2's own
// ("Amazon EC2 instance types", the general purpose and accelerated
// computing specifications). The stand-in runs a few more types than it
// describes (knownTypes): a pool whose jobs choose their size lists these.
type typeInfo struct {
	vcpus     int
	memoryMiB int64
	gpus      int
	gpuName   string // NVIDIA's, as GpuInfo names it: T4, A10G
}

var typeInfos = map[string]typeInfo{
	"t2.micro":      {1, 1024, 0, ""},
	"t3.micro":      {2, 1024, 0, ""},
	"t3.small":      {2, 2048, 0, ""},
	"t3.medium":     {2, 4096, 0, ""},
	"t3.large":      {2, 8192, 0, ""},
	"m5.large":      {2, 8192, 0, ""},
	"m5.xlarge":     {4, 16384, 0, ""},
	"m5.2xlarge":    {8, 32768, 0, ""},
	"m5.8xlarge":    {32, 131072, 0, ""},
	"m5.16xlarge":   {64, 262144, 0, ""},
	"c5.large":      {2, 4096, 0, ""},
	"c5.xlarge":     {4, 8192, 0, ""},
	"p2.xlarge":     {4, 62464, 1, "K80"},
	"p2.8xlarge":    {32, 499712, 8, "K80"},
	"p2.16xlarge":   {64, 749568, 16, "K80"},
	"p3.2xlarge":    {8, 62464, 1, "V100"},
	"p3.8xlarge":    {32, 249856, 4, "V100"},
	"p3.16xlarge":   {64, 499712, 8, "V100"},
	"g4dn.xlarge":   {4, 16384, 1, "T4"},
	"g4dn.2xlarge":  {8, 32768, 1, "T4"},
	"g4dn.12xlarge": {48, 196608, 4, "T4"},
	"g5.xlarge":     {4, 16384, 1, "A10G"},
	"g5.2xlarge":    {8, 32768, 1, "A10G"},
	"g5.12xlarge":   {48, 196608, 4, "A10G"},
	"g6.xlarge":     {4, 16384, 1, "L4"},
	"g6.12xlarge":   {48, 196608, 4, "L4"},
	"p4d.24xlarge":  {96, 1179648, 8, "A100"},
	"p5.48xlarge":   {192, 2097152, 8, "H100"},
}

var typeFilters = regexp.MustCompile(`^(instance-type|current-generation|vcpu-info\.default-vcpus|memory-info\.size-in-mib)$`)

// describeInstanceTypes answers DescribeInstanceTypes (EC2 API reference):
// the types named (InstanceType.N), or every type, paged by MaxResults
// (5 to 100) and NextToken; a type that does not exist is refused,
// naming it, as EC2 does (InvalidInstanceType).
func (s *Server) describeInstanceTypes(form url.Values) (any, *apiError) {
	d, aerr := describeParams(form, "InstanceType", "instanceTypeSet", typeFilters, 5, 100)
	if aerr != nil {
		return nil, aerr
	}
	var missing []string
	for _, t := range d.ids {
		if _, ok := typeInfos[t]; !ok {
			missing = append(missing, t)
		}
	}
	if len(missing) > 0 {
		return nil, &apiError{http.StatusBadRequest, "InvalidInstanceType", fmt.Sprintf("The following supplied instance types do not exist: [%s]", strings.Join(missing, ", "))}
	}
	names := d.ids
	if len(names) == 0 {
		for t := range typeInfos {
			names = append(names, t)
		}
	}
	slices.Sort(names)
	names = slices.DeleteFunc(slices.Compact(names), func(t string) bool { return !matchFilters(d.filters, typeValues(t)) })
	resp := typesResponse{RequestID: requestID()}
	from, to, next := d.page(len(names))
	resp.NextToken = next
	for _, t := range names[from:to] {
		ti := typeInfos[t]
		x := typeXML{Type: t, VCPUs: ti.vcpus, MemoryMiB: ti.memoryMiB, CurrentGeneration: true}
		if ti.gpus > 0 {
			x.GPUs = []gpuXML{{Name: ti.gpuName, Manufacturer: "NVIDIA", Count: ti.gpus}}
		}
		resp.Types = append(resp.Types, x)
	}
	return resp, nil
}

func typeValues(t string) func(string) []string {
	ti := typeInfos[t]
	return func(name string) []string {
		switch name {
		case "instance-type":
			return []string{t}
		case "current-generation":
			return []string{"true"}
		case "vcpu-info.default-vcpus":
			return []string{fmt.Sprint(ti.vcpus)}
		case "memory-info.size-in-mib":
			return []string{fmt.Sprint(ti.memoryMiB)}
		}
		return nil
	}
}

type typesResponse struct {
	XMLName   xml.Name  `xml:"DescribeInstanceTypesResponse"`
	RequestID string    `xml:"requestId"`
	Types     []typeXML `xml:"instanceTypeSet>item"`
	NextToken string    `xml:"nextToken,omitempty"`
}

type typeXML struct {
	Type              string   `xml:"instanceType"`
	CurrentGeneration bool     `xml:"currentGeneration"`
	VCPUs             int      `xml:"vCpuInfo>defaultVCpus"`
	MemoryMiB         int64    `xml:"memoryInfo>sizeInMiB"`
	GPUs              []gpuXML `xml:"gpuInfo>gpus>item,omitempty"`
}

type gpuXML struct {
	Name         string `xml:"name"`
	Manufacturer string `xml:"manufacturer"`
	Count        int    `xml:"count"`
}
