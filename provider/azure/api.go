package azure

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/runtime"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/azidentity"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/devtestlabs/armdevtestlabs"
)

// API is what the provider calls of Azure Resource Manager.
type API interface {
	// Create asks for a VM and waits until Azure has made it or says
	// why it cannot: allocation failures come from the long-running
	// operation, not from the request. It returns the VM's vmId.
	Create(ctx context.Context, group, name string, vm armcompute.VirtualMachine) (string, error)
	// Delete starts the deletion of a VM (and of its NIC, public address
	// and OS disk, marked deleteOption Delete); it does not wait.
	Delete(ctx context.Context, group, name string) error
	// List lists every VM of the subscription with its power state, in
	// one call a page.
	List(ctx context.Context) ([]*armcompute.VirtualMachine, error)
	// Schedule makes or replaces a VM's auto-shutdown schedule
	// (shutdown-computevm-<vm>), which deallocates it each day at a
	// time; Unschedule deletes it (none there is no error); Schedules
	// lists the subscription's.
	Schedule(ctx context.Context, group, vm string, s armdevtestlabs.Schedule) error
	Unschedule(ctx context.Context, group, vm string) error
	Schedules(ctx context.Context) ([]*armdevtestlabs.Schedule, error)
}

// PollInterval is how often a VM's creation is polled when Azure does
// not say (Retry-After): a VM takes a minute or two to make, and 100
// being made at once then stay far under the subscription's 25 reads a
// second.
var PollInterval = 5 * time.Second

// sdkAPI is API on armcompute's VirtualMachinesClient and DevTest Labs'
// GlobalSchedulesClient (auto-shutdown of VMs outside a lab).
type sdkAPI struct {
	vms   *armcompute.VirtualMachinesClient
	sched *armdevtestlabs.GlobalSchedulesClient
}

func (a sdkAPI) Create(ctx context.Context, group, name string, vm armcompute.VirtualMachine) (string, error) {
	poller, err := a.vms.BeginCreateOrUpdate(ctx, group, name, vm, nil)
	if err != nil {
		return "", err
	}
	made, err := poller.PollUntilDone(ctx, &runtime.PollUntilDoneOptions{Frequency: PollInterval})
	if err != nil {
		return "", &madeFailed{err}
	}
	if made.Properties == nil || made.Properties.VMID == nil {
		return "", nil
	}
	return *made.Properties.VMID, nil
}

// madeFailed is a creation that failed after Azure took the request: the
// VM's resource may be there, failed, until deleted.
type madeFailed struct{ error }

func (e *madeFailed) Unwrap() error { return e.error }

func (a sdkAPI) Delete(ctx context.Context, group, name string) error {
	_, err := a.vms.BeginDelete(ctx, group, name, nil)
	return err
}

func (a sdkAPI) List(ctx context.Context) ([]*armcompute.VirtualMachine, error) {
	pager := a.vms.NewListAllPager(&armcompute.VirtualMachinesClientListAllOptions{StatusOnly: to.Ptr("true")})
	return all(ctx, pager, func(p armcompute.VirtualMachinesClientListAllResponse) []*armcompute.VirtualMachine { return p.Value })
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

func (a sdkAPI) Schedule(ctx context.Context, group, vm string, s armdevtestlabs.Schedule) error {
	_, err := a.sched.CreateOrUpdate(ctx, group, ScheduleName(vm), s, nil)
	return err
}

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
