package armsim

import (
	"encoding/json"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"time"
	_ "time/tzdata" // the zones of the Windows time zone ids below
)

// Auto-shutdown, as Azure has it for a VM outside a lab: a DevTest Labs
// "global schedule" (Microsoft.DevTestLab/schedules, api-version
// 2018-09-15; learn.microsoft.com/azure/templates/microsoft.devtestlab/
// 2018-09-15/schedules) of taskType ComputeVmShutdownTask, named
// shutdown-computevm-<VM name> (Azure refuses any other name with a 400:
// hashicorp/terraform-provider-azurerm#5536), with a daily time (HHmm) in
// a Windows time zone id. At that time each day Azure stops and
// deallocates the VM, which ends its compute cost ("Auto shutdown stops
// and deallocates your VMs", learn.microsoft.com/azure/
// cost-management-billing/understand/plan-manage-costs). A schedule is
// its own resource: nothing documented deletes it with its VM, so the
// stand-in keeps it until it is deleted.

// Schedule is one auto-shutdown schedule.
type Schedule struct {
	Name, Group, Location string
	Target                string // the VM's resource ID
	Time, TimeZone        string // HHmm, a Windows time zone id
	Enabled               bool
	Tags                  map[string]string
	Created               time.Time
	// Fired is when it last shut its VM down.
	Fired time.Time
}

var (
	schedulePath     = regexp.MustCompile(`(?i)^/subscriptions/([^/]+)/resourceGroups/([^/]+)/providers/Microsoft\.DevTestLab/schedules/([^/]+)$`)
	scheduleListPath = regexp.MustCompile(`(?i)^/subscriptions/([^/]+)(/resourceGroups/([^/]+))?/providers/Microsoft\.DevTestLab/schedules$`)
	hhmm             = regexp.MustCompile(`^([01][0-9]|2[0-3])[0-5][0-9]$`)
)

// zones are the Windows time zone ids the stand-in knows (a few of the
// many Azure takes), with their IANA names.
var zones = map[string]string{
	"UTC": "UTC", "GMT Standard Time": "Europe/London", "W. Europe Standard Time": "Europe/Berlin",
	"Pacific Standard Time": "America/Los_Angeles", "Eastern Standard Time": "America/New_York",
}

// scheduleRoute names the schedule API a request calls.
func scheduleRoute(r *http.Request) (api, sub string) {
	if m := scheduleListPath.FindStringSubmatch(r.URL.Path); m != nil && r.Method == http.MethodGet {
		return "GlobalSchedulesClient.NewListPager", m[1]
	}
	m := schedulePath.FindStringSubmatch(r.URL.Path)
	if m == nil {
		return "", ""
	}
	switch r.Method {
	case http.MethodPut:
		return "GlobalSchedulesClient.CreateOrUpdate", m[1]
	case http.MethodDelete:
		return "GlobalSchedulesClient.Delete", m[1]
	case http.MethodGet:
		return "GlobalSchedulesClient.Get", m[1]
	}
	return "", ""
}

type scheduleJSON struct {
	ID         string            `json:"id,omitempty"`
	Name       string            `json:"name,omitempty"`
	Type       string            `json:"type,omitempty"`
	Location   string            `json:"location,omitempty"`
	Tags       map[string]string `json:"tags,omitempty"`
	Properties struct {
		Status          string `json:"status,omitempty"`
		TaskType        string `json:"taskType,omitempty"`
		DailyRecurrence *struct {
			Time string `json:"time"`
		} `json:"dailyRecurrence,omitempty"`
		TimeZoneID           string          `json:"timeZoneId,omitempty"`
		TargetResourceID     string          `json:"targetResourceId,omitempty"`
		NotificationSettings json.RawMessage `json:"notificationSettings,omitempty"`
		ProvisioningState    string          `json:"provisioningState,omitempty"`
	} `json:"properties"`
}

