// Package pricing prices runners' records from their clouds' price lists.
// A Filler sees each record the history writes; once a record without a
// price names its machine's type, it asks the pool's provider
// (provider.Pricer) what that machine costs and writes the answer into
// the record. It asks in the background, one call at a time, so that no
// pass waits on a price list, and keeps each answer: an on-demand price
// for a day, a Spot price for the hour it was in effect (a record is
// priced as at its machine's creation). A list that fails is asked
// again with backoff; one that refuses (no such type, no permission) is
// not asked again for the same machine for a day.
package pricing

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

const (
	// callTimeout bounds one call of a price list.
	callTimeout = 30 * time.Second
	// keep is how long an answer, or a refusal, is kept.
	keep = 24 * time.Hour
	// firstRetry and lastRetry bound the backoff after a failed call.
	firstRetry, lastRetry = 30 * time.Second, 30 * time.Minute
	// tick is how often records waiting for a retry are looked at.
	tick = 5 * time.Second
	// maxPending bounds the records waiting for a price: beyond it the
	// oldest is let go unpriced (a price list down for days under a
	// burst of runners).
	maxPending = 10000
)

// Filler writes the prices of clouds' price lists into records. Set its
// fields before Run; Observe may be called from any goroutine.
type Filler struct {
	// Pricer is the price list of a pool's provider; nil where it has
	// none.
	Pricer func(pool string) provider.Pricer
	// Set writes a price into the record of a forge's registration,
	// where it has none yet.
	Set func(forge string, reg int64, p record.Price)
	Log *slog.Logger
	Now func() time.Time // nil: time.Now

	mu      sync.Mutex
	pending map[string]want // by record ID
	seen    uint64          // records taken in
	answers map[key]*answer
	wake    chan struct{}
}

// want is a record waiting for its price.
type want struct {
	pool, forge string
	reg         int64
	machine     record.Machine
	at          time.Time // the machine's creation
	seen        uint64    // the order records came in
}

// key is what one price answers for: a pool's machines of a type, zone
// and market, and for Spot the hour the price was in effect.
type key struct {
	pool, typ, zone string
	spot            bool
	hour            int64
}

func keyOf(w want) key {
	k := key{pool: w.pool, typ: w.machine.InstanceType, zone: w.machine.Zone, spot: w.machine.Spot}
	if k.spot {
		k.hour = w.at.Unix() / 3600
	}
	return k
}

// answer is what a price list said for a key.
type answer struct {
	price record.Price
	err   error
	final bool      // an error no asking again fixes, for keep
	fails int       // failed calls in a row
	next  time.Time // when to ask again after a failure
	until time.Time // when the answer is dropped
}

func (f *Filler) now() time.Time {
	if f.Now != nil {
		return f.Now()
	}
	return time.Now()
}

func (f *Filler) log() *slog.Logger { return cmp.Or(f.Log, slog.Default()) }

// Observe takes a record as the history wrote it. One without a price
// whose machine's type and zone are known waits for its price (a Spot
// price is a zone's: an EC2 instance's zone, where the cloud chose it,
// comes with the first listing after its launch); one priced (by its
// pool's config, or by the Filler) waits no more.
func (f *Filler) Observe(r record.Record) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.Price != nil || r.Machine.InstanceType == "" || r.Machine.Zone == "" || r.Registration == 0 {
		delete(f.pending, r.ID)
		return
	}
	if f.pending == nil {
		f.pending = map[string]want{}
	}
	w := want{pool: r.Pool, forge: r.Forge, reg: r.Registration, machine: r.Machine, at: r.Created}
	if old, ok := f.pending[r.ID]; ok {
		w.seen = old.seen
	} else {
		f.seen++
		w.seen = f.seen
	}
	f.pending[r.ID] = w
	if len(f.pending) > maxPending {
		f.dropOldest()
	}
	f.signal()
}

// dropOldest lets the record that waited longest go. Called with f.mu
// held.
func (f *Filler) dropOldest() {
	var id string
	var oldest uint64
	for i, w := range f.pending {
		if id == "" || w.seen < oldest {
			id, oldest = i, w.seen
		}
	}
	delete(f.pending, id)
	f.log().Warn("too many records wait for a price from their cloud's price list: one is left unpriced", "record", id, "waiting", maxPending)
}

