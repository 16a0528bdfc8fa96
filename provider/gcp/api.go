package gcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"
	"google.golang.org/protobuf/proto"
)

// API is what the provider calls of Compute Engine, each call one
// request but for List and Preempted, which read every page.
type API interface {
	// Insert asks for an instance; the operation says when it is made.
	Insert(ctx context.Context, project, zone string, inst *computepb.Instance, requestID string) (*computepb.Operation, error)
	// BulkInsert asks for instances alike but for their names, in one
	// request; the operation says how many were made.
	BulkInsert(ctx context.Context, project, zone string, req *computepb.BulkInsertInstanceResource, requestID string) (*computepb.Operation, error)
	// Wait waits for a zone operation, at most about 2 minutes a call
	// (zoneOperations.wait): it returns the operation, done or not.
	Wait(ctx context.Context, project, zone, op string) (*computepb.Operation, error)
	// Delete deletes an instance (and its disks marked autoDelete).
	Delete(ctx context.Context, project, zone, name, requestID string) error
	// List lists the instances of every zone matching a filter.
	List(ctx context.Context, project, filter string) ([]*computepb.Instance, error)
	// Preempted lists the preemption operations of every zone.
	Preempted(ctx context.Context, project string) ([]*computepb.Operation, error)
	// Disks lists the disks of every zone matching a filter.
	Disks(ctx context.Context, project, filter string) ([]*computepb.Disk, error)
	// DeleteDisk deletes a disk no instance uses.
	DeleteDisk(ctx context.Context, project, zone, name, requestID string) error
	// MachineType says what a machine type of a zone has: its CPUs,
	// memory and the GPUs it carries (machineTypes.get).
	MachineType(ctx context.Context, project, zone, name string) (*computepb.MachineType, error)
}

// restAPI is API on the Go client's REST clients.
type restAPI struct {
	instances *compute.InstancesClient
	disks     *compute.DisksClient
	ops       *compute.ZoneOperationsClient
	zoneOps   *compute.GlobalOperationsClient // aggregated operations
	types     *compute.MachineTypesClient
}

func (a restAPI) Insert(ctx context.Context, project, zone string, inst *computepb.Instance, requestID string) (*computepb.Operation, error) {
	op, err := a.instances.Insert(ctx, &computepb.InsertInstanceRequest{Project: project, Zone: zone, InstanceResource: inst, RequestId: proto.String(requestID)})
	if err != nil {
		return nil, err
	}
	return op.Proto(), nil
}

func (a restAPI) BulkInsert(ctx context.Context, project, zone string, req *computepb.BulkInsertInstanceResource, requestID string) (*computepb.Operation, error) {
	op, err := a.instances.BulkInsert(ctx, &computepb.BulkInsertInstanceRequest{Project: project, Zone: zone, BulkInsertInstanceResourceResource: req, RequestId: proto.String(requestID)})
	if err != nil {
		return nil, err
	}
	return op.Proto(), nil
}

func (a restAPI) Wait(ctx context.Context, project, zone, op string) (*computepb.Operation, error) {
	return a.ops.Wait(ctx, &computepb.WaitZoneOperationRequest{Project: project, Zone: zone, Operation: op})
}

func (a restAPI) Delete(ctx context.Context, project, zone, name, requestID string) error {
	_, err := a.instances.Delete(ctx, &computepb.DeleteInstanceRequest{Project: project, Zone: zone, Instance: name, RequestId: proto.String(requestID)})
	return err
}

func (a restAPI) List(ctx context.Context, project, filter string) ([]*computepb.Instance, error) {
	it := a.instances.AggregatedList(ctx, &computepb.AggregatedListInstancesRequest{Project: project, Filter: proto.String(filter), MaxResults: proto.Uint32(500)})
	return every(it, func(p compute.InstancesScopedListPair) []*computepb.Instance { return p.Value.GetInstances() })
}

func (a restAPI) Preempted(ctx context.Context, project string) ([]*computepb.Operation, error) {
	it := a.zoneOps.AggregatedList(ctx, &computepb.AggregatedListGlobalOperationsRequest{Project: project,
		Filter: proto.String(`operationType = "compute.instances.preempted"`), MaxResults: proto.Uint32(500)})
	return every(it, func(p compute.OperationsScopedListPair) []*computepb.Operation { return p.Value.GetOperations() })
}

func (a restAPI) Disks(ctx context.Context, project, filter string) ([]*computepb.Disk, error) {
	it := a.disks.AggregatedList(ctx, &computepb.AggregatedListDisksRequest{Project: project, Filter: proto.String(filter), MaxResults: proto.Uint32(500)})
	return every(it, func(p compute.DisksScopedListPair) []*computepb.Disk { return p.Value.GetDisks() })
}

// every reads every page of an aggregated list: the items of each scope.
func every[P, T any](it interface{ Next() (P, error) }, items func(P) []T) ([]T, error) {
	var out []T
	for {
		pair, err := it.Next()
		if errors.Is(err, iterator.Done) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, items(pair)...)
	}
}

