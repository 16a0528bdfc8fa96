package vm

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

var (
	errFull   = errors.New("full")
	errNo     = errors.New("not offered")
	errBusy   = errors.New("rate")
	errBroken = errors.New("broken")
	errDenied = errors.New("denied")
)

func judgeTest(err error) (Outcome, string, string) {
	switch err {
	case errFull:
		return NoCapacity, "FULL", ""
	case errNo:
		return Refused, "NO", "not offered here"
	case errBusy:
		return Throttled, "RATE", ""
	case errDenied:
		return Halt, "DENIED", ""
	}
	return Transient, "", ""
}

// Choices are tried Spot first, type by type, place by place, then
// standard; refusals everywhere reject; a throttle or a transient error
// stops at once, and a halt rejects at once; a batch that made fewer
// asks the next choice for the rest.
func TestPlacementOrder(t *testing.T) {
	pl := Placement{Spot: true, Fallback: true, Types: []string{"a", "b"}, Places: []string{"x", "y"}, What: "make", Standard: "regular",
		Limit: "the cloud's request limit", Judge: judgeTest, Logger: slog.New(slog.DiscardHandler)}
	var tried []string
	err := pl.Try("r", func(spot bool, typ, place string) error {
		tried = append(tried, market(spot)+typ+place)
		if !spot && typ == "b" && place == "x" {
			return nil
		}
		return errFull
	})
	if want := "sax say sbx sby rax ray rbx"; err != nil || strings.Join(tried, " ") != want {
		t.Errorf("tried %v (%v)", tried, err)
	}
	pl.Fallback = false
	err = pl.Try("r", func(bool, string, string) error { return errFull })
	if err == nil || !strings.Contains(err.Error(), "no capacity: spot a in x: FULL") || !strings.Contains(err.Error(), "spot_fallback: on_demand would fall back to regular machines") {
		t.Errorf("none anywhere: %v", err)
	}
	err = pl.Try("r", func(bool, string, string) error { return errNo })
	if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "a in x: not offered here") {
		t.Errorf("refused everywhere: %v", err)
	}
	n := 0
	for _, e := range []error{errBusy, errBroken} {
		n = 0
		err = pl.Try("r", func(bool, string, string) error { n++; return e })
		if n != 1 || err == nil || errors.Is(err, provider.ErrRejected) {
			t.Errorf("%v: %d tries, %v", e, n, err)
		}
	}
	n = 0
	err = pl.Try("r", func(bool, string, string) error { n++; return errDenied })
	if n != 1 || !errors.Is(err, provider.ErrRejected) || !errors.Is(err, errDenied) {
		t.Errorf("a halt: %d tries, %v", n, err)
	}
	left := 5
	tried = nil
	err = pl.Try("5 runners", func(spot bool, typ, place string) error {
		tried = append(tried, market(spot)+typ+place)
		asked := left
		left = max(left-2, 0)
		if left > 0 {
			return &fewer{made: asked - left, asked: asked}
		}
		return nil
	})
	if err != nil || strings.Join(tried, " ") != "sax say sbx" {
		t.Errorf("a batch of 5, 2 made a choice: tried %v (%v)", tried, err)
	}
}

func market(spot bool) string {
	if spot {
		return "s"
	}
	return "r"
}

// The book shows what was asked for until listed, hides what was deleted,
// and says what changed and what vanished.
func TestBook(t *testing.T) {
	var b Book[string]
	now := time.Now()
	e := func(id, name string, st provider.State) Entry[string] {
		return Entry[string]{Inst: provider.Instance{ID: id, Name: name, State: st, Created: now}, Data: "z"}
	}
	b.Launched(e("m1", "r-1", provider.StateCreated))
	if inst, ok := b.Live("r-1"); !ok || inst.ID != "m1" {
		t.Fatalf("launched not live: %v", inst)
	}
	var vanished []string
	note := func(id string, old Entry[string], cur *Entry[string], deleted bool) {
		if cur == nil && !deleted {
			vanished = append(vanished, id)
		}
	}
	changed, known := b.Update([]Entry[string]{e("m1", "r-1", provider.StateRunning), e("m2", "r-2", provider.StateRunning)}, now, note)
	if len(changed) != 2 || !known("m1") || known("m3") {
		t.Errorf("changed %v", changed)
	}
	b.Deleted("m2", now)
	if got := b.Instances(); len(got) != 1 || got[0].ID != "m1" {
		t.Errorf("after delete: %v", got)
	}
	b.Update(nil, now.Add(time.Second), note)
	if len(vanished) != 1 || vanished[0] != "m1" {
		t.Errorf("vanished %v, want m1 only (m2 was deleted here)", vanished)
	}
	if !b.Stale(now.Add(time.Hour), time.Minute) || b.Stale(now.Add(time.Second), time.Minute) {
		t.Error("staleness")
	}
}

// One value per key, made once.
func TestShared(t *testing.T) {
	made := 0
	s := Shared[*int]{New: func() *int { made++; return new(int) }}
	if a, b, c := s.Get("p"), s.Get("p"), s.Get("q"); a != b || a == c || made != 2 {
		t.Errorf("same key: %v, other key: %v, made %d", a == b, a == c, made)
	}
}

// With a record, the boot data is made again at each choice, naming
// where that choice places the machine; boot data that cannot be made is
// refused before any choice.
func TestTryBootRecordsEachChoice(t *testing.T) {
	pl := Placement{Spot: true, Types: []string{"a"}, Places: []string{"x", "y"}, What: "make", Standard: "regular",
		Limit: "the cloud's request limit", Judge: judgeTest, Logger: slog.New(slog.DiscardHandler)}
	spec := provider.Spec{Name: "r", Record: &record.Record{}}
	var boots []string
	err := TryBoot(pl, spec, "img", func() (string, error) {
		return "zone=" + spec.Record.Machine.Zone, nil
	}, func(_ bool, _, place, boot string) error {
		boots = append(boots, boot)
		if place == "x" {
			return errFull
		}
		return nil
	})
	if err != nil || strings.Join(boots, ",") != "zone=x,zone=y" || spec.Record.Machine.Image != "img" || !spec.Record.Machine.Spot {
		t.Errorf("boots %v, record %+v (%v): want each choice's own", boots, spec.Record.Machine, err)
	}
	err = TryBoot(pl, provider.Spec{Name: "r"}, "img", func() (string, error) { return "", errBroken }, func(bool, string, string, string) error {
		t.Error("tried with no boot data")
		return nil
	})
	if !errors.Is(err, provider.ErrRejected) || !errors.Is(err, errBroken) {
		t.Errorf("boot data that cannot be made: %v, want rejected", err)
	}
}