func (f *Filler) signal() {
	if f.wake == nil {
		f.wake = make(chan struct{}, 1)
	}
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// Run prices the records waiting until ctx ends.
func (f *Filler) Run(ctx context.Context) {
	f.mu.Lock()
	if f.wake == nil {
		f.wake = make(chan struct{}, 1)
	}
	wake := f.wake
	f.mu.Unlock()
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		f.Fill(ctx)
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-t.C:
		}
	}
}

// Fill prices what it can of the records waiting: from the answers kept,
// or by asking their pools' price lists, once for each key.
func (f *Filler) Fill(ctx context.Context) {
	f.mu.Lock()
	f.expire(f.now())
	f.mu.Unlock()
	for _, id := range f.waiting() {
		if ctx.Err() != nil {
			return
		}
		f.mu.Lock()
		w, ok := f.pending[id]
		f.mu.Unlock()
		if !ok {
			continue
		}
		a := f.answerFor(ctx, w)
		if a == nil {
			continue // waits for its next try
		}
		f.mu.Lock()
		if cur, ok := f.pending[id]; ok && keyOf(cur) == keyOf(w) {
			delete(f.pending, id)
		}
		f.mu.Unlock()
		if a.err == nil {
			f.Set(w.forge, w.reg, a.price)
		}
	}
}

// waiting lists the records waiting, oldest first.
func (f *Filler) waiting() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	ids := make([]string, 0, len(f.pending))
	for id := range f.pending {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b string) int { return cmp.Compare(f.pending[a].seen, f.pending[b].seen) })
	return ids
}

// answerFor is the answer for a record: kept, or asked for now. Nil
// where the record must wait (a failed call's backoff, or no answer
// yet); an answer with an error that is final lets the record go
// unpriced.
func (f *Filler) answerFor(ctx context.Context, w want) *answer {
	k := keyOf(w)
	now := f.now()
	f.mu.Lock()
	a := f.answers[k]
	f.mu.Unlock()
	switch {
	case a != nil && (a.err == nil || a.final):
		return a
	case a != nil && now.Before(a.next):
		return nil
	}
	p := f.Pricer(w.pool)
	if p == nil {
		return &answer{err: errors.New("no price list"), final: true}
	}
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	price, err := p.Price(cctx, w.machine, w.at)
	cancel()
	if err != nil && ctx.Err() != nil {
		return nil // stopping: not the list's failure
	}
	got := &answer{price: price, err: err, until: now.Add(keep)}
	log := f.log().With("pool", w.pool, "instance_type", w.machine.InstanceType, "zone", w.machine.Zone, "spot", w.machine.Spot)
	switch {
	case err == nil:
		log.Debug("priced from the cloud's price list", "per_hour", price.PerHour, "currency", price.Currency, "source", price.Source)
	case errors.Is(err, provider.ErrNotPriced) || errors.Is(err, provider.ErrRejected):
		got.final = true
		log.Warn("the cloud's price list gives no price for this machine: its runners' records stay unpriced (set price_per_hour or prices in the pool to price them)", "err", err)
	default:
		got.fails = 1
		if a != nil {
			got.fails = a.fails + 1
		}
		wait := min(firstRetry<<min(got.fails-1, 10), lastRetry)
		got.next = now.Add(wait)
		log.Warn("the cloud's price list could not be read; it is read again at next_try", "err", err, "next_try", got.next.Format(time.TimeOnly))
	}
	f.mu.Lock()
	if f.answers == nil {
		f.answers = map[key]*answer{}
	}
	f.answers[k] = got
	f.mu.Unlock()
	if err != nil && !got.final {
		return nil
	}
	return got
}

// expire drops the answers kept past their time. Called with f.mu held.
func (f *Filler) expire(now time.Time) {
	for k, a := range f.answers {
		if a.err == nil || a.final {
			if now.After(a.until) {
				delete(f.answers, k)
			}
		}
	}
}
