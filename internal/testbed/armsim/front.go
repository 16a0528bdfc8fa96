package armsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/runtime"
)

// messages are Azure's messages for the codes the stand-in answers.
var messages = map[string]string{
	"SkuNotAvailable":                     "The requested VM size for resource 'Following SKUs have failed for Capacity Restrictions' is currently not available in this location. Please try another size or deploy to a different location or different zone.",
	"AllocationFailed":                    "Allocation failed. We do not have sufficient capacity for the requested VM size in this region.",
	"OperationNotAllowed":                 "Operation could not be completed as it results in exceeding approved Total Regional Cores quota. Additional details - Deployment Model: Resource Manager, Location: the VM's, Current Limit: 0, Current Usage: 0.",
	"ResourceGroupNotFound":               "Resource group could not be found.",
	"PlatformImageNotFound":               "The platform image requested is not available.",
	"InvalidResourceReference":            "Resource referenced by the network profile was not found, or is in another location.",
	"InvalidParameter":                    "One of the request's parameters is not valid.",
	"LocationNotAvailableForResourceType": "The provided location is not available for resource type 'Microsoft.Compute/virtualMachines'.",
	"ResourceNotFound":                    "The Resource 'Microsoft.Compute/virtualMachines' under the resource group was not found.",
	"TooManyRequests":                     "The request is being throttled as the limit has been reached for operation type.",
	"ServiceUnavailable":                  "The service is temporarily unavailable.",
	"InvalidAuthenticationToken":          "The access token is invalid.",
	"AuthenticationFailed":                "Authentication failed. The 'Authorization' header is missing.",
	"SubscriptionNotFound":                "The subscription could not be found.",
	"MissingApiVersionParameter":          "The api-version query parameter (?api-version=) is required for all requests.",
}

var (
	vmPath     = regexp.MustCompile(`(?i)^/subscriptions/([^/]+)/resourceGroups/([^/]+)/providers/Microsoft\.Compute/virtualMachines/([^/]+)(/get/fake/status)?$`)
	listPath   = regexp.MustCompile(`(?i)^/subscriptions/([^/]+)(/resourceGroups/([^/]+))?/providers/Microsoft\.Compute/virtualMachines$`)
	tokenPath  = regexp.MustCompile(`^/([^/]+)/oauth2/v2\.0/token$`)
	configPath = regexp.MustCompile(`^/([^/]+)/v2\.0/\.well-known/openid-configuration$`)
)

func (s *Server) routes() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if d := time.Duration(s.latency.Load()); d > 0 {
			time.Sleep(d)
		}
		switch p := r.URL.Path; {
		case tokenPath.MatchString(p):
			s.token(w, r, tokenPath.FindStringSubmatch(p)[1])
		case configPath.MatchString(p):
			tenant := configPath.FindStringSubmatch(p)[1]
			s.count("openid-configuration")
			writeJSON(w, http.StatusOK, map[string]any{
				"token_endpoint":         s.URL + "/" + tenant + "/oauth2/v2.0/token",
				"authorization_endpoint": s.URL + "/" + tenant + "/oauth2/v2.0/authorize",
				"issuer":                 s.URL + "/" + tenant + "/v2.0",
			})
		case p == "/api/retail/prices":
			s.retailPrices(w, r)
		case p == "/common/discovery/instance":
			s.count("instance-discovery")
			host := strings.TrimPrefix(s.URL, "https://")
			writeJSON(w, http.StatusOK, map[string]any{"tenant_discovery_endpoint": s.URL + "/" + Tenant + "/v2.0/.well-known/openid-configuration",
				"api-version": "1.1", "metadata": []map[string]any{{"preferred_network": host, "preferred_cache": host, "aliases": []string{host}}}})
		default:
			s.arm(w, r)
		}
	})
}

// token is Entra ID's client credentials grant for the service
// principal.
func (s *Server) token(w http.ResponseWriter, r *http.Request, tenant string) {
	s.count("token")
	_ = r.ParseForm()
	if tenant != Tenant || r.PostForm.Get("grant_type") != "client_credentials" || r.PostForm.Get("client_id") != ClientID || r.PostForm.Get("client_secret") != s.secret {
		writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "invalid_client",
			"error_description": "AADSTS7000215: Invalid client secret provided.", "error_codes": []int{7000215}})
		return
	}
	tok := "arm-" + randHex(24)
	s.mu.Lock()
	s.tokens[tok] = time.Now().Add(time.Hour)
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"token_type": "Bearer", "expires_in": 3599, "ext_expires_in": 3599, "access_token": tok})
}

