package azure

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/arm"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/runtime"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/azidentity"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/devtestlabs/armdevtestlabs"
	"github.com/google/uuid"
)

// API is what the provider calls of Azure Resource Manager.
type API interface {
	// Create asks for a VM and returns once Azure has taken the request,
	// with the VM's vmId from that first answer: whether Azure can place
	// it shows later, in its provisioning state (an allocation failure
	// is not refused at the request). Its long-running operation is not
	// polled: the subscription's listing, shared, says how it ended.
	Create(ctx context.Context, group, name string, vm armcompute.VirtualMachine) (string, error)
	// Delete starts the deletion of a VM (and of its NIC, public address
	// and OS disk, marked deleteOption Delete); it does not wait.
	Delete(ctx context.Context, group, name string) error
	// List lists every VM of the subscription with its power state, in
	// one call a page.
	List(ctx context.Context) ([]*armcompute.VirtualMachine, error)
	// Get reads one VM with its instance view: Compute meters it as a
	// cheap read, where it meters the listing as a costly one.
	Get(ctx context.Context, group, name string) (*armcompute.VirtualMachine, error)
	// Deallocate submits the deallocation of VMs (resource IDs, of one
	// location) at a time, to Compute Schedule, in one call; it returns
	// the error codes of the VMs it would not take, by resource ID.
	Deallocate(ctx context.Context, location string, at time.Time, ids []string) (map[string]string, error)
	// Unschedule deletes an auto-shutdown schedule (made by runfleet
	// before Compute Schedule: gc sweeps them; none there is no error);
	// Schedules lists the subscription's.
	Unschedule(ctx context.Context, group, vm string) error
	Schedules(ctx context.Context) ([]*armdevtestlabs.Schedule, error)
	// SKUs lists the VM sizes of a location with their capabilities
	// (vCPUs, MemoryGB, GPUs), every page.
	SKUs(ctx context.Context, location string) ([]*armcompute.ResourceSKU, error)
}

// PollInterval is how often a VM being made is looked for in the
// subscription's listing, which the VMs being made share: a VM takes a
// minute or two to make.
var PollInterval = 5 * time.Second

// sdkAPI is API on armcompute's VirtualMachinesClient, DevTest Labs'
// GlobalSchedulesClient (the auto-shutdown schedules of earlier
// versions) and Compute Schedule's REST API, hand-written on azcore's
// pipeline: no Go module of Compute Schedule is served.
type sdkAPI struct {
	vms   *armcompute.VirtualMachinesClient
	skus  *armcompute.ResourceSKUsClient
	sched *armdevtestlabs.GlobalSchedulesClient
	arm   *arm.Client
	sub   string
}

func (a sdkAPI) Create(ctx context.Context, group, name string, vm armcompute.VirtualMachine) (string, error) {
	var first *http.Response
	if _, err := a.vms.BeginCreateOrUpdate(policy.WithCaptureResponse(ctx, &first), group, name, vm, nil); err != nil {
		return "", err
	}
	var made armcompute.VirtualMachine
	if first == nil {
		return "", nil
	}
	if err := runtime.UnmarshalAsJSON(first, &made); err != nil || made.Properties == nil || made.Properties.VMID == nil {
		return "", nil
	}
	return *made.Properties.VMID, nil
}

func (a sdkAPI) Delete(ctx context.Context, group, name string) error {
	_, err := a.vms.BeginDelete(ctx, group, name, nil)
	return err
}

func (a sdkAPI) List(ctx context.Context) ([]*armcompute.VirtualMachine, error) {
	pager := a.vms.NewListAllPager(&armcompute.VirtualMachinesClientListAllOptions{StatusOnly: to.Ptr("true")})
	return all(ctx, pager, func(p armcompute.VirtualMachinesClientListAllResponse) []*armcompute.VirtualMachine { return p.Value })
}

func (a sdkAPI) Get(ctx context.Context, group, name string) (*armcompute.VirtualMachine, error) {
	r, err := a.vms.Get(ctx, group, name, &armcompute.VirtualMachinesClientGetOptions{Expand: to.Ptr(armcompute.InstanceViewTypesInstanceView)})
	if err != nil {
		return nil, err
	}
	return &r.VirtualMachine, nil
}