func (sc *Schedule) json() scheduleJSON {
	var j scheduleJSON
	j.ID = "/subscriptions/" + Subscription + "/resourceGroups/" + sc.Group + "/providers/microsoft.devtestlab/schedules/" + sc.Name
	j.Name, j.Type, j.Location, j.Tags = sc.Name, "microsoft.devtestlab/schedules", sc.Location, sc.Tags
	j.Properties.Status = "Disabled"
	if sc.Enabled {
		j.Properties.Status = "Enabled"
	}
	j.Properties.TaskType, j.Properties.TimeZoneID, j.Properties.TargetResourceID = "ComputeVmShutdownTask", sc.TimeZone, sc.Target
	j.Properties.DailyRecurrence = &struct {
		Time string `json:"time"`
	}{sc.Time}
	j.Properties.ProvisioningState = "Succeeded"
	return j
}

// schedules answers the schedule calls.
func (s *Server) schedules(w http.ResponseWriter, r *http.Request, api string) {
	if api == "GlobalSchedulesClient.NewListPager" {
		m := scheduleListPath.FindStringSubmatch(r.URL.Path)
		s.mu.Lock()
		var out []scheduleJSON
		for _, k := range slices.Sorted(maps.Keys(s.scheds)) {
			if sc := s.scheds[k]; m[3] == "" || strings.EqualFold(sc.Group, m[3]) {
				out = append(out, sc.json())
			}
		}
		s.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"value": out})
		return
	}
	m := schedulePath.FindStringSubmatch(r.URL.Path)
	group, name := m[2], m[3]
	k := key(group, name)
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.fault(api); f != nil {
		armError(w, f.status, f.code, "")
		return
	}
	switch api {
	case "GlobalSchedulesClient.Get":
		sc, ok := s.scheds[k]
		if !ok {
			armError(w, http.StatusNotFound, "ResourceNotFound", "The Resource 'Microsoft.DevTestLab/schedules/"+name+"' under resource group '"+group+"' was not found.")
			return
		}
		writeJSON(w, http.StatusOK, sc.json())
	case "GlobalSchedulesClient.Delete":
		if _, ok := s.scheds[k]; !ok {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		delete(s.scheds, k)
		w.WriteHeader(http.StatusOK)
	case "GlobalSchedulesClient.CreateOrUpdate":
		var in scheduleJSON
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			armError(w, http.StatusBadRequest, "InvalidRequestContent", "The request content was invalid and could not be deserialized: "+err.Error())
			return
		}
		sc, status, code, msg := s.checkSchedule(group, name, in)
		if code != "" {
			armError(w, status, code, msg)
			return
		}
		status = http.StatusCreated
		if old, ok := s.scheds[k]; ok {
			sc.Created, status = old.Created, http.StatusOK
		}
		s.scheds[k] = sc
		writeJSON(w, status, sc.json())
	}
}

// checkSchedule checks a schedule as Azure does, and makes it. Called
// with s.mu held.
func (s *Server) checkSchedule(group, name string, in scheduleJSON) (sc *Schedule, status int, code, msg string) {
	p := in.Properties
	v := s.vmByID(p.TargetResourceID)
	switch {
	case in.Location == "":
		return nil, http.StatusBadRequest, "LocationRequired", "The location property is required for this definition."
	case p.TaskType != "ComputeVmShutdownTask":
		return nil, http.StatusBadRequest, "InvalidTaskType", "A schedule outside a lab must have taskType ComputeVmShutdownTask."
	case p.DailyRecurrence == nil || !hhmm.MatchString(p.DailyRecurrence.Time):
		return nil, http.StatusBadRequest, "InvalidScheduleTime", "dailyRecurrence.time must be a time of day as HHmm."
	case zones[p.TimeZoneID] == "":
		return nil, http.StatusBadRequest, "InvalidTimeZone", "timeZoneId '" + p.TimeZoneID + "' is not a time zone id."
	case p.Status != "Enabled" && p.Status != "Disabled":
		return nil, http.StatusBadRequest, "InvalidStatus", "status must be Enabled or Disabled."
	case v == nil:
		return nil, http.StatusBadRequest, "InvalidTargetResource", "The target resource '" + p.TargetResourceID + "' was not found."
	case !strings.EqualFold(name, "shutdown-computevm-"+v.Name):
		return nil, http.StatusBadRequest, "InvalidScheduleName", "The schedule of a VM must be named shutdown-computevm-" + v.Name + "."
	case !strings.EqualFold(group, v.Group):
		return nil, http.StatusBadRequest, "InvalidTargetResource", "The schedule must be in its VM's resource group."
	}
	return &Schedule{Name: name, Group: group, Location: in.Location, Target: p.TargetResourceID, Time: p.DailyRecurrence.Time,
		TimeZone: p.TimeZoneID, Enabled: p.Status == "Enabled", Tags: in.Tags, Created: s.now()}, 0, "", ""
}

