package pool

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/record"
)

// memHistory applies what the pool tells at once.
type memHistory struct {
	mu   sync.Mutex
	recs map[int64]*record.Record
}

func (h *memHistory) Add(r record.Record) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs[r.Registration] = &r
}

func (h *memHistory) Update(_ string, reg int64, change func(*record.Record) bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if r, ok := h.recs[reg]; ok {
		change(r)
	}
}

func (h *memHistory) Drop(_ string, reg int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.recs, reg)
}

func (h *memHistory) get(reg int64) record.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	if r, ok := h.recs[reg]; ok {
		return *r
	}
	return record.Record{}
}

// TestRecordsFollowTheRunner: each runner's machine gets its record, and
// the history learns when it came online, took its job and ended; a
// runner whose machine failed to start leaves no record.
func TestRecordsFollowTheRunner(t *testing.T) {
	hist := &memHistory{recs: map[int64]*record.Record{}}
	h := newHarness(t, Config{Size: 1, Record: &record.Record{ManagerVersion: "v1", Forge: "local", ForgeType: "gitea", Provider: "fake"}, History: hist})
	h.prov.failNext = errors.New("engine unreachable")
	h.settle()
	if _, ok := hist.recs[1]; ok {
		t.Fatalf("a runner that failed to start has a record: %+v", hist.recs[1])
	}
	h.clk.Add(10 * time.Second) // past the backoff
	h.settle()
	spec := h.prov.specs["gpu-1"]
	if spec.Record == nil || spec.Record.Runner != "gpu-1" || spec.Record.Registration != 2 || spec.Record.ManagerVersion != "v1" || spec.Record.Pool != "gpu" {
		t.Fatalf("the machine's spec carries the record %+v", spec.Record)
	}
	r := hist.get(2)
	if r.Runner != "gpu-1" || r.Machine.ID == "" || !r.Online.IsZero() || r.System == nil || r.System.Kernel != "6.1.0-fake" {
		t.Fatalf("record after create (the provider's system kept): %+v", r)
	}
	h.online()
	h.clk.Add(time.Second)
	h.settle()
	if r := hist.get(2); r.Online.IsZero() || !r.JobStarted.IsZero() {
		t.Fatalf("record of an idle runner: %+v", r)
	}
	h.forge.set("gpu-1", forge.StatusBusy)
	h.clk.Add(time.Second)
	h.settle()
	if r := hist.get(2); r.JobStarted.IsZero() || !r.Ended.IsZero() {
		t.Fatalf("record of a busy runner: %+v", r)
	}
	h.forge.finish("gpu-1", h.prov)
	h.clk.Add(time.Second)
	h.settle()
	r = hist.get(2)
	if r.Ended.IsZero() || !r.Online.Before(r.JobStarted) || !r.JobStarted.Before(r.Ended) {
		t.Fatalf("record of an ended runner: %+v", r)
	}
	if next := hist.get(3); next.Runner != "gpu-1" || !next.Ended.IsZero() {
		t.Fatalf("the slot's next runner: %+v", next)
	}
}

// TestRecordOfRunnerGoneBetweenPasses: a runner that ran its whole job
// between two passes, its machine and registration gone, still ends in
// its record.
func TestRecordOfRunnerGoneBetweenPasses(t *testing.T) {
	hist := &memHistory{recs: map[int64]*record.Record{}}
	h := newHarness(t, Config{Size: 1, Record: &record.Record{Forge: "local"}, History: hist})
	h.settle()
	h.forge.finish("gpu-1", h.prov)
	h.prov.mu.Lock()
	delete(h.prov.insts, "gpu-1") // removed with its exit, as AutoRemove does
	h.prov.mu.Unlock()
	h.clk.Add(time.Second)
	h.settle()
	if r := hist.get(1); r.Ended.IsZero() {
		t.Fatalf("record of a runner gone between passes: %+v", r)
	}
	if r := hist.get(2); r.Runner != "gpu-1" || !r.Ended.IsZero() {
		t.Fatalf("its successor: %+v", r)
	}
}
