package history

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/runfleet/runfleet/record"
)

func rec(runner string, reg int64, created time.Time) record.Record {
	return record.Record{
		Runner: runner, Registration: reg, Manager: "m", Forge: "local", ForgeType: "gitea",
		Pool: "gpu", Provider: "docker", Labels: []string{"gpu", "gpus-1"}, Created: created,
		Machine: record.Machine{Image: "runner:1", ImageDigest: "sha256:abc"},
		GPUs:    []record.GPU{{ID: "GPU-1", UUID: "GPU-1", Model: "NVIDIA H100"}},
	}
}

func started(at time.Time) func(*record.Record) bool {
	return func(r *record.Record) bool {
		if !r.JobStarted.IsZero() {
			return false
		}
		r.JobStarted = at
		return true
	}
}

func TestRecordsSurviveReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "history.db")
	s, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 26, 6, 0, 0, 0, time.UTC)
	s.Add(rec("gpu-1", 11, t0))
	s.Add(rec("gpu-2", 12, t0.Add(time.Second)))
	s.Add(rec("gpu-1", 13, t0.Add(time.Minute))) // the slot's next runner
	s.Update("local", 11, started(t0.Add(5*time.Second)))
	s.Update("local", 13, func(r *record.Record) bool {
		r.Job = &record.Job{ID: 7, RunID: 3, Name: "train", Conclusion: "success"}
		return true
	})
	s.Update("local", 99, started(t0)) // no such registration: nothing
	s.Drop("local", 12)                // never started
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s, err = OpenReadOnly(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.List(Query{})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Registration != 13 || got[1].Registration != 11 {
		t.Fatalf("after a reopen: %+v", got)
	}
	if got[0].Job == nil || got[0].Job.ID != 7 || got[1].JobStarted.IsZero() {
		t.Fatalf("updates lost: %+v", got)
	}
	one, err := s.Get(got[1].ID)
	if err != nil || one.Runner != "gpu-1" || one.GPUs[0].UUID != "GPU-1" {
		t.Fatalf("Get(%s) = %+v, %v", got[1].ID, one, err)
	}
	if _, err := s.Get("nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get(nope): %v", err)
	}
	if n, _ := s.Len(); n != 2 {
		t.Fatalf("Len = %d after a drop, want 2", n)
	}
}

func TestListFilters(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "h.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	t0 := time.Now().Add(-3 * time.Hour)
	for i := range 6 {
		r := rec(fmt.Sprintf("gpu-%d", i), int64(i+1), t0.Add(time.Duration(i)*time.Hour/2))
		if i%2 == 1 {
			r.Pool = "cpu"
		}
		s.Add(r)
		if i != 5 {
			s.Update("local", int64(i+1), started(r.Created.Add(time.Second)))
		}
	}
	s.Flush()
	count := func(q Query) int {
		got, err := s.List(q)
		if err != nil {
			t.Fatal(err)
		}
		return len(got)
	}
	cases := []struct {
		q    Query
		want int
	}{
		{Query{}, 5},
		{Query{All: true}, 6},
		{Query{Pool: "gpu"}, 3},
		{Query{Pool: "cpu", All: true}, 3},
		{Query{Since: time.Now().Add(-90 * time.Minute)}, 1},            // 4; 5 took no job
		{Query{Since: time.Now().Add(-90 * time.Minute), All: true}, 2}, // 4 and 5
		{Query{Limit: 2}, 2},
	}
	for _, c := range cases {
		if got := count(c.q); got != c.want {
			t.Errorf("List(%+v) = %d records, want %d", c.q, got, c.want)
		}
	}
}

