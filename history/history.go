// Package history keeps the records of a manager's runners (package
// record) in an embedded store, go.etcd.io/bbolt: one record per runner,
// updated as its runner comes online, takes a job and ends, and as the
// forge reports the job. It survives restarts, is bounded in count and age,
// and answers "the jobs since" by a seek on keys ordered by time.
//
// The file is opened for each batch of writes and each read, and closed
// after: bbolt locks it only meanwhile, so that `runfleet jobs` reads it
// while a manager runs, and the candidates of a leader election may share
// it (the leader writes; a new leader goes on where the last one stopped).
package history

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/runfleet/runfleet/record"
)

var (
	bucketRecords = []byte("records") // ID -> record JSON, IDs ordered by creation
	bucketRegs    = []byte("regs")    // forge \x00 registration -> ID
	bucketMeta    = []byte("meta")
	keyCount      = []byte("count")
)

// ErrNotFound is returned by Get for an ID the store does not hold.
var ErrNotFound = errors.New("no such record")

// ErrLocked is returned when the file stays locked by another process
// past the wait.
var ErrLocked = errors.New("the history is locked by another process")

// Options bound a store.
type Options struct {
	// MaxRecords is how many records are kept, the oldest dropped first;
	// DefaultMaxRecords when zero.
	MaxRecords int
	// Keep is how long a record is kept; DefaultKeep when zero.
	Keep time.Duration
	// LockWait is how long a write waits for readers to let go of the
	// file; 10s when zero.
	LockWait time.Duration
	Logger   *slog.Logger
	// Now replaces time.Now, for tests.
	Now func() time.Time
	// Observe, when set, is told each record as written once its batch
	// is on disk (dropped: removed), in the writer's goroutine, so that
	// what the manager keeps in memory of its recent records (the status
	// page's) follows the file without reading it back.
	Observe func(r record.Record, dropped bool)
}

// The default bounds: a busy fleet's 100,000 jobs, or 90 days.
const (
	DefaultMaxRecords = 100_000
	DefaultKeep       = 90 * 24 * time.Hour
)

// Store is a manager's history. Its writes are queued and applied in
// batches by one goroutine, so that a pool's pass never waits for a disk.
type Store struct {
	path string
	opt  Options
	log  *slog.Logger
	dbMu sync.Mutex // one open of the file at a time in this process: bbolt's locks are per open

	mu      sync.Mutex
	queue   []op
	wake    chan struct{}
	flushed *sync.Cond // signalled after each batch
	applied uint64     // ops applied so far
	queued  uint64     // ops queued so far
	closed  bool
	done    chan struct{}
}

// op is one queued change: add a record, or change the one of a
// registration.
type op struct {
	add    *record.Record
	forge  string
	reg    int64
	change func(*record.Record) bool
	drop   bool
}

// Open opens (or creates) the store at path for writing.
func Open(path string, opt Options) (*Store, error) {
	if opt.MaxRecords <= 0 {
		opt.MaxRecords = DefaultMaxRecords
	}
	if opt.Keep <= 0 {
		opt.Keep = DefaultKeep
	}
	if opt.LockWait <= 0 {
		opt.LockWait = 10 * time.Second
	}
	if opt.Now == nil {
		opt.Now = time.Now
	}
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	s := &Store{path: path, opt: opt, log: opt.Logger, wake: make(chan struct{}, 1), done: make(chan struct{})}
	err := s.update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketRecords, bucketRegs, bucketMeta} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.flushed = sync.NewCond(&s.mu)
	go s.write()
	return s, nil
}

// OpenReadOnly opens a store to read, never to write; the file must exist.
func OpenReadOnly(path string) (*Store, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	s := &Store{path: path, closed: true, done: make(chan struct{}), opt: Options{LockWait: 10 * time.Second}}
	close(s.done)
	return s, nil
}

// open opens the file for one transaction, waiting for other processes'
// transactions up to LockWait.
func (s *Store) open(readOnly bool) (*bolt.DB, error) {
	db, err := bolt.Open(s.path, 0o600, &bolt.Options{ReadOnly: readOnly, Timeout: s.opt.LockWait})
	if errors.Is(err, bolt.ErrTimeout) {
		return nil, fmt.Errorf("history %s: %w", s.path, ErrLocked)
	}
	if err != nil {
		return nil, fmt.Errorf("history %s: %w", s.path, err)
	}
	return db, nil
}

// update runs fn in a write transaction on the file, opened for it.
func (s *Store) update(fn func(*bolt.Tx) error) error {
	s.dbMu.Lock()
	defer s.dbMu.Unlock()
	db, err := s.open(false)
	if err != nil {
		return err
	}
	err = db.Update(fn)
	if cerr := db.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("history %s: %w", s.path, err)
	}
	return nil
}

// view runs fn in a read transaction on the file, opened for it.
func (s *Store) view(fn func(*bolt.Tx) error) error {
	s.dbMu.Lock()
	defer s.dbMu.Unlock()
	db, err := s.open(true)
	if err != nil {
		return err
	}
	defer db.Close()
	return db.View(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketRecords) == nil {
			return nil // made, never written
		}
		return fn(tx)
	})
}