func (a restAPI) MachineType(ctx context.Context, project, zone, name string) (*computepb.MachineType, error) {
	return a.types.Get(ctx, &computepb.GetMachineTypeRequest{Project: project, Zone: zone, MachineType: name})
}

func (a restAPI) DeleteDisk(ctx context.Context, project, zone, name, requestID string) error {
	_, err := a.disks.Delete(ctx, &computepb.DeleteDiskRequest{Project: project, Zone: zone, Disk: name, RequestId: proto.String(requestID)})
	return err
}

// What an error means for a runner's start. The codes are those of
// Compute Engine's documented errors: an HTTP error's reason, or an
// operation's error code.
type errKind int

const (
	errOther    errKind = iota // transient or unknown: the pool backs off
	errCapacity                // this type, zone or market has none, or the quota is spent: try the next
	errFatal                   // no retry can fix it: the pool stops, saying why
	errThrottle                // the project's request rate quota is spent
	errNotFound                // what was asked for is gone already
)

var opCodes = map[string]errKind{
	"ZONE_RESOURCE_POOL_EXHAUSTED":              errCapacity,
	"ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": errCapacity,
	"QUOTA_EXCEEDED":                            errCapacity,
	"RESOURCE_POOL_EXHAUSTED":                   errCapacity,
	"UNSUPPORTED_OPERATION":                     errCapacity, // the type or accelerator is not offered in the zone
	"RESOURCE_OPERATION_RATE_EXCEEDED":          errThrottle,
	"RATE_LIMIT_EXCEEDED":                       errThrottle,
	"RESOURCE_NOT_FOUND":                        errFatal,
	"INVALID_FIELD_VALUE":                       errFatal,
	"PERMISSIONS_ERROR":                         errFatal,
	"INVALID_USAGE":                             errFatal,
}

var reasons = map[string]errKind{
	"quotaExceeded":           errCapacity,
	"rateLimitExceeded":       errThrottle,
	"userRateLimitExceeded":   errThrottle,
	"invalid":                 errFatal,
	"badRequest":              errFatal,
	"required":                errFatal,
	"forbidden":               errFatal,
	"accessNotConfigured":     errFatal,
	"insufficientPermissions": errFatal,
	"notFound":                errFatal,
}

// kindOf classifies an HTTP error of a call.
func kindOf(err error) (errKind, string) {
	var held *QuotaHeldError
	if errors.As(err, &held) {
		return errThrottle, "rateLimitExceeded"
	}
	var ge *googleapi.Error
	if !errors.As(err, &ge) {
		return errOther, ""
	}
	for _, e := range ge.Errors {
		if k, ok := reasons[e.Reason]; ok {
			return k, e.Reason
		}
	}
	switch {
	case ge.Code == http.StatusTooManyRequests:
		return errThrottle, "429"
	case ge.Code == http.StatusUnauthorized || ge.Code == http.StatusForbidden || ge.Code == http.StatusBadRequest:
		return errFatal, http.StatusText(ge.Code)
	case ge.Code == http.StatusNotFound:
		return errNotFound, "notFound"
	}
	return errOther, http.StatusText(ge.Code)
}

// opError is an operation that ended in error.
type opError struct {
	codes []string
	msg   string
}

func (e *opError) Error() string { return strings.Join(e.codes, ", ") + ": " + e.msg }

// kind is the worst kind among the operation's codes.
func (e *opError) kind() errKind {
	kind := errOther
	for _, c := range e.codes {
		if k, ok := opCodes[c]; ok && (kind == errOther || k == errFatal) {
			kind = k
		}
	}
	return kind
}

// failed returns the error of a done operation, or nil.
func failed(op *computepb.Operation) error {
	var e opError
	for _, item := range op.GetError().GetErrors() {
		e.codes = append(e.codes, item.GetCode())
		if e.msg != "" {
			e.msg += "; "
		}
		e.msg += item.GetMessage()
	}
	if len(e.codes) == 0 {
		return nil
	}
	return &e
}

// waitOp waits for an operation until it is done, each wait within
// opWait: Compute Engine answers a wait within 2 minutes, done or not,
// so a wait costs one request where polling would cost several.
func waitOp(ctx context.Context, api API, project, zone string, op *computepb.Operation) (*computepb.Operation, error) {
	for op.GetStatus() != computepb.Operation_DONE {
		cctx, cancel := context.WithTimeout(ctx, opWait)
		next, err := api.Wait(cctx, project, zone, op.GetName())
		cancel()
		if err != nil {
			return nil, fmt.Errorf("wait for operation %s: %w", op.GetName(), err)
		}
		op = next
	}
	return op, nil
}

// opWait bounds one zoneOperations.wait: Compute Engine's 2 minutes and
// some room.
var opWait = 2*time.Minute + 30*time.Second

// last is the last segment of a resource URL (zones/us-central1-a →
// us-central1-a).
func last(u string) string {
	if i := strings.LastIndexByte(u, '/'); i >= 0 {
		return u[i+1:]
	}
	return u
}
