// Package tally keeps what the status page and the cost counters need of
// a manager's recent records (package record) in memory, and sums them:
// runners by state over time, queue waits and job durations per interval,
// GPU time and cost by pool within an interval, and `runfleet jobs --by`'s
// sums over records.
//
// A Window follows the history as it is written (history.Options.Observe),
// so that drawing the page reads no file: a page over ten thousand records
// decodes none of them.
package tally

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/runfleet/runfleet/record"
)

// Entry is what a Window keeps of one record: its times, its job's, what
// it held and what it cost, and no more.
type Entry struct {
	ID, Forge, Pool, Runner string
	Registration            int64
	Created, Online         time.Time
	JobStarted, Ended       time.Time
	GPUs                    int
	// Where is the machine, for a runner with GPUs (a node, an instance,
	// a host), and GPUList its GPUs: the status page's GPU panel shows
	// those held elsewhere than on the manager's host.
	Where    string
	GPUList  []record.GPU
	Priced   bool // PerHour is known
	PerHour  float64
	Currency string
	Job      *JobEntry // nil until the forge names the job
}

// JobEntry is what an Entry keeps of its job.
type JobEntry struct {
	ID                         int64
	Name, Status, Conclusion   string
	Queued, Started, Completed time.Time
}

// EntryOf takes what a Window keeps of r.
func EntryOf(r record.Record) Entry {
	e := Entry{
		ID: r.ID, Forge: r.Forge, Pool: r.Pool, Runner: r.Runner, Registration: r.Registration,
		Created: r.Created, Online: r.Online, JobStarted: r.JobStarted, Ended: r.Ended,
		GPUs: len(r.GPUs),
	}
	if len(r.GPUs) > 0 {
		m := r.Machine
		e.Where, e.GPUList = cmp.Or(m.Node, m.ID, m.Host), r.GPUs
	}
	if r.Price != nil {
		e.Priced, e.PerHour, e.Currency = true, r.Price.PerHour, r.Price.Currency
	}
	if j := r.Job; j != nil {
		e.Job = &JobEntry{ID: j.ID, Name: j.Name, Status: j.Status, Conclusion: j.Conclusion, Queued: j.Queued, Started: j.Started, Completed: j.Completed}
	}
	return e
}

// Held is how long the entry's machine was held up to now.
func (e Entry) Held(now time.Time) time.Duration {
	end := e.Ended
	if end.IsZero() || end.After(now) {
		end = now
	}
	if end.Before(e.Created) {
		return 0
	}
	return end.Sub(e.Created)
}

// Cost is what the machine cost up to now.
func (e Entry) Cost(now time.Time) float64 { return e.PerHour * e.Held(now).Hours() }

// GPUSeconds is the GPU time held up to now.
func (e Entry) GPUSeconds(now time.Time) float64 { return float64(e.GPUs) * e.Held(now).Seconds() }

type regKey struct {
	forge string
	reg   int64
}

// Window holds the entries of the records created within its span of
// now, newest last. Its methods are safe to call from several
// goroutines.
type Window struct {
	span time.Duration
	now  func() time.Time
	// Ended, when set, is told each entry seen to end (not those loaded
	// ended), outside the window's lock: the cost counters add it. It
	// is told again, with priceOnly, of an ended entry whose price came
	// after its end (read from a cloud's price list in the background).
	ended func(e Entry, priceOnly bool)

	mu      sync.Mutex
	entries []Entry // by creation, then ID
	byID    map[string]int
	byReg   map[regKey]string
}

// NewWindow keeps the records created within span of now; ended, when
// not nil, is told each record seen to end, and each priced after it
// ended.
func NewWindow(span time.Duration, ended func(e Entry, priceOnly bool)) *Window {
	return &Window{span: span, now: time.Now, ended: ended, byID: map[string]int{}, byReg: map[regKey]string{}}
}

// Load adds records read from the history (any order), without telling
// ended: they ended before this manager watched.
func (w *Window) Load(recs []record.Record) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, r := range recs {
		w.put(EntryOf(r))
	}
	w.reindex()
}

// Observe takes a record as the history wrote it, or its removal.
func (w *Window) Observe(r record.Record, dropped bool) {
	var endedNow *Entry
	priceOnly := false
	w.mu.Lock()
	if dropped {
		w.drop(r.ID)
	} else {
		e := EntryOf(r)
		i, ok := w.byID[e.ID]
		switch {
		case e.Ended.IsZero():
		case !ok || w.entries[i].Ended.IsZero():
			endedNow = &e
		case !w.entries[i].Priced && e.Priced:
			endedNow, priceOnly = &e, true
		}
		if w.put(e) {
			w.reindex()
		}
	}
	w.trim()
	w.mu.Unlock()
	if endedNow != nil && w.ended != nil {
		w.ended(*endedNow, priceOnly)
	}
}

// put sets an entry in place, or appends it; it reports whether the
// order must be made again. Called with w.mu held.
func (w *Window) put(e Entry) bool {
	if i, ok := w.byID[e.ID]; ok {
		w.entries[i] = e
		return false
	}
	if e.Registration != 0 {
		w.byReg[regKey{e.Forge, e.Registration}] = e.ID
	}
	w.entries = append(w.entries, e)
	n := len(w.entries)
	w.byID[e.ID] = n - 1
	return n > 1 && byCreation(w.entries[n-1], w.entries[n-2]) < 0
}

// byCreation orders entries as the window keeps them: by creation, then
// ID.
func byCreation(a, b Entry) int {
	return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.ID, b.ID))
}

// reindex sorts the entries and numbers them again. Called with w.mu held.
func (w *Window) reindex() {
	slices.SortFunc(w.entries, byCreation)
	for i, e := range w.entries {
		w.byID[e.ID] = i
	}
}

// drop removes an entry. Called with w.mu held.
func (w *Window) drop(id string) {
	i, ok := w.byID[id]
	if !ok {
		return
	}
	e := w.entries[i]
	delete(w.byID, id)
	delete(w.byReg, regKey{e.Forge, e.Registration})
	w.entries = slices.Delete(w.entries, i, i+1)
	for j := i; j < len(w.entries); j++ {
		w.byID[w.entries[j].ID] = j
	}
}

// trim forgets the entries created before the span. Called with w.mu
// held.
func (w *Window) trim() {
	cut := w.now().Add(-w.span)
	n := 0
	for n < len(w.entries) && w.entries[n].Created.Before(cut) {
		e := w.entries[n]
		delete(w.byID, e.ID)
		delete(w.byReg, regKey{e.Forge, e.Registration})
		n++
	}
	if n == 0 {
		return
	}
	w.entries = slices.Delete(w.entries, 0, n)
	for i, e := range w.entries {
		w.byID[e.ID] = i
	}
}

// Since returns a copy of the entries created at or after t, oldest
// first.
func (w *Window) Since(t time.Time) []Entry {
	w.mu.Lock()
	defer w.mu.Unlock()
	i, _ := slices.BinarySearchFunc(w.entries, t, func(e Entry, t time.Time) int { return e.Created.Compare(t) })
	return slices.Clone(w.entries[i:])
}

// Find names the record of a forge's registration; "" when the window
// holds none.
func (w *Window) Find(forge string, reg int64) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byReg[regKey{forge, reg}]
}

// Len is how many entries the window holds.
func (w *Window) Len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.entries)
}