// ID is a record's key: its creation time, fixed-width so that keys sort
// by time, and its runner's name.
func ID(r record.Record) string { return record.IDOf(r) }

// Add queues a new runner's record, known by its forge and registration
// from then on.
func (s *Store) Add(r record.Record) {
	r.Schema = record.Schema
	r.ID = ID(r)
	s.push(op{add: &r, forge: r.Forge, reg: r.Registration})
}

// Update queues a change to the record of a forge's registration; change
// reports whether it changed anything. A registration the store does not
// hold is left alone.
func (s *Store) Update(forge string, reg int64, change func(*record.Record) bool) {
	if reg == 0 {
		return
	}
	s.push(op{forge: forge, reg: reg, change: change})
}

// Drop queues the removal of a registration's record: a runner that never
// started is no job.
func (s *Store) Drop(forge string, reg int64) {
	if reg == 0 {
		return
	}
	s.push(op{forge: forge, reg: reg, drop: true})
}

func (s *Store) push(o op) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.queue = append(s.queue, o)
	s.queued++
	s.signal()
	s.mu.Unlock()
}

// signal wakes the writer. Called with s.mu held, so that Close, which
// marks the store closed under it, never closes the channel in between.
func (s *Store) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Flush waits until what was queued before it is written.
func (s *Store) Flush() {
	s.mu.Lock()
	defer s.mu.Unlock()
	want := s.queued
	for s.applied < want && !s.closed {
		s.flushed.Wait()
	}
}

// Close writes what is queued and closes the file.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.done
		return nil
	}
	s.closed = true
	close(s.wake)
	s.mu.Unlock()
	<-s.done
	return nil
}

// write applies the queue in batches until Close.
func (s *Store) write() {
	defer close(s.done)
	prune := time.NewTicker(10 * time.Minute)
	defer prune.Stop()
	for {
		select {
		case _, ok := <-s.wake:
			s.apply()
			if !ok {
				s.mu.Lock()
				s.flushed.Broadcast()
				s.mu.Unlock()
				return
			}
		case <-prune.C:
			if err := s.prune(); err != nil {
				s.log.Warn("history: prune failed", "err", err)
			}
		}
	}
}

// apply writes what is queued in one transaction, retried once: a failed
// write (a full disk) loses those changes, logged, and never the pool's
// time.
func (s *Store) apply() {
	s.mu.Lock()
	batch := s.queue
	s.queue = nil
	s.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	var added int
	var seen []seenRecord
	err := s.update(func(tx *bolt.Tx) error {
		var err error
		seen = seen[:0] // a retried transaction tells its own
		added, err = applyOps(tx, batch, func(r record.Record, dropped bool) {
			if s.opt.Observe != nil {
				seen = append(seen, seenRecord{r, dropped})
			}
		})
		return err
	})
	if errors.Is(err, ErrLocked) && s.retry(batch) {
		return
	}
	if err != nil {
		s.log.Error("history: write failed; these runners' records miss changes", "ops", len(batch), "err", err)
	} else {
		for _, o := range seen {
			s.opt.Observe(o.r, o.dropped)
		}
	}
	s.mu.Lock()
	s.applied += uint64(len(batch))
	s.flushed.Broadcast()
	s.mu.Unlock()
	if added > 0 {
		if n, _ := s.count(); n > s.opt.MaxRecords+s.opt.MaxRecords/100 {
			if err := s.prune(); err != nil {
				s.log.Warn("history: prune failed", "err", err)
			}
		}
	}
}

// retry puts back a batch that found the file locked (a long read by
// another process), to be written at the next wake, in a second or so. It
// reports false once the store is closing: the batch is then given up.
func (s *Store) retry(batch []op) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.queue = append(batch, s.queue...)
	s.log.Warn("history: the file is locked; writing later", "ops", len(batch))
	time.AfterFunc(time.Second, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if !s.closed {
			s.signal()
		}
	})
	return true
}

// seenRecord is a record a batch wrote, told to Options.Observe once the
// batch is on disk.
type seenRecord struct {
	r       record.Record
	dropped bool
}

// applyOps applies a batch in tx, telling seen each record it writes.
func applyOps(tx *bolt.Tx, batch []op, seen func(record.Record, bool)) (added int, err error) {
	recs, regs := tx.Bucket(bucketRecords), tx.Bucket(bucketRegs)
	// Records are added in time order, at the end: full pages, not the
	// half-full ones bbolt leaves by default for random inserts.
	recs.FillPercent = 0.9
	for _, o := range batch {
		rk := regKey(o.forge, o.reg)
		switch {
		case o.add != nil:
			b, err := json.Marshal(o.add)
			if err != nil {
				return added, err
			}
			if recs.Get([]byte(o.add.ID)) == nil {
				added++
			}
			if err := recs.Put([]byte(o.add.ID), b); err != nil {
				return added, err
			}
			if o.reg != 0 {
				if err := regs.Put(rk, []byte(o.add.ID)); err != nil {
					return added, err
				}
			}
			seen(*o.add, false)
		default:
			id := regs.Get(rk)
			if id == nil {
				continue
			}
			id = append([]byte(nil), id...)
			if o.drop {
				seen(record.Record{ID: string(id), Forge: o.forge, Registration: o.reg}, true)
				if recs.Get(id) != nil {
					added--
				}
				if err := recs.Delete(id); err != nil {
					return added, err
				}
				if err := regs.Delete(rk); err != nil {
					return added, err
				}
				continue
			}
			var r record.Record
			if err := json.Unmarshal(recs.Get(id), &r); err != nil {
				continue // not ours to mend
			}
			if !o.change(&r) {
				continue
			}
			b, err := json.Marshal(r)
			if err != nil {
				return added, err
			}
			if err := recs.Put(id, b); err != nil {
				return added, err
			}
			seen(r, false)
		}
	}
	return added, addCount(tx, added)
}