// vmByID finds a VM, not deleted, by its resource ID. Called with s.mu
// held.
func (s *Server) vmByID(id string) *VM {
	m := vmPath.FindStringSubmatch(id)
	if m == nil || m[1] != Subscription {
		return nil
	}
	return s.vms[key(m[2], m[3])]
}

// next is when a schedule fires next after t.
func (sc *Schedule) next(after time.Time) time.Time {
	loc, err := time.LoadLocation(zones[sc.TimeZone])
	if err != nil {
		loc = time.UTC
	}
	t := after.In(loc)
	h, m := int(sc.Time[0]-'0')*10+int(sc.Time[1]-'0'), int(sc.Time[2]-'0')*10+int(sc.Time[3]-'0')
	at := time.Date(t.Year(), t.Month(), t.Day(), h, m, 0, 0, loc)
	if !at.After(t) {
		at = at.AddDate(0, 0, 1)
	}
	return at
}

// now is the stand-in's clock: the time, moved on by Advance.
func (s *Server) now() time.Time { return time.Now().Add(time.Duration(s.offset.Load())) }

// Advance moves the stand-in's clock on, for its schedules and
// submitted deallocations: what a test
// cannot wait for (a deadline hours away) comes at once. The VMs' own
// clocks do not move.
func (s *Server) Advance(d time.Duration) {
	s.offset.Add(int64(d))
	s.fireSchedules()
	s.fireDeallocations()
}

// firing is a VM to deallocate, and the time it was due.
type firing struct {
	vm *VM
	at time.Time
}

// fireSchedules shuts down and deallocates the VMs whose schedule's time
// has come.
func (s *Server) fireSchedules() {
	now := s.now()
	s.mu.Lock()
	var due []firing
	for _, sc := range s.scheds {
		last := sc.Fired
		if last.IsZero() {
			last = sc.Created
		}
		at := sc.next(last)
		if !sc.Enabled || now.Before(at) {
			continue
		}
		sc.Fired = at
		if v := s.vmByID(sc.Target); v != nil && v.Power != "deallocated" {
			due = append(due, firing{v, at})
		}
	}
	s.mu.Unlock()
	for _, f := range due {
		s.deallocate(f.vm, f.at)
	}
}

// deallocate stops a VM's machine and releases its hardware, as its
// schedule did at a time: its compute cost ends; its disk stays.
func (s *Server) deallocate(v *VM, at time.Time) {
	s.end(v, false)
	s.mu.Lock()
	defer s.mu.Unlock()
	if v.Deleted.IsZero() {
		v.Provisioning, v.Power, v.Deallocated = "Succeeded", "deallocated", at
	}
}

// Schedules lists the auto-shutdown schedules there are.
func (s *Server) Schedules() []Schedule {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Schedule, 0, len(s.scheds))
	for _, k := range slices.Sorted(maps.Keys(s.scheds)) {
		out = append(out, *s.scheds[k])
	}
	return out
}
