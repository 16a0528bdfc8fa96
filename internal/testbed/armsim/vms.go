package armsim

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	azfake "github.com/Azure/azure-sdk-for-go/sdk/azcore/fake"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7/fake"
	"github.com/google/uuid"

	"github.com/runfleet/runfleet/internal/testbed/vmboot"
)

// VM is one stand-in VM.
type VM struct {
	Name, Group, Location, Size string
	Priority                    string // Spot or Regular
	MaxPrice                    float64
	Tags                        map[string]string
	CustomData                  string
	// Provisioning is Creating, Succeeded, Failed or Deleting; Power
	// starting, running, stopped (powered off from inside: still
	// allocated, and billed) or deallocated (by its auto-shutdown
	// schedule: its compute cost ended).
	Provisioning, Power string
	// Failure is the error code of a creation that failed (AllocationFailed).
	Failure                 string
	Created, Ended, Deleted time.Time
	Deallocated             time.Time
	// Evicted is when Azure began to evict it (its Preempt event's time
	// passed, or the VM approved it).
	Evicted time.Time
	// Console is what the VM printed, kept when it ends.
	Console string
	// Resources are the NIC, public address and OS disk made with it,
	// by name, each with whether it goes with the VM.
	Resources map[string]bool

	res     armcompute.VirtualMachine
	machine *vmboot.Machine
	off     chan struct{} // closed once its machine is gone
	events  []scheduledEvent
	// eventsOn is when its Scheduled Events answer: EventsDelay after
	// its first call.
	eventsOn time.Time
	evict    chan struct{} // closed when its Preempt event is approved
}

type scheduledEvent struct {
	EventID           string   `json:"EventId"`
	EventType         string   `json:"EventType"`
	ResourceType      string   `json:"ResourceType"`
	Resources         []string `json:"Resources"`
	EventStatus       string   `json:"EventStatus"`
	NotBefore         string   `json:"NotBefore"`
	Description       string   `json:"Description"`
	EventSource       string   `json:"EventSource"`
	DurationInSeconds int      `json:"DurationInSeconds"`
}

func key(group, name string) string { return strings.ToLower(group + "/" + name) }

// server is the fake server's methods on the model.
func (s *Server) server() *fake.VirtualMachinesServer {
	return &fake.VirtualMachinesServer{
		BeginCreateOrUpdate: s.create,
		BeginDelete:         s.delete,
		Get: func(_ context.Context, group, name string, _ *armcompute.VirtualMachinesClientGetOptions) (resp azfake.Responder[armcompute.VirtualMachinesClientGetResponse], errResp azfake.ErrorResponder) {
			s.mu.Lock()
			defer s.mu.Unlock()
			if f := s.fault("VirtualMachinesClient.Get"); f != nil {
				errResp.SetError(armErr(f.status, f.code))
				return
			}
			v, ok := s.vms[key(group, name)]
			if !ok {
				errResp.SetError(armErr(http.StatusNotFound, "ResourceNotFound"))
				return
			}
			resp.SetResponse(http.StatusOK, armcompute.VirtualMachinesClientGetResponse{VirtualMachine: v.resource(true)}, nil)
			return
		},
		NewListAllPager: func(_ *armcompute.VirtualMachinesClientListAllOptions) (resp azfake.PagerResponder[armcompute.VirtualMachinesClientListAllResponse]) {
			if f := s.lockedFault("VirtualMachinesClient.NewListAllPager"); f != nil {
				resp.AddResponseError(f.status, f.code)
				return
			}
			resp.AddPage(http.StatusOK, armcompute.VirtualMachinesClientListAllResponse{VirtualMachineListResult: armcompute.VirtualMachineListResult{Value: s.list("")}}, nil)
			return
		},
		NewListPager: func(group string, _ *armcompute.VirtualMachinesClientListOptions) (resp azfake.PagerResponder[armcompute.VirtualMachinesClientListResponse]) {
			resp.AddPage(http.StatusOK, armcompute.VirtualMachinesClientListResponse{VirtualMachineListResult: armcompute.VirtualMachineListResult{Value: s.list(group)}}, nil)
			return
		},
	}
}

// fault takes the next fault set for an API. Called with s.mu held.
func (s *Server) fault(api string) *fault {
	q := s.faults[api]
	if len(q) == 0 {
		return nil
	}
	s.faults[api] = q[1:]
	return &q[0]
}

func (s *Server) lockedFault(api string) *fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fault(api)
}