func TestBoundedByCountAndAge(t *testing.T) {
	now := time.Now()
	s, err := Open(filepath.Join(t.TempDir(), "h.db"), Options{MaxRecords: 100, Keep: 24 * time.Hour, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.Add(rec("old", 1, now.Add(-48*time.Hour)))
	for i := range 300 {
		s.Add(rec(fmt.Sprintf("r-%d", i), int64(i+2), now.Add(-time.Hour+time.Duration(i)*time.Second)))
		if i%50 == 0 {
			s.Flush()
		}
	}
	s.Flush()
	if err := s.prune(); err != nil {
		t.Fatal(err)
	}
	n, _ := s.Len()
	got, _ := s.List(Query{All: true})
	if n != 100 || len(got) != 100 {
		t.Fatalf("held %d (listed %d), want 100", n, len(got))
	}
	if got[len(got)-1].Runner != "r-200" {
		t.Fatalf("oldest kept is %s, want r-200", got[len(got)-1].Runner)
	}
	// A dropped record's registration no longer finds it.
	s.Update("local", 2, started(now))
	s.Flush()
	if all, _ := s.List(Query{}); len(all) != 0 {
		t.Fatalf("an update reached a pruned record: %+v", all[0])
	}
}

// TestReadWhileAManagerWrites: `runfleet jobs` reads the file while a
// manager has it open, and two managers sharing it (a leader election's
// candidates, one after the other) write to one history.
func TestReadWhileAManagerWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "h.db")
	a, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	t0 := time.Now()
	a.Add(rec("gpu-1", 1, t0))
	a.Update("local", 1, started(t0))
	a.Flush()
	r, err := OpenReadOnly(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := r.List(Query{}); err != nil || len(got) != 1 {
		t.Fatalf("a reader beside a writer: %d records, %v", len(got), err)
	}
	b, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.Update("local", 1, func(r *record.Record) bool { r.Ended = t0; return true })
	b.Add(rec("gpu-2", 2, t0.Add(time.Second)))
	b.Close()
	got, _ := r.List(Query{All: true})
	if len(got) != 2 || got[1].Ended.IsZero() {
		t.Fatalf("after the second writer: %+v", got)
	}
	if _, err := OpenReadOnly(filepath.Join(t.TempDir(), "none.db")); err == nil {
		t.Fatal("OpenReadOnly of a missing file made one")
	}
}

// TestConcurrentWriters: pools queue from their passes while readers list.
func TestConcurrentWriters(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "h.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	var wg sync.WaitGroup
	for p := range 4 {
		wg.Go(func() {
			for i := range 50 {
				reg := int64(p*1000 + i + 1)
				s.Add(rec(fmt.Sprintf("p%d-%d", p, i), reg, t0.Add(time.Duration(reg))))
				s.Update("local", reg, started(t0))
			}
		})
		wg.Go(func() {
			for range 20 {
				if _, err := s.List(Query{Limit: 10}); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	path := s.path
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, _ = OpenReadOnly(path)
	defer s.Close()
	if got, _ := s.List(Query{}); len(got) != 200 {
		t.Fatalf("%d records with a job, want 200", len(got))
	}
}

// BenchmarkSince1h lists the last hour of a history of 100,000 records
// spread over 30 days (about 140 an hour), from a file opened read-only as
// `runfleet jobs` opens it. It reports the file's size.
func BenchmarkSince1h(b *testing.B) {
	path := filepath.Join(b.TempDir(), "history.db")
	now := time.Now()
	fill(b, path, 100_000, now, 30*24*time.Hour)
	b.ResetTimer()
	var got int
	for b.Loop() {
		s, err := OpenReadOnly(path)
		if err != nil {
			b.Fatal(err)
		}
		rs, err := s.List(Query{Since: now.Add(-time.Hour)})
		if err != nil {
			b.Fatal(err)
		}
		got = len(rs)
		s.Close()
	}
	b.StopTimer()
	fi, _ := os.Stat(path)
	b.ReportMetric(float64(got), "records/op")
	b.ReportMetric(float64(fi.Size())/(1<<20), "MiB-on-disk")
}

// fill writes n records over span before now, as a manager would, in
// batches.
func fill(tb testing.TB, path string, n int, now time.Time, span time.Duration) {
	tb.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		tb.Fatal(err)
	}
	step := span / time.Duration(n)
	for start := 0; start < n; start += 5000 {
		var batch []op
		for i := start; i < min(start+5000, n); i++ {
			r := rec(fmt.Sprintf("gpu-%d", i%64+1), int64(i+1), now.Add(-span+time.Duration(i)*step))
			r.ID, r.Schema = ID(r), record.Schema
			r.JobStarted = r.Created.Add(20 * time.Second)
			r.Ended = r.JobStarted.Add(5 * time.Minute)
			r.Job = &record.Job{ID: int64(i + 1), RunID: int64(i/4 + 1), Name: "train", URL: "https://forge.example/acme/models/actions/runs/1/jobs/0", Conclusion: "success", Queued: r.Created, Started: r.JobStarted, Completed: r.Ended}
			batch = append(batch, op{add: &r, forge: r.Forge, reg: r.Registration})
		}
		err := db.Update(func(tx *bolt.Tx) error {
			for _, bk := range [][]byte{bucketRecords, bucketRegs, bucketMeta} {
				if _, err := tx.CreateBucketIfNotExists(bk); err != nil {
					return err
				}
			}
			_, err := applyOps(tx, batch, func(record.Record, bool) {})
			return err
		})
		if err != nil {
			tb.Fatal(err)
		}
	}
	db.Close()
}

// TestObserveSeesWhatIsWritten: the observer is told each record as the
// file holds it, once its batch is written, and each removal.
func TestObserveSeesWhatIsWritten(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]record.Record{}
	var dropped []string
	s, err := Open(filepath.Join(t.TempDir(), "history.db"), Options{Observe: func(r record.Record, drop bool) {
		mu.Lock()
		defer mu.Unlock()
		if drop {
			dropped = append(dropped, r.ID)
			delete(seen, r.ID)
			return
		}
		seen[r.ID] = r
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	now := time.Now().UTC()
	a, b := rec("a", 1, now), rec("b", 2, now.Add(time.Second))
	s.Add(a)
	s.Add(b)
	s.Update("local", 1, started(now.Add(time.Minute)))
	s.Update("local", 1, started(now.Add(2*time.Minute))) // changes nothing: not told
	s.Drop("local", 2)
	s.Flush()
	mu.Lock()
	defer mu.Unlock()
	got, ok := seen[ID(a)]
	if !ok || !got.JobStarted.Equal(now.Add(time.Minute)) || got.Schema != record.Schema {
		t.Errorf("a as seen: %+v, want it started at the first update", got)
	}
	if len(dropped) != 1 || dropped[0] != ID(b) || len(seen) != 1 {
		t.Errorf("dropped %v, seen %d: want b dropped and a alone", dropped, len(seen))
	}
	stored, err := s.Get(ID(a))
	if err != nil || !stored.JobStarted.Equal(got.JobStarted) {
		t.Errorf("the file holds %+v (%v), the observer %+v", stored, err, got)
	}
}
