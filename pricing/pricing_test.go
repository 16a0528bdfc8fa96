package pricing

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// list is a price list: a price by type, and the calls it got.
type list struct {
	mu     sync.Mutex
	prices map[string]float64
	fail   error // every call fails so while set
	calls  []string
}

func (l *list) Price(_ context.Context, m record.Machine, at time.Time) (record.Price, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, fmt.Sprintf("%s %s %v %s", m.InstanceType, m.Zone, m.Spot, at.Format("15:04")))
	if l.fail != nil {
		return record.Price{}, l.fail
	}
	p, ok := l.prices[m.InstanceType]
	if !ok {
		return record.Price{}, fmt.Errorf("%s: %w", m.InstanceType, provider.ErrNotPriced)
	}
	if m.Spot {
		p /= 4
	}
	return record.Price{PerHour: p, Currency: "USD", Source: "test list"}, nil
}

type setter struct {
	mu  sync.Mutex
	got map[int64]record.Price
}

func (s *setter) set(_ string, reg int64, p record.Price) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got[reg] = p
}

func newFiller(l *list, now *time.Time) (*Filler, *setter) {
	s := &setter{got: map[int64]record.Price{}}
	f := &Filler{
		Pricer: func(pool string) provider.Pricer {
			if pool == "cloud" {
				return l
			}
			return nil
		},
		Set: s.set,
		Now: func() time.Time { return *now },
	}
	return f, s
}

var t0 = time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)

func machine(reg int64, typ string, spot bool, created time.Time) record.Record {
	return record.Record{
		ID: fmt.Sprint("r", reg), Pool: "cloud", Forge: "gh", Registration: reg, Created: created,
		Machine: record.Machine{InstanceType: typ, Zone: "us-east-1a", Spot: spot},
	}
}

func TestRecordsPricedOnceForEachMachineKind(t *testing.T) {
	l := &list{prices: map[string]float64{"g5.xlarge": 1.2}}
	now := t0
	f, s := newFiller(l, &now)
	// Three on-demand machines of one type: one call.
	for reg := int64(1); reg <= 3; reg++ {
		f.Observe(machine(reg, "g5.xlarge", false, t0.Add(time.Duration(reg)*time.Minute)))
	}
	// Spot ones of the same type, in two hours: one call each hour.
	f.Observe(machine(4, "g5.xlarge", true, t0.Add(10*time.Minute)))
	f.Observe(machine(5, "g5.xlarge", true, t0.Add(50*time.Minute)))
	f.Observe(machine(6, "g5.xlarge", true, t0.Add(70*time.Minute)))
	// Not priced from a list: a type or zone not known yet, a record
	// priced by its pool's config, a pool whose provider has no list.
	f.Observe(machine(7, "", false, t0))
	nozone := machine(10, "g5.xlarge", true, t0)
	nozone.Machine.Zone = ""
	f.Observe(nozone)
	priced := machine(8, "g5.xlarge", false, t0)
	priced.Price = &record.Price{PerHour: 9, Source: "price_per_hour"}
	f.Observe(priced)
	docker := machine(9, "g5.xlarge", false, t0)
	docker.Pool = "local"
	f.Observe(docker)
	f.Fill(context.Background())

	if len(l.calls) != 3 {
		t.Errorf("the list was asked %d times: %v; want 3 (on demand, and Spot at 10:xx and 11:xx)", len(l.calls), l.calls)
	}
	for reg := int64(1); reg <= 3; reg++ {
		if p := s.got[reg]; p.PerHour != 1.2 || p.Currency != "USD" || p.Source != "test list" {
			t.Errorf("record %d priced %+v, want 1.2 USD from the list", reg, p)
		}
	}
	for reg := int64(4); reg <= 6; reg++ {
		if p := s.got[reg]; p.PerHour != 0.3 {
			t.Errorf("Spot record %d priced %+v, want 0.3", reg, p)
		}
	}
	for _, reg := range []int64{7, 8, 9, 10} {
		if p, ok := s.got[reg]; ok {
			t.Errorf("record %d was priced from the list: %+v", reg, p)
		}
	}
	// Record 7's type, once known, is priced from the answer kept.
	f.Observe(machine(7, "g5.xlarge", false, t0))
	f.Fill(context.Background())
	if p := s.got[7]; p.PerHour != 1.2 || len(l.calls) != 3 {
		t.Errorf("record 7: %+v after %d calls; want 1.2 from the answer kept", p, len(l.calls))
	}
}

func TestFailedListAskedAgainWithBackoff(t *testing.T) {
	l := &list{prices: map[string]float64{"p5.48xlarge": 98.32}, fail: errors.New("503 Service Unavailable")}
	now := t0
	f, s := newFiller(l, &now)
	f.Observe(machine(1, "p5.48xlarge", false, t0))
	f.Fill(context.Background())
	f.Fill(context.Background()) // within the backoff: not asked
	if len(l.calls) != 1 || len(s.got) != 0 {
		t.Fatalf("after a failure: %d calls, %d priced; want 1 and 0", len(l.calls), len(s.got))
	}
	now = now.Add(firstRetry + time.Second)
	f.Fill(context.Background())
	if len(l.calls) != 2 {
		t.Fatalf("%d calls %s after the failure, want 2", len(l.calls), firstRetry)
	}
	// The second failure waits twice as long.
	now = now.Add(firstRetry + time.Second)
	f.Fill(context.Background())
	if len(l.calls) != 2 {
		t.Errorf("%d calls: the second failure's wait is not doubled", len(l.calls))
	}
	l.fail = nil
	now = now.Add(firstRetry)
	f.Fill(context.Background())
	if p := s.got[1]; p.PerHour != 98.32 {
		t.Errorf("after the list came back: %+v", p)
	}
}

func TestUnlistedMachineNotAskedAgain(t *testing.T) {
	l := &list{prices: map[string]float64{}}
	now := t0
	f, s := newFiller(l, &now)
	f.Observe(machine(1, "x9.huge", false, t0))
	f.Fill(context.Background())
	f.Observe(machine(2, "x9.huge", false, t0))
	now = now.Add(time.Hour)
	f.Fill(context.Background())
	if len(l.calls) != 1 || len(s.got) != 0 {
		t.Errorf("a type the list has not: %d calls, %d priced; want 1 call for the day and none priced", len(l.calls), len(s.got))
	}
	// Refused for a day only: a list that adds the type is asked again.
	l.prices["x9.huge"] = 3
	now = now.Add(keep)
	f.Observe(machine(3, "x9.huge", false, t0))
	f.Fill(context.Background())
	if len(l.calls) != 2 || s.got[3].PerHour != 3 {
		t.Errorf("a day later: %d calls, record 3 priced %+v", len(l.calls), s.got[3])
	}
}

func TestRunPricesWhatComes(t *testing.T) {
	l := &list{prices: map[string]float64{"n1-standard-4": 0.19}}
	s := &setter{got: map[int64]record.Price{}}
	f := &Filler{Pricer: func(string) provider.Pricer { return l }, Set: s.set}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.Run(ctx)
	}()
	f.Observe(machine(1, "n1-standard-4", false, time.Now()))
	deadline := time.Now().Add(10 * time.Second)
	for {
		s.mu.Lock()
		p := s.got[1]
		s.mu.Unlock()
		if p.PerHour == 0.19 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Run did not price a record it was told of")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
}