// list is the VMs (of a group, when given) with their instance view.
func (s *Server) list(group string) []*armcompute.VirtualMachine {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*armcompute.VirtualMachine
	for _, v := range s.order {
		if v.Deleted.IsZero() && (group == "" || strings.EqualFold(v.Group, group)) {
			r := v.resource(true)
			out = append(out, &r)
		}
	}
	return out
}

// resource is the VM as the API returns it (custom data is never
// returned). Called with s.mu held.
func (v *VM) resource(view bool) armcompute.VirtualMachine {
	r := v.res
	props := *r.Properties
	props.ProvisioningState = to.Ptr(v.Provisioning)
	if props.OSProfile != nil {
		osp := *props.OSProfile
		osp.CustomData = nil
		props.OSProfile = &osp
	}
	if view {
		statuses := []*armcompute.InstanceViewStatus{{Code: to.Ptr("ProvisioningState/" + strings.ToLower(v.Provisioning))}}
		if v.Failure != "" {
			// A failed VM's status names the error and says it
			// (learn.microsoft.com/azure/virtual-machines/states-billing,
			// "Provisioning states": ProvisioningState/failed/<code>).
			statuses[0] = &armcompute.InstanceViewStatus{Code: to.Ptr("ProvisioningState/failed/" + v.Failure),
				Level: to.Ptr(armcompute.StatusLevelTypesError), DisplayStatus: to.Ptr("Provisioning failed"), Message: to.Ptr(messages[v.Failure])}
		}
		if v.Power != "" {
			statuses = append(statuses, &armcompute.InstanceViewStatus{Code: to.Ptr("PowerState/" + v.Power)})
		}
		props.InstanceView = &armcompute.VirtualMachineInstanceView{Statuses: statuses}
	}
	r.Properties = &props
	return r
}

// create is VirtualMachinesClient.BeginCreateOrUpdate: checked as Azure
// does, refused at once for a size not offered or a quota spent; a VM
// with no capacity is made, and fails in its operation.
func (s *Server) create(_ context.Context, group, name string, in armcompute.VirtualMachine, _ *armcompute.VirtualMachinesClientBeginCreateOrUpdateOptions) (resp azfake.PollerResponder[armcompute.VirtualMachinesClientCreateOrUpdateResponse], errResp azfake.ErrorResponder) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.fault("VirtualMachinesClient.BeginCreateOrUpdate"); f != nil {
		errResp.SetError(armErr(f.status, f.code))
		return
	}
	code, status := s.refuse(group, name, in)
	if code != "" {
		errResp.SetError(armErr(status, code))
		return
	}
	p := in.Properties
	loc := *in.Location
	size := string(*p.HardwareProfile.VMSize)
	priority := "Regular"
	if p.Priority != nil {
		priority = string(*p.Priority)
	}
	data, _ := base64.StdEncoding.DecodeString(deref(p.OSProfile.CustomData))
	v := &VM{Name: name, Group: group, Location: loc, Size: size, Priority: priority, Tags: map[string]string{}, CustomData: string(data),
		Provisioning: "Creating", Created: time.Now(), Resources: map[string]bool{}, off: make(chan struct{})}
	for k, val := range in.Tags {
		v.Tags[k] = deref(val)
	}
	if bp := p.BillingProfile; bp != nil && bp.MaxPrice != nil {
		v.MaxPrice = *bp.MaxPrice
	}
	v.Resources[name+"_OsDisk"] = p.StorageProfile.OSDisk != nil && p.StorageProfile.OSDisk.DeleteOption != nil && *p.StorageProfile.OSDisk.DeleteOption == armcompute.DiskDeleteOptionTypesDelete
	for _, nic := range p.NetworkProfile.NetworkInterfaceConfigurations {
		v.Resources[deref(nic.Name)] = nic.Properties.DeleteOption != nil && *nic.Properties.DeleteOption == armcompute.DeleteOptionsDelete
		for _, ipc := range nic.Properties.IPConfigurations {
			if pip := ipc.Properties.PublicIPAddressConfiguration; pip != nil {
				v.Resources[deref(pip.Name)] = pip.Properties != nil && pip.Properties.DeleteOption != nil && *pip.Properties.DeleteOption == armcompute.DeleteOptionsDelete
			}
		}
	}
	in.ID = to.Ptr("/subscriptions/" + Subscription + "/resourceGroups/" + group + "/providers/Microsoft.Compute/virtualMachines/" + name)
	in.Name, in.Type = to.Ptr(name), to.Ptr("Microsoft.Compute/virtualMachines")
	in.Properties.TimeCreated = to.Ptr(v.Created)
	in.Properties.VMID = to.Ptr(uuid.NewString())
	v.res = in
	s.vms[key(group, name)] = v
	s.order = append(s.order, v)
	resp.AddNonTerminalResponse(http.StatusCreated, nil)
	for range s.opt.CreatePolls {
		resp.AddNonTerminalResponse(http.StatusOK, nil)
	}
	if s.noCap[priority+" "+size+" "+loc] || s.noCap[priority+" "+size+" "] || s.noCap[priority+"  "+loc] || s.noCap[priority+"  "] {
		v.Provisioning, v.Failure = "Failed", "AllocationFailed"
		resp.SetTerminalError(http.StatusConflict, "AllocationFailed")
		return
	}
	done := v.resource(false)
	done.Properties.ProvisioningState = to.Ptr("Succeeded")
	resp.SetTerminalResponse(http.StatusOK, armcompute.VirtualMachinesClientCreateOrUpdateResponse{VirtualMachine: done}, nil)
	image := s.imageOf(p.StorageProfile.ImageReference)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.boot(v, image)
	}()
	return
}