// arm answers Azure Resource Manager's VM calls through the fake server.
func (s *Server) arm(w http.ResponseWriter, r *http.Request) {
	api, sub := s.route(r)
	if api == "" {
		armError(w, http.StatusNotFound, "InvalidResourceType", "The resource type could not be found.")
		return
	}
	if r.URL.Query().Get("api-version") == "" {
		armError(w, http.StatusBadRequest, "MissingApiVersionParameter", "")
		return
	}
	s.mu.Lock()
	exp, ok := s.tokens[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]
	down := s.down
	s.mu.Unlock()
	switch {
	case !ok || time.Now().After(exp):
		w.Header().Set("WWW-Authenticate", `Bearer authorization_uri="`+s.URL+"/"+Tenant+`", error="invalid_token"`)
		armError(w, http.StatusUnauthorized, "InvalidAuthenticationToken", "")
		return
	case sub != Subscription:
		armError(w, http.StatusNotFound, "SubscriptionNotFound", "")
		return
	case down:
		s.count(api + " (down)")
		armError(w, http.StatusServiceUnavailable, "ServiceUnavailable", "")
		return
	}
	if wait := s.throttle(r.Method); wait > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(wait.Seconds()))))
		armError(w, http.StatusTooManyRequests, "TooManyRequests", "")
		return
	}
	if strings.HasPrefix(api, "GlobalSchedulesClient.") {
		s.count(api)
		s.schedules(w, r, api)
		return
	}
	if strings.HasPrefix(api, "ScheduledActionsClient.") {
		s.count(api)
		s.submitDeallocations(w, r, api)
		return
	}
	if strings.HasPrefix(api, "ResourceSKUsClient.") {
		s.count(api)
		s.skus(w, r, api)
		return
	}
	poll := strings.HasSuffix(r.URL.Path, "/get/fake/status")
	vm := ""
	if m := vmPath.FindStringSubmatch(r.URL.Path); m != nil {
		vm = m[2] + "/" + m[3]
	}
	if s.computeThrottle(w, api, poll, vm) {
		return
	}
	r.URL.Scheme, r.URL.Host = "https", r.Host
	ctx := context.WithValue(r.Context(), runtime.CtxAPINameKey{}, api)
	if strings.HasPrefix(api, "VirtualMachinesClient.NewList") {
		s.listMu.Lock()
		defer s.listMu.Unlock()
	}
	resp, err := s.Transport().Do(r.WithContext(ctx))
	if err != nil {
		var re *azcore.ResponseError
		if errors.As(err, &re) {
			armError(w, re.StatusCode, re.ErrorCode, "")
			return
		}
		armError(w, http.StatusInternalServerError, "InternalServerError", err.Error())
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	switch resp.Header.Get("Fake-Poller-Status") {
	case "InProgress":
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(s.opt.PollAfter.Seconds()))))
	case "Succeeded":
		s.count(api + " done") // the client learns its operation ended
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

// route names the API a request calls, as the client names it, and its
// subscription. An operation's poll is the API whose operation it is.
func (s *Server) route(r *http.Request) (api, sub string) {
	if api, sub := scheduleRoute(r); api != "" {
		return api, sub
	}
	if api, sub := computeScheduleRoute(r); api != "" {
		return api, sub
	}
	if api, sub := skusRoute(r); api != "" {
		return api, sub
	}
	p := r.URL.Path
	if m := listPath.FindStringSubmatch(p); m != nil && r.Method == http.MethodGet {
		if m[2] == "" {
			return "VirtualMachinesClient.NewListAllPager", m[1]
		}
		return "VirtualMachinesClient.NewListPager", m[1]
	}
	m := vmPath.FindStringSubmatch(p)
	if m == nil {
		return "", ""
	}
	base := strings.TrimSuffix(strings.ToLower(p), "/get/fake/status")
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case m[4] != "" && r.Method == http.MethodGet:
		return s.lro[base], m[1]
	case r.Method == http.MethodPut:
		s.lro[base] = "VirtualMachinesClient.BeginCreateOrUpdate"
		return s.lro[base], m[1]
	case r.Method == http.MethodDelete:
		s.lro[base] = "VirtualMachinesClient.BeginDelete"
		return s.lro[base], m[1]
	case r.Method == http.MethodGet:
		return "VirtualMachinesClient.Get", m[1]
	}
	return "", ""
}

// throttle takes a token from the request's bucket, or says how long
// until one is there.
func (s *Server) throttle(method string) time.Duration {
	bucket := "write"
	switch method {
	case http.MethodGet:
		bucket = "read"
	case http.MethodDelete:
		bucket = "delete"
	}
	res := s.buckets[bucket].Reserve()
	if d := res.Delay(); d > 0 {
		res.Cancel()
		return d
	}
	return 0
}

func (s *Server) count(api string) {
	s.mu.Lock()
	s.calls[api]++
	s.mu.Unlock()
}

// armErr is the error Azure's client makes of an error answer, its body
// Azure's, for the fake server to return in-process as over HTTP.
func armErr(status int, code string) error {
	rec := httptest.NewRecorder()
	armError(rec, status, code, "")
	resp := rec.Result()
	resp.Request, _ = http.NewRequest(http.MethodGet, "https://management.azure.com/", nil)
	return runtime.NewResponseError(resp)
}

// armError writes Azure Resource Manager's error body.
func armError(w http.ResponseWriter, status int, code, msg string) {
	if msg == "" {
		msg = messages[code]
	}
	if msg == "" {
		msg = fmt.Sprintf("%s (%d)", code, status)
	}
	w.Header().Set("x-ms-error-code", code)
	writeJSON(w, status, map[string]any{"error": map[string]string{"code": code, "message": msg}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