// ScheduleAPIVersion is Compute Schedule's api-version (its first
// stable one).
const ScheduleAPIVersion = "2024-10-01"

// Deallocate is Compute Schedule's virtualMachinesSubmitDeallocate
// (azure-rest-api-specs, specification/computeschedule/resource-manager/
// Microsoft.ComputeSchedule/stable/2024-10-01/computeschedule.json).
func (a sdkAPI) Deallocate(ctx context.Context, location string, at time.Time, ids []string) (map[string]string, error) {
	u := runtime.JoinPaths(a.arm.Endpoint(), "subscriptions", url.PathEscape(a.sub), "providers/Microsoft.ComputeSchedule/locations",
		url.PathEscape(location), "virtualMachinesSubmitDeallocate")
	req, err := runtime.NewRequest(ctx, http.MethodPost, u)
	if err != nil {
		return nil, err
	}
	req.Raw().URL.RawQuery = "api-version=" + ScheduleAPIVersion
	req.Raw().Header.Set("Accept", "application/json")
	body := map[string]any{
		"schedule":            map[string]string{"deadline": at.UTC().Format(time.RFC3339), "timezone": "UTC", "deadlineType": "InitiateAt"},
		"executionParameters": map[string]any{"retryPolicy": map[string]int{"retryCount": 3, "retryWindowInMinutes": 30}},
		"resources":           map[string][]string{"ids": ids},
		"correlationid":       uuid.NewString(),
	}
	if err := runtime.MarshalAsJSON(req, body); err != nil {
		return nil, err
	}
	resp, err := a.arm.Pipeline().Do(req)
	if err != nil {
		return nil, err
	}
	if !runtime.HasStatusCode(resp, http.StatusOK) {
		return nil, runtime.NewResponseError(resp)
	}
	var out struct {
		Results []struct {
			ResourceID string `json:"resourceId"`
			ErrorCode  string `json:"errorCode"`
		} `json:"results"`
	}
	if err := runtime.UnmarshalAsJSON(resp, &out); err != nil {
		return nil, fmt.Errorf("virtualMachinesSubmitDeallocate's answer: %w", err)
	}
	refused := map[string]string{}
	for _, r := range out.Results {
		// Azure's own example writes no error as the string "null".
		if r.ErrorCode != "" && r.ErrorCode != "null" {
			refused[r.ResourceID] = r.ErrorCode
		}
	}
	return refused, nil
}

// all reads every page of a pager.
func all[T, P any](ctx context.Context, pager *runtime.Pager[P], values func(P) []T) ([]T, error) {
	var out []T
	for pager.More() {
		page, err := pager.NextPage(ctx)
		if err != nil {
			return nil, err
		}
		out = append(out, values(page)...)
	}
	return out, nil
}

// ScheduleName is the name Azure requires of a VM's auto-shutdown
// schedule.
func ScheduleName(vm string) string { return "shutdown-computevm-" + vm }

func (a sdkAPI) Unschedule(ctx context.Context, group, vm string) error {
	_, err := a.sched.Delete(ctx, group, ScheduleName(vm), nil)
	if k, _ := kindOf(err); k == errNotFound {
		return nil
	}
	return err
}

func (a sdkAPI) Schedules(ctx context.Context) ([]*armdevtestlabs.Schedule, error) {
	return all(ctx, a.sched.NewListBySubscriptionPager(nil), func(p armdevtestlabs.GlobalSchedulesClientListBySubscriptionResponse) []*armdevtestlabs.Schedule {
		return p.Value
	})
}

func (a sdkAPI) SKUs(ctx context.Context, location string) ([]*armcompute.ResourceSKU, error) {
	pager := a.skus.NewListPager(&armcompute.ResourceSKUsClientListOptions{Filter: to.Ptr("location eq '" + location + "'")})
	return all(ctx, pager, func(p armcompute.ResourceSKUsClientListResponse) []*armcompute.ResourceSKU { return p.Value })
}