// created gives a creation's first answer (201) the VM as made so far,
// as Azure's does: its vmId and provisioningState Creating, before the
// operation ends (azure-rest-api-specs, specification/compute/
// resource-manager/Microsoft.Compute/ComputeRP/stable/*/examples/
// virtualMachineExamples/VirtualMachine_Create_*.json, response 201).
// The fake poller answers it with no body.
func (s *Server) created(r *http.Request, resp *http.Response) {
	m := vmPath.FindStringSubmatch(r.URL.Path)
	if r.Method != http.MethodPut || m == nil || m[4] != "" || resp.StatusCode != http.StatusCreated {
		return
	}
	s.mu.Lock()
	v := s.vms[key(m[2], m[3])]
	var body []byte
	if v != nil {
		res := v.resource(false)
		res.Properties.ProvisioningState = to.Ptr("Creating")
		body, _ = json.Marshal(res)
	}
	s.mu.Unlock()
	if body == nil {
		return
	}
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(body))
	resp.ContentLength = int64(len(body))
	resp.Header.Set("Content-Type", "application/json; charset=utf-8")
	resp.Header.Del("Content-Length")
}

// refuse checks a creation as Azure does before it takes it. Called
// with s.mu held.
func (s *Server) refuse(group, name string, in armcompute.VirtualMachine) (string, int) {
	p := in.Properties
	switch {
	case !s.groups[group]:
		return "ResourceGroupNotFound", http.StatusNotFound
	case s.vms[key(group, name)] != nil:
		return "OperationNotAllowed", http.StatusConflict // runfleet never updates a VM
	case in.Location == nil || !slices.Contains(Locations, *in.Location):
		return "LocationNotAvailableForResourceType", http.StatusBadRequest
	case p == nil || p.HardwareProfile == nil || p.HardwareProfile.VMSize == nil || p.StorageProfile == nil ||
		p.OSProfile == nil || p.NetworkProfile == nil || len(p.NetworkProfile.NetworkInterfaceConfigurations) == 0:
		return "InvalidParameter", http.StatusBadRequest
	case p.OSProfile.LinuxConfiguration == nil || p.OSProfile.LinuxConfiguration.SSH == nil || len(p.OSProfile.LinuxConfiguration.SSH.PublicKeys) == 0:
		return "InvalidParameter", http.StatusBadRequest // password login off and no key
	case p.Priority != nil && *p.Priority == armcompute.VirtualMachinePriorityTypesSpot && (p.EvictionPolicy == nil || p.BillingProfile == nil):
		return "InvalidParameter", http.StatusBadRequest
	}
	if len(deref(p.OSProfile.CustomData)) > 87380 { // 65535 bytes, base64
		return "InvalidParameter", http.StatusBadRequest
	}
	if _, ok := s.images[s.imageKey(p.StorageProfile.ImageReference)]; !ok {
		return "PlatformImageNotFound", http.StatusNotFound
	}
	for _, nic := range p.NetworkProfile.NetworkInterfaceConfigurations {
		for _, ipc := range nic.Properties.IPConfigurations {
			if ipc.Properties == nil || ipc.Properties.Subnet == nil || s.subnets[deref(ipc.Properties.Subnet.ID)] != *in.Location {
				return "InvalidResourceReference", http.StatusBadRequest
			}
		}
	}
	size := string(*p.HardwareProfile.VMSize)
	if s.noSKU[size+" "+*in.Location] {
		return "SkuNotAvailable", http.StatusConflict
	}
	if s.noQuota[*in.Location] {
		return "OperationNotAllowed", http.StatusConflict // the message names the quota
	}
	return "", 0
}

