package armsim

import (
	"encoding/json"
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Scheduled deallocation, as Azure's Compute Schedule resource provider
// has it (Microsoft.ComputeSchedule, api-version 2024-10-01; the spec is
// Azure/azure-rest-api-specs specification/computeschedule/
// resource-manager/Microsoft.ComputeSchedule/stable/2024-10-01/
// computeschedule.json, with its example
// ScheduledActions_VirtualMachinesSubmitDeallocate.json): one POST to
// .../locations/<location>/virtualMachinesSubmitDeallocate names a batch
// of VMs, a deadline and its type (InitiateAt), and Azure deallocates
// each at that time, answering at once with one operation per VM. A
// deadline can be at most 14 days ahead (Azure/azure-cli-extensions
// src/computeschedule/README.md, "Submit Type Operations"). A VM gone by
// then fails its own operation, nothing else. The stand-in answers 400
// for a body the spec's required fields are missing from, or a deadline
// not ahead or too far ahead: the exact codes Azure gives are not
// documented, so the stand-in's say what was wrong in InvalidParameter.

// ScheduleAPIVersion is the api-version the stand-in takes.
const ScheduleAPIVersion = "2024-10-01"

// Deallocation is one VM's deallocation submitted for a deadline.
type Deallocation struct {
	ID       string // the operation's
	VM       string // the VM's resource ID
	Location string
	Deadline time.Time
	// State is Scheduled, then Succeeded, or Failed (the VM was gone).
	State string
}

var submitPath = regexp.MustCompile(`(?i)^/subscriptions/([^/]+)/providers/Microsoft\.ComputeSchedule/locations/([^/]+)/virtualMachinesSubmitDeallocate$`)

// computeScheduleRoute names the Compute Schedule API a request calls.
func computeScheduleRoute(r *http.Request) (api, sub string) {
	if m := submitPath.FindStringSubmatch(r.URL.Path); m != nil && r.Method == http.MethodPost {
		return "ScheduledActionsClient.VirtualMachinesSubmitDeallocate", m[1]
	}
	return "", ""
}

type submitDeallocate struct {
	Schedule *struct {
		Deadline     string `json:"deadline"`
		Timezone     string `json:"timezone"`
		DeadlineType string `json:"deadlineType"`
	} `json:"schedule"`
	ExecutionParameters *json.RawMessage `json:"executionParameters"`
	Resources           *struct {
		IDs []string `json:"ids"`
	} `json:"resources"`
	CorrelationID string `json:"correlationid"`
}

type resourceOperation struct {
	ResourceID   string         `json:"resourceId"`
	ErrorCode    string         `json:"errorCode,omitempty"`
	ErrorDetails string         `json:"errorDetails,omitempty"`
	Operation    *operationJSON `json:"operation,omitempty"`
}

type operationJSON struct {
	OperationID    string `json:"operationId"`
	ResourceID     string `json:"resourceId"`
	OpType         string `json:"opType"`
	SubscriptionID string `json:"subscriptionId"`
	Deadline       string `json:"deadline"`
	DeadlineType   string `json:"deadlineType"`
	State          string `json:"state"`
	Timezone       string `json:"timezone"`
}

// submitDeallocations answers virtualMachinesSubmitDeallocate.
func (s *Server) submitDeallocations(w http.ResponseWriter, r *http.Request, api string) {
	m := submitPath.FindStringSubmatch(r.URL.Path)
	loc := strings.ToLower(m[2])
	if v := r.URL.Query().Get("api-version"); v != ScheduleAPIVersion {
		armError(w, http.StatusBadRequest, "InvalidApiVersionParameter", "The api-version '"+v+"' is invalid. The supported versions are '"+ScheduleAPIVersion+"'.")
		return
	}
	var in submitDeallocate
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		armError(w, http.StatusBadRequest, "InvalidRequestContent", "The request content was invalid and could not be deserialized: "+err.Error())
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.fault(api); f != nil {
		armError(w, f.status, f.code, "")
		return
	}
	now := s.now()
	var deadline time.Time
	var bad string
	switch {
	case in.Schedule == nil || in.ExecutionParameters == nil || in.Resources == nil || in.CorrelationID == "":
		bad = "schedule, executionParameters, resources and correlationid are required"
	case in.Schedule.DeadlineType != "InitiateAt" && in.Schedule.DeadlineType != "CompleteBy":
		bad = "schedule.deadlineType must be InitiateAt or CompleteBy"
	case in.Schedule.Timezone == "":
		bad = "schedule.timezone is required"
	case len(in.Resources.IDs) == 0:
		bad = "resources.ids is empty"
	}
	if bad == "" {
		var err error
		if deadline, err = time.Parse(time.RFC3339Nano, in.Schedule.Deadline); err != nil {
			bad = "schedule.deadline is not a date-time: " + in.Schedule.Deadline
		} else if !deadline.After(now) || deadline.After(now.Add(14*24*time.Hour)) {
			bad = "schedule.deadline must be in the future and at most 14 days ahead"
		}
	}
	if bad != "" {
		armError(w, http.StatusBadRequest, "InvalidParameter", bad)
		return
	}
	out := make([]resourceOperation, 0, len(in.Resources.IDs))
	for _, id := range in.Resources.IDs {
		v := s.vmByID(id)
		if v == nil || !v.Deleted.IsZero() || !strings.EqualFold(v.Location, loc) {
			out = append(out, resourceOperation{ResourceID: id, ErrorCode: "ResourceNotFound",
				ErrorDetails: "The VM was not found in location " + loc + "."})
			continue
		}
		d := &Deallocation{ID: uuid.NewString(), VM: id, Location: loc, Deadline: deadline, State: "Scheduled"}
		s.deallocs = append(s.deallocs, d)
		out = append(out, resourceOperation{ResourceID: id, Operation: &operationJSON{OperationID: d.ID, ResourceID: id, OpType: "Deallocate",
			SubscriptionID: Subscription, Deadline: deadline.UTC().Format(time.RFC3339Nano), DeadlineType: in.Schedule.DeadlineType,
			State: d.State, Timezone: in.Schedule.Timezone}})
	}
	writeJSON(w, http.StatusOK, map[string]any{"description": "Deallocate Resource Request", "type": "VirtualMachines", "location": loc, "results": out})
}

// fireDeallocations deallocates the VMs whose submitted deadline has
// come.
func (s *Server) fireDeallocations() {
	now := s.now()
	s.mu.Lock()
	var due []firing
	for _, d := range s.deallocs {
		if d.State != "Scheduled" || now.Before(d.Deadline) {
			continue
		}
		v := s.vmByID(d.VM)
		if v == nil || !v.Deleted.IsZero() {
			d.State = "Failed"
			continue
		}
		d.State = "Succeeded"
		if v.Power != "deallocated" {
			due = append(due, firing{v, d.Deadline})
		}
	}
	s.mu.Unlock()
	for _, f := range due {
		s.deallocate(f.vm, f.at)
	}
}

// Deallocations lists the deallocations submitted, in order.
func (s *Server) Deallocations() []Deallocation {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Deallocation, 0, len(s.deallocs))
	for _, d := range s.deallocs {
		out = append(out, *d)
	}
	return out
}
