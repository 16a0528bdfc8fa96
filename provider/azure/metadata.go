package azure

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// MaxCustomData is Azure's limit on a VM's custom data (the bytes before
// base64).
const MaxCustomData = 65535

// customData is the VM's boot script (vm.Boot), run by cloud-init from
// the custom data, with evictions read from Scheduled Events.
func customData(s Section, h *bootstrap.Handoff, spec provider.Spec, now time.Time, idle, lifetime time.Duration) ([]byte, error) {
	return boot(s, h, idle, lifetime).Script(spec, now)
}

func boot(s Section, h *bootstrap.Handoff, idle, lifetime time.Duration) vm.Boot {
	return vm.Boot{
		Cloud: "Azure", Notices: "azure", Limit: MaxCustomData, Runfleet: s.Runfleet, Workdir: s.Workdir, Install: s.Install,
		StartupScript: s.StartupScript, SSHPublicKey: s.SSHPublicKey, IdleTimeout: idle, Lifetime: lifetime, Handoff: h,
	}
}

// boot is the pool's vm.Boot with handoff h.
func (p *Provider) boot(h *bootstrap.Handoff) vm.Boot {
	return boot(p.opt.Section, h, p.opt.IdleTimeout, p.opt.Lifetime)
}

// IMDSEnv names the Instance Metadata Service's address (host:port) when
// it is not Azure's link-local one: a stand-in's.
const IMDSEnv = "RUNFLEET_AZURE_IMDS"

// ScheduledEventsVersion is the Scheduled Events API version read.
const ScheduledEventsVersion = "2020-07-01"

// ScheduledEvents is the VM side's view of Azure's Scheduled Events
// (Instance Metadata Service): a Preempt event comes 30 s before a Spot
// VM is evicted; Terminate, Redeploy and Freeze for the VM name platform
// maintenance. Once the agent has stopped, the Preempt event is
// approved, so that Azure evicts the VM at once and the manager sees it
// sooner.
type ScheduledEvents struct {
	base string
	c    *http.Client

	mu      sync.Mutex
	name    string // this VM's name
	preempt string // the Preempt event's id, once seen
}

var (
	_ bootstrap.Paced    = (*ScheduledEvents)(nil)
	_ bootstrap.Releaser = (*ScheduledEvents)(nil)
)

func init() {
	bootstrap.RegisterNotices("azure", func() bootstrap.Notices { return NewScheduledEvents() })
}

// NewScheduledEvents is the service at its link-local address, or at
// RUNFLEET_AZURE_IMDS when that is set.
func NewScheduledEvents() *ScheduledEvents {
	host := imdsHost()
	// The metadata service is never reached through a proxy. Each call's
	// context bounds it (Pace): the first may take minutes.
	tr := &http.Transport{Proxy: nil}
	return &ScheduledEvents{base: "http://" + host, c: &http.Client{Transport: tr}}
}

// imdsHost is the Instance Metadata Service's host: Azure's link-local
// address, or RUNFLEET_AZURE_IMDS.
func imdsHost() string {
	if h := os.Getenv(IMDSEnv); h != "" {
		return h
	}
	return "169.254.169.254"
}

// Pace asks every second, as Azure advises for the 30 s of a Preempt
// event, and waits up to two and a half minutes for an answer: the first
// call enables Scheduled Events for the VM and can take up to two minutes
// (learn.microsoft.com/azure/virtual-machines/linux/scheduled-events,
// "Enabling and disabling Scheduled Events" and "Polling frequency").
func (s *ScheduledEvents) Pace() (interval, timeout time.Duration) {
	return time.Second, 150 * time.Second
}

// event is one of Scheduled Events' documented fields.
type event struct {
	EventID      string   `json:"EventId"`
	EventType    string   `json:"EventType"`
	ResourceType string   `json:"ResourceType"`
	Resources    []string `json:"Resources"`
	EventStatus  string   `json:"EventStatus"`
	NotBefore    string   `json:"NotBefore"`
	EventSource  string   `json:"EventSource"`
}

func (s *ScheduledEvents) get(ctx context.Context, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.base+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Metadata", "true")
	resp, err := s.c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", path, resp.Status)
	}
	return json.Unmarshal(b, out)
}

// events returns this VM's scheduled events.
func (s *ScheduledEvents) events(ctx context.Context) ([]event, error) {
	s.mu.Lock()
	name := s.name
	s.mu.Unlock()
	if name == "" {
		var compute struct {
			Name string `json:"name"`
		}
		if err := s.get(ctx, "/metadata/instance/compute?api-version=2021-02-01", &compute); err != nil {
			return nil, fmt.Errorf("instance metadata: %w", err)
		}
		s.mu.Lock()
		s.name, name = compute.Name, compute.Name
		s.mu.Unlock()
	}
	var doc struct {
		Events []event `json:"Events"`
	}
	if err := s.get(ctx, "/metadata/scheduledevents?api-version="+ScheduledEventsVersion, &doc); err != nil {
		return nil, fmt.Errorf("scheduled events: %w", err)
	}
	var mine []event
	for _, e := range doc.Events {
		for _, r := range e.Resources {
			if strings.EqualFold(r, name) {
				mine = append(mine, e)
				break
			}
		}
	}
	return mine, nil
}

func (s *ScheduledEvents) Interruption(ctx context.Context) (time.Time, bool, error) {
	evs, err := s.events(ctx)
	if err != nil {
		return time.Time{}, false, err
	}
	for _, e := range evs {
		if e.EventType != "Preempt" {
			continue
		}
		s.mu.Lock()
		s.preempt = e.EventID
		s.mu.Unlock()
		at, err := time.Parse(time.RFC1123, e.NotBefore)
		if err != nil {
			at = time.Now().Add(EvictionNotice) // Started: NotBefore is empty
		}
		return at, true, nil
	}
	return time.Time{}, false, nil
}

// Rebalance reports maintenance that will stop or move the VM: an idle
// runner ends, a busy one finishes its job if it can.
func (s *ScheduledEvents) Rebalance(ctx context.Context) (bool, error) {
	evs, err := s.events(ctx)
	if err != nil {
		return false, err
	}
	for _, e := range evs {
		switch e.EventType {
		case "Terminate", "Redeploy", "Freeze":
			if e.EventSource != "User" {
				return true, nil
			}
		}
	}
	return false, nil
}

// Release approves the Preempt event once the agent has stopped: Azure
// then evicts the VM without waiting out the notice.
func (s *ScheduledEvents) Release(ctx context.Context) error {
	s.mu.Lock()
	id := s.preempt
	s.mu.Unlock()
	if id == "" {
		return nil
	}
	body, _ := json.Marshal(map[string]any{"StartRequests": []map[string]string{{"EventId": id}}})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+"/metadata/scheduledevents?api-version="+ScheduledEventsVersion, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Metadata", "true")
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.c.Do(req)
	if err != nil {
		return fmt.Errorf("approve event %s: %w", id, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("approve event %s: %s", id, resp.Status)
	}
	return nil
}