func regKey(forge string, reg int64) []byte {
	k := make([]byte, 0, len(forge)+9)
	k = append(k, forge...)
	k = append(k, 0)
	return binary.BigEndian.AppendUint64(k, uint64(reg))
}

func addCount(tx *bolt.Tx, d int) error {
	if d == 0 {
		return nil
	}
	m := tx.Bucket(bucketMeta)
	n := int64(0)
	if b := m.Get(keyCount); len(b) == 8 {
		n = int64(binary.BigEndian.Uint64(b))
	}
	return m.Put(keyCount, binary.BigEndian.AppendUint64(nil, uint64(max(n+int64(d), 0))))
}

// count is how many records the store holds.
func (s *Store) count() (int, error) {
	n := 0
	err := s.view(func(tx *bolt.Tx) error {
		if b := tx.Bucket(bucketMeta).Get(keyCount); len(b) == 8 {
			n = int(binary.BigEndian.Uint64(b))
		}
		return nil
	})
	return n, err
}

// prune drops the oldest records beyond MaxRecords and those older than
// Keep.
func (s *Store) prune() error {
	cutoff := fmt.Sprintf("%019d", s.opt.Now().Add(-s.opt.Keep).UnixNano())
	return s.update(func(tx *bolt.Tx) error {
		recs, regs := tx.Bucket(bucketRecords), tx.Bucket(bucketRegs)
		n := 0
		if b := tx.Bucket(bucketMeta).Get(keyCount); len(b) == 8 {
			n = int(binary.BigEndian.Uint64(b))
		}
		removed := 0
		c := recs.Cursor()
		for k, v := c.First(); k != nil && (n-removed > s.opt.MaxRecords || string(k) < cutoff); k, v = c.First() {
			var r record.Record
			if json.Unmarshal(v, &r) == nil && r.Registration != 0 {
				if err := regs.Delete(regKey(r.Forge, r.Registration)); err != nil {
					return err
				}
			}
			if err := c.Delete(); err != nil {
				return err
			}
			removed++
		}
		return addCount(tx, -removed)
	})
}

// Query selects records.
type Query struct {
	Since time.Time // created at or after; zero for all
	Pool  string    // "" for every pool
	// All includes runners that took no job.
	All   bool
	Limit int // 0 for no limit
}

// List returns the records the query selects, newest first.
func (s *Store) List(q Query) ([]record.Record, error) {
	// Never nil: an empty history is the empty list in JSON, not null.
	out := []record.Record{}
	since := fmt.Sprintf("%019d", max(q.Since.UnixNano(), 0))
	err := s.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketRecords).Cursor()
		for k, v := c.Last(); k != nil && string(k) >= since; k, v = c.Prev() {
			if q.Pool != "" && !strings.Contains(string(v), `"pool":"`+q.Pool+`"`) {
				continue // cheap before decoding; checked again after
			}
			var r record.Record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("record %s: %w", k, err)
			}
			if q.Pool != "" && r.Pool != q.Pool || !q.All && r.JobStarted.IsZero() && r.Job == nil {
				continue
			}
			out = append(out, r)
			if q.Limit > 0 && len(out) >= q.Limit {
				break
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	return out, nil
}

// Get returns one record by ID.
func (s *Store) Get(id string) (record.Record, error) {
	var r record.Record
	err := s.view(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketRecords).Get([]byte(id))
		if v == nil {
			return fmt.Errorf("%q: %w", id, ErrNotFound)
		}
		return json.Unmarshal(v, &r)
	})
	return r, err
}

// Len is how many records the store holds.
func (s *Store) Len() (int, error) { return s.count() }

// Find returns the record of a forge's registration.
func (s *Store) Find(forge string, reg int64) (record.Record, error) {
	var r record.Record
	err := s.view(func(tx *bolt.Tx) error {
		id := tx.Bucket(bucketRegs).Get(regKey(forge, reg))
		if id == nil {
			return fmt.Errorf("registration %d of %s: %w", reg, forge, ErrNotFound)
		}
		v := tx.Bucket(bucketRecords).Get(id)
		if v == nil {
			return fmt.Errorf("registration %d of %s: %w", reg, forge, ErrNotFound)
		}
		return json.Unmarshal(v, &r)
	})
	return r, err
}