func (s *Server) imageKey(ref *armcompute.ImageReference) string {
	if ref == nil {
		return ""
	}
	if ref.ID != nil {
		return *ref.ID
	}
	return deref(ref.Publisher) + ":" + deref(ref.Offer) + ":" + deref(ref.SKU) + ":" + deref(ref.Version)
}

// imageOf is the Docker image a reference boots. Called with s.mu held.
func (s *Server) imageOf(ref *armcompute.ImageReference) string { return s.images[s.imageKey(ref)] }

// delete is VirtualMachinesClient.BeginDelete: the VM is deleted with
// what was made with it to go with it; a VM not there is no error (204).
func (s *Server) delete(_ context.Context, group, name string, _ *armcompute.VirtualMachinesClientBeginDeleteOptions) (resp azfake.PollerResponder[armcompute.VirtualMachinesClientDeleteResponse], errResp azfake.ErrorResponder) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.fault("VirtualMachinesClient.BeginDelete"); f != nil {
		errResp.SetError(armErr(f.status, f.code))
		return
	}
	v, ok := s.vms[key(group, name)]
	if !ok {
		resp.SetTerminalResponse(http.StatusNoContent, armcompute.VirtualMachinesClientDeleteResponse{}, nil)
		return
	}
	v.Provisioning = "Deleting"
	resp.AddNonTerminalResponse(http.StatusAccepted, nil)
	resp.SetTerminalResponse(http.StatusOK, armcompute.VirtualMachinesClientDeleteResponse{}, nil)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		time.Sleep(300 * time.Millisecond)
		s.end(v, true)
	}()
	return
}

// boot runs the VM's machine until it is off.
func (s *Server) boot(v *VM, image string) {
	if s.opt.Docker == nil || image == "" {
		defer close(v.off)
		time.Sleep(200 * time.Millisecond)
		s.mu.Lock()
		if v.Provisioning == "Creating" {
			v.Provisioning, v.Power = "Succeeded", "running"
		}
		s.mu.Unlock()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m, err := vmboot.Create(ctx, vmboot.Options{
		Docker: s.opt.Docker, HostAddr: s.opt.HostAddr, Name: "armsim-" + v.Group + "-" + v.Name, Image: image, Hostname: v.Name,
		Labels: map[string]string{"armsim.vm": v.Name}, Script: []byte(v.CustomData),
		Metadata: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.imds(v, w, r) }),
		Env:      func(hostPort string) []string { return []string{"RUNFLEET_AZURE_IMDS=" + hostPort} },
	})
	if err != nil {
		s.opt.Logger.Error("armsim: VM did not boot", "vm", v.Name, "err", err)
		s.stopped(v, "")
		return
	}
	s.mu.Lock()
	v.machine = m
	going := v.Provisioning != "Creating"
	v.Power = "starting"
	s.mu.Unlock()
	if !going {
		if err := m.Start(ctx); err != nil {
			s.opt.Logger.Error("armsim: VM did not start", "vm", v.Name, "err", err)
		}
		s.mu.Lock()
		if v.Provisioning == "Creating" {
			v.Provisioning, v.Power = "Succeeded", "running"
		}
		s.mu.Unlock()
	}
	m.Wait()
	s.stopped(v, m.Finish())
}

// stopped records that a VM's machine is off: powered off from inside,
// it stays allocated (and billed), as on Azure.
func (s *Server) stopped(v *VM, console string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer close(v.off)
	v.Console, v.machine = console, nil
	if v.Ended.IsZero() {
		v.Ended = time.Now()
	}
	if v.Provisioning != "Deleting" {
		v.Provisioning, v.Power = "Succeeded", "stopped"
	}
}

