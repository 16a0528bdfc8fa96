package gcesim

import (
	"net/http"
	"strings"
)

// Compute Engine's rate quotas as "Compute Engine rate quotas"
// (docs.cloud.google.com/compute/docs/api-rate-limits) and "Use
// simplified API quota metrics" (.../compute/docs/api/how-tos/
// use-simplified-quota) group them: per project and minute, a zonal or
// regional method in its region's group (get, list and operation waits
// among the reads, inserts and deletes among the writes), the
// aggregatedList methods among the global reads. A quota refills at the
// start of each minute, and a request past it is answered 403
// rateLimitExceeded, naming the metric.
const (
	QuotaReadsPerRegion  = "reads_per_region"
	QuotaWritesPerRegion = "writes_per_region"
	QuotaGlobalReads     = "global_reads"
	QuotaGlobalWrites    = "global_writes"
)

// DefaultQuota is each group's requests a minute unless Options.Quotas
// says otherwise: the default the legacy groups were documented with
// (Google no longer prints them; the simplified groups "offer higher
// limits").
const DefaultQuota = 1500

type quota struct{ group, region string }

// metric is the quota's name in a refusal, as the console shows it.
func (q quota) metric() string {
	switch q.group {
	case QuotaReadsPerRegion:
		return "Read requests per minute per region"
	case QuotaWritesPerRegion:
		return "Mutation requests per minute per region"
	case QuotaGlobalReads:
		return "Read requests per minute"
	}
	return "Mutation requests per minute"
}

// quotaOf is the quota a request counts in.
func quotaOf(r *http.Request) quota {
	read := r.Method == http.MethodGet || strings.HasSuffix(r.URL.Path, "/wait")
	reg := ""
	if z := r.PathValue("zone"); z != "" {
		reg = region(z)
	}
	switch {
	case reg != "" && read:
		return quota{QuotaReadsPerRegion, reg}
	case reg != "":
		return quota{QuotaWritesPerRegion, reg}
	case read:
		return quota{group: QuotaGlobalReads}
	}
	return quota{group: QuotaGlobalWrites}
}