// What an error means for a runner's start.
type errKind int

const (
	errOther    errKind = iota // transient or unknown: the pool backs off
	errCapacity                // this size, location or market has none, or the quota is spent: try the next
	errFatal                   // no retry can fix it: tried elsewhere, then the pool stops, saying why
	errThrottle                // the subscription's request rate is spent
	errNotFound                // what was asked for is gone already
)

// codes are Azure's documented error codes ("Troubleshoot allocation
// failures", "Resolve errors for SKU not available", "Troubleshoot
// common Azure deployment errors").
var codes = map[string]errKind{
	"SkuNotAvailable":                       errCapacity,
	"AllocationFailed":                      errCapacity,
	"ZonalAllocationFailed":                 errCapacity,
	"OverconstrainedAllocationRequest":      errCapacity,
	"OverconstrainedZonalAllocationRequest": errCapacity,
	"QuotaExceeded":                         errCapacity,
	"OperationNotAllowed":                   errFatal, // capacity when it names a quota (quotaError)
	"TooManyRequests":                       errThrottle,
	"AuthorizationFailed":                   errFatal,
	"AuthenticationFailed":                  errFatal,
	"InvalidAuthenticationToken":            errFatal,
	"LinkedAuthorizationFailed":             errFatal,
	"InvalidParameter":                      errFatal,
	"InvalidRequestContent":                 errFatal,
	"BadRequest":                            errFatal,
	"ResourceGroupNotFound":                 errFatal,
	"SubscriptionNotFound":                  errFatal,
	"MissingSubscriptionRegistration":       errFatal,
	"ImageNotFound":                         errFatal,
	"PlatformImageNotFound":                 errFatal,
	"InvalidResourceReference":              errFatal,
	"ResourceNotFound":                      errNotFound,
	"NotFound":                              errNotFound,
}

// kindOf classifies an error of a call, with the code it carries.
func kindOf(err error) (errKind, string) {
	var auth *azidentity.AuthenticationFailedError
	if errors.As(err, &auth) {
		// Entra ID refused the credential (400, 401); anything else from
		// it (5xx, no answer) may pass.
		if r := auth.RawResponse; r != nil && r.StatusCode >= 400 && r.StatusCode < 500 {
			return errFatal, "AuthenticationFailed"
		}
		return errOther, "AuthenticationFailed"
	}
	var held *heldError
	if errors.As(err, &held) {
		return errThrottle, held.policy
	}
	var pf *provisionFailed
	if errors.As(err, &pf) {
		// The creation's own error, from the VM's status.
		if k, ok := codes[pf.code]; ok && (pf.code != "OperationNotAllowed" || strings.Contains(strings.ToLower(pf.message), "quota")) {
			if pf.code == "OperationNotAllowed" {
				k = errCapacity
			}
			return k, pf.code
		}
		return errOther, or(pf.code, "ProvisioningFailed")
	}
	var re *azcore.ResponseError
	if !errors.As(err, &re) {
		return errOther, ""
	}
	if re.StatusCode == http.StatusTooManyRequests {
		// Compute's own throttling says OperationNotAllowed, the code of
		// refusals no retry fixes; its status tells.
		return errThrottle, or(re.ErrorCode, "429")
	}
	if k, ok := codes[re.ErrorCode]; ok {
		// A vCPU quota spent is OperationNotAllowed, its message naming
		// the quota.
		if re.ErrorCode == "OperationNotAllowed" && strings.Contains(strings.ToLower(err.Error()), "quota") {
			return errCapacity, re.ErrorCode
		}
		return k, re.ErrorCode
	}
	switch re.StatusCode {
	case http.StatusTooManyRequests:
		return errThrottle, "429"
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusBadRequest:
		return errFatal, or(re.ErrorCode, http.StatusText(re.StatusCode))
	case http.StatusNotFound:
		return errNotFound, or(re.ErrorCode, "NotFound")
	}
	return errOther, or(re.ErrorCode, http.StatusText(re.StatusCode))
}

func or(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
}
