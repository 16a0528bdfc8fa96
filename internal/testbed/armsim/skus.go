package armsim

import (
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// sizeInfo is what the resource SKUs list tells of a VM size, as far as
// a pool reads it: its vCPUs, memory and GPUs (the capabilities vCPUs,
// MemoryGB and GPUs). The figures are Azure's own (the size series pages
// of "Sizes for virtual machines in Azure", learn.microsoft.com/azure/virtual-machines/sizes).
// The stand-in makes VMs of sizes it does not list too: a pool whose jobs
// choose their size lists these.
type sizeInfo struct {
	vcpus    int
	memoryGB float64
	gpus     int
}

var sizeInfos = map[string]sizeInfo{
	"Standard_B1s":              {1, 1, 0},
	"Standard_D2s_v5":           {2, 8, 0},
	"Standard_D4s_v5":           {4, 16, 0},
	"Standard_D8s_v5":           {8, 32, 0},
	"Standard_F8s_v2":           {8, 16, 0},
	"Standard_F32s_v2":          {32, 64, 0},
	"Standard_NC6":              {6, 56, 1},
	"Standard_NC12":             {12, 112, 2},
	"Standard_NC24":             {24, 224, 4},
	"Standard_NC6s_v3":          {6, 112, 1},
	"Standard_NC12s_v3":         {12, 224, 2},
	"Standard_NC24s_v3":         {24, 448, 4},
	"Standard_NC4as_T4_v3":      {4, 28, 1},
	"Standard_NC8as_T4_v3":      {8, 56, 1},
	"Standard_NC16as_T4_v3":     {16, 110, 1},
	"Standard_NC64as_T4_v3":     {64, 440, 4},
	"Standard_NC24ads_A100_v4":  {24, 220, 1},
	"Standard_NC48ads_A100_v4":  {48, 440, 2},
	"Standard_NC96ads_A100_v4":  {96, 880, 4},
	"Standard_ND96asr_v4":       {96, 900, 8},
	"Standard_NC40ads_H100_v5":  {40, 320, 1},
	"Standard_NC80adis_H100_v5": {80, 640, 2},
}

var (
	skusPath = regexp.MustCompile(`(?i)^/subscriptions/([^/]+)/providers/Microsoft\.Compute/skus$`)
	// The list takes one filter, on a location ("Resource Skus - List",
	// learn.microsoft.com/rest/api/compute/resource-skus/list).
	locationFilter = regexp.MustCompile(`^location eq '([a-z0-9]+)'$`)
)

// skusRoute names the resource SKUs list.
func skusRoute(r *http.Request) (api, sub string) {
	if m := skusPath.FindStringSubmatch(r.URL.Path); m != nil && r.Method == http.MethodGet {
		return "ResourceSKUsClient.NewListPager", m[1]
	}
	return "", ""
}

type skuJSON struct {
	ResourceType string   `json:"resourceType"`
	Name         string   `json:"name"`
	Tier         string   `json:"tier"`
	Size         string   `json:"size"`
	Locations    []string `json:"locations"`
	Capabilities []struct {
		Name  string `json:"name"`
		Value string `json:"value"`
	} `json:"capabilities"`
	Restrictions []any `json:"restrictions"`
}

// skus answers the resource SKUs list: the VM sizes of a location (the
// filter), each with its capabilities, one page; a size made unavailable
// there (NoSKU) carries a Location restriction, NotAvailableForSubscription,
// as Azure lists a size a subscription may not deploy.
func (s *Server) skus(w http.ResponseWriter, r *http.Request, _ string) {
	filter := r.URL.Query().Get("$filter")
	locs := Locations
	if filter != "" {
		m := locationFilter.FindStringSubmatch(filter)
		if m == nil {
			armError(w, http.StatusBadRequest, "InvalidParameter", "The filter '"+filter+"' is not supported: only location eq '<location>' is.")
			return
		}
		locs = []string{m[1]}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []skuJSON
	for _, loc := range locs {
		if !slices.Contains(Locations, loc) {
			continue
		}
		for _, name := range slices.Sorted(maps.Keys(sizeInfos)) {
			info := sizeInfos[name]
			tier, size, _ := strings.Cut(name, "_")
			j := skuJSON{ResourceType: "virtualMachines", Name: name, Tier: tier, Size: size, Locations: []string{loc}}
			add := func(k, v string) {
				j.Capabilities = append(j.Capabilities, struct {
					Name  string `json:"name"`
					Value string `json:"value"`
				}{k, v})
			}
			add("vCPUs", strconv.Itoa(info.vcpus))
			add("MemoryGB", strconv.FormatFloat(info.memoryGB, 'f', -1, 64))
			if info.gpus > 0 {
				add("GPUs", strconv.Itoa(info.gpus))
			}
			j.Restrictions = []any{}
			if s.noSKU[name+" "+loc] {
				j.Restrictions = append(j.Restrictions, map[string]any{"type": "Location", "values": []string{loc},
					"restrictionInfo": map[string]any{"locations": []string{loc}}, "reasonCode": "NotAvailableForSubscription"})
			}
			out = append(out, j)
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"value": out})
}