// end stops a VM's machine and, when deleted, removes it and what goes
// with it.
func (s *Server) end(v *VM, deleted bool) {
	s.mu.Lock()
	m := v.machine
	s.mu.Unlock()
	if m != nil {
		m.Stop()
		<-v.off // its container removed
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if v.Ended.IsZero() {
		v.Ended = time.Now()
	}
	if deleted && v.Deleted.IsZero() {
		v.Deleted = time.Now()
		delete(s.vms, key(v.Group, v.Name))
		for r, goes := range v.Resources {
			if goes {
				delete(v.Resources, r)
			}
		}
	}
}

// Evict gives a Spot VM its Preempt event, and evicts it (deletes it,
// evictionPolicy Delete) once notice has passed or the VM approved the
// event.
func (s *Server) Evict(name string, notice time.Duration) error {
	s.mu.Lock()
	var v *VM
	for _, c := range s.order {
		if c.Name == name && c.Deleted.IsZero() {
			v = c
		}
	}
	if v == nil || v.Priority != "Spot" {
		s.mu.Unlock()
		return fmt.Errorf("armsim: no Spot VM %s", name)
	}
	v.evict = make(chan struct{})
	v.events = append(v.events, scheduledEvent{EventID: strings.ToUpper(uuid.NewString()), EventType: "Preempt", ResourceType: "VirtualMachine",
		Resources: []string{name}, EventStatus: "Scheduled", NotBefore: time.Now().Add(notice).UTC().Format(http.TimeFormat),
		Description: "Spot VM eviction", EventSource: "Platform", DurationInSeconds: -1})
	ack := v.evict
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		select {
		case <-time.After(notice):
		case <-ack:
		}
		s.mu.Lock()
		v.Evicted, v.Provisioning = time.Now(), "Deleting"
		for i := range v.events {
			v.events[i].EventStatus = "Started"
		}
		s.mu.Unlock()
		time.Sleep(time.Second)
		s.end(v, true)
	}()
	return nil
}

// imds answers a VM's Instance Metadata Service: instance/compute, and
// Scheduled Events (GET, and POST to approve events).
func (s *Server) imds(v *VM, w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Metadata") != "true" {
		http.Error(w, `{"error":"Bad request. Required metadata header not specified"}`, http.StatusBadRequest)
		return
	}
	if r.URL.Path == "/metadata/scheduledevents" && !s.eventsEnabled(r.Context(), v) {
		return // the caller went away
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case r.URL.Path == "/metadata/instance/compute" && r.Method == http.MethodGet:
		_ = json.NewEncoder(w).Encode(map[string]string{"name": v.Name, "location": v.Location, "vmSize": v.Size, "resourceGroupName": v.Group,
			"subscriptionId": Subscription, "priority": v.Priority})
	case r.URL.Path == "/metadata/attested/document" && r.Method == http.MethodGet:
		s.attested(v, w, r)
	case r.URL.Path == "/metadata/scheduledevents" && r.Method == http.MethodGet:
		_ = json.NewEncoder(w).Encode(map[string]any{"DocumentIncarnation": len(v.events), "Events": append([]scheduledEvent{}, v.events...)})
	case r.URL.Path == "/metadata/scheduledevents" && r.Method == http.MethodPost:
		var body struct {
			StartRequests []struct {
				EventID string `json:"EventId"`
			} `json:"StartRequests"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		for _, sr := range body.StartRequests {
			for _, e := range v.events {
				if e.EventID == sr.EventID && e.EventType == "Preempt" && v.evict != nil {
					select {
					case <-v.evict:
					default:
						close(v.evict)
					}
				}
			}
		}
	default:
		http.NotFound(w, r)
	}
}

// eventsEnabled waits until a VM's Scheduled Events answer: the first
// call enables them, and it and every call after wait out EventsDelay
// from it. It reports false when ctx ends first.
func (s *Server) eventsEnabled(ctx context.Context, v *VM) bool {
	s.mu.Lock()
	if v.eventsOn.IsZero() {
		d := s.opt.EventsDelay
		if d == 0 {
			d = 90 * time.Second
		}
		v.eventsOn = time.Now().Add(d)
	}
	wait := time.Until(v.eventsOn)
	s.mu.Unlock()
	if wait <= 0 {
		return true
	}
	select {
	case <-time.After(wait):
		return true
	case <-ctx.Done():
		return false
	}
}

// VMs lists every VM made, deleted ones too.
func (s *Server) VMs() []VM {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]VM, 0, len(s.order))
	for _, v := range s.order {
		c := *v
		c.Tags = maps.Clone(v.Tags)
		c.Resources = maps.Clone(v.Resources)
		out = append(out, c)
	}
	return out
}

// Leftovers are the NICs, public addresses and disks still there, of
// deleted VMs too, and the auto-shutdown schedules.
func (s *Server) Leftovers() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, v := range s.order {
		for r := range v.Resources {
			out = append(out, v.Group+"/"+r)
		}
	}
	for _, sc := range s.scheds {
		out = append(out, sc.Group+"/"+sc.Name)
	}
	slices.Sort(out)
	return out
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
