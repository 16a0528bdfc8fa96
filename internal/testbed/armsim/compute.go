package armsim

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"golang.org/x/time/rate"
)

// Compute's own throttling, behind Resource Manager's: token buckets per
// subscription (and, for some, per VM) for each policy, refilled each
// minute (learn.microsoft.com/azure/virtual-machines/
// compute-throttling-limits, "Throttling limits for Virtual Machines").
// Each answer says what is left of the policies it counted against in
// x-ms-ratelimit-remaining-resource ("Microsoft.Compute/<policy>;<count>");
// a request over a policy is answered 429 with Retry-After, the code
// OperationNotAllowed and a TooManyRequests detail naming the policy
// (learn.microsoft.com/troubleshoot/azure/virtual-machines/
// troubleshooting-throttling-errors, "Throttling error details"). The
// policy names in the headers are the stand-in's: Azure's vary.

// computePolicy is one Compute throttling policy: per subscription, and per VM
// where the docs give a resource level.
type computePolicy struct {
	name                 string
	subRefill, subBucket float64 // per minute
	vmRefill, vmBucket   float64 // 0: no resource level
}

// policies are the documented ones for the calls runfleet makes.
var policies = map[string]computePolicy{
	"PutVM":         {"PutVM", 500, 1500, 4, 12},
	"DeleteVM":      {"DeleteVM", 500, 1500, 4, 12},
	"LowCostGetVM":  {"LowCostGetVM", 8000, 24000, 12, 36},
	"HighCostGetVM": {"HighCostGetVM", 300, 900, 0, 0},
	"GetOperation":  {"GetOperation", 5000, 15000, 15, 45},
}

// policyOf is the policy an API's request counts against.
func policyOf(api string, poll bool) string {
	switch {
	case poll:
		return "GetOperation"
	case strings.HasPrefix(api, "VirtualMachinesClient.NewList"):
		return "HighCostGetVM"
	case api == "VirtualMachinesClient.BeginCreateOrUpdate":
		return "PutVM"
	case api == "VirtualMachinesClient.BeginDelete":
		return "DeleteVM"
	case api == "VirtualMachinesClient.Get":
		return "LowCostGetVM"
	}
	return ""
}

func perMinute(refill, bucket float64) *rate.Limiter {
	return rate.NewLimiter(rate.Limit(refill/60), int(bucket))
}

// SetComputePolicy changes a policy's subscription-level refill (per
// minute) and bucket, for a test that needs it to run out sooner than
// Azure's would.
func (s *Server) SetComputePolicy(name string, refill, bucket float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.compute[name] = perMinute(refill, bucket)
}

// computeThrottle counts a request against its policy's buckets, and
// writes the remaining-resource headers; when a bucket is empty it writes
// Compute's 429 and reports true.
func (s *Server) computeThrottle(w http.ResponseWriter, api string, poll bool, vm string) bool {
	name := policyOf(api, poll)
	if name == "" {
		return false
	}
	p := policies[name]
	s.mu.Lock()
	sub := s.compute[name]
	if sub == nil {
		sub = perMinute(p.subRefill, p.subBucket)
		s.compute[name] = sub
	}
	var res *rate.Limiter
	if p.vmBucket > 0 && vm != "" {
		k := name + " " + strings.ToLower(vm)
		if res = s.compute[k]; res == nil {
			res = perMinute(p.vmRefill, p.vmBucket)
			s.compute[k] = res
		}
	}
	s.mu.Unlock()
	now := time.Now()
	levels := []struct {
		level string
		lim   *rate.Limiter
	}{{"", sub}, {"VM", res}}
	var wait time.Duration
	var over string
	var taken []*rate.Reservation
	for _, l := range levels {
		if l.lim == nil {
			continue
		}
		r := l.lim.ReserveN(now, 1)
		taken = append(taken, r)
		if d := r.DelayFrom(now); d > wait {
			wait, over = d, p.name+l.level
		}
	}
	if wait > 0 {
		// Nothing is counted against a refused request.
		for _, r := range taken {
			r.CancelAt(now)
		}
	}
	for _, l := range levels {
		if l.lim != nil {
			w.Header().Add("x-ms-ratelimit-remaining-resource", fmt.Sprintf("Microsoft.Compute/%s%s;%d", p.name, l.level, int(math.Max(0, l.lim.TokensAt(now)))))
		}
	}
	if wait == 0 {
		return false
	}
	s.count(api + " (throttled by Compute)")
	w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(wait.Seconds()))))
	w.Header().Set("x-ms-error-code", "OperationNotAllowed")
	writeJSON(w, http.StatusTooManyRequests, map[string]any{"error": map[string]any{
		"code":    "OperationNotAllowed",
		"message": "The server rejected the request because too many requests have been received for this subscription.",
		"details": []map[string]string{{"code": "TooManyRequests", "target": over,
			"message": fmt.Sprintf(`{"operationGroup":%q,"startTime":%q,"endTime":%q}`, over, now.UTC().Format(time.RFC3339), now.Add(wait).UTC().Format(time.RFC3339))}},
	}})
	return true
}
