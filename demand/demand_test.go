package demand

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
)

func TestMatchAndCount(t *testing.T) {
	var events []Event
	tr := New([]Pool{
		{Name: "h200", Forge: "gh", Labels: []string{"self-hosted", "linux", "x64", "gpu", "gpu-h200"}},
		{Name: "cpu", Forge: "gh", Labels: []string{"self-hosted", "linux", "x64"}},
		{Name: "lab", Forge: "gitea", Labels: []string{"gpu"}},
	}, func(e Event) { events = append(events, e) })
	for _, tt := range []struct {
		job  Job
		pool string
	}{
		{Job{Forge: "gh", Labels: []string{"self-hosted", "GPU-H200"}}, "h200"}, // case-insensitive
		{Job{Forge: "gh", Labels: []string{"self-hosted", "linux"}}, "h200"},    // the first pool in order
		{Job{Forge: "gh", Labels: []string{"ubuntu-latest"}}, ""},               // hosted: none of ours
		{Job{Forge: "gitea", Labels: []string{"gpu"}}, "lab"},
		{Job{Forge: "gitea", Labels: []string{"gpu", "cuda-12.4"}}, ""},
	} {
		if got := tr.Match(tt.job); got != tt.pool {
			t.Errorf("Match(%v) = %q, want %q", tt.job.Labels, got, tt.pool)
		}
	}

	q := func(id int64, labels ...string) Job {
		return Job{Forge: "gh", ID: id, Status: Queued, Labels: labels}
	}
	if !tr.Observe(q(1, "gpu-h200")) || tr.Observe(q(1, "gpu-h200")) {
		t.Fatal("a duplicate delivery was counted again")
	}
	tr.Observe(q(2, "gpu"))
	tr.Observe(q(3, "linux"))
	tr.Observe(q(4, "windows"))
	if got := tr.Queued(); fmt.Sprint(got) != "map[h200:3]" {
		t.Fatalf("queued %v", got)
	}
	// Started, then a late "queued" delivery of the same job: it stays
	// started.
	tr.Observe(Job{Forge: "gh", ID: 2, Status: InProgress, Runner: "h200-1"})
	if tr.Observe(q(2, "gpu")) {
		t.Error("a late queued report moved a started job back")
	}
	tr.Observe(Job{Forge: "gh", ID: 1, Status: Completed, Conclusion: "success"})
	if got := tr.QueuedFor("h200"); got != 1 {
		t.Fatalf("queued for h200: %d, want 1", got)
	}
	last := events[len(events)-1]
	if last.Job.ID != 1 || last.From != Queued || last.Job.Status != Completed || last.Pool != "h200" || last.Job.Labels[0] != "gpu-h200" {
		t.Errorf("last event %+v", last)
	}
}

func TestPollSeesJobsLeaveTheQueue(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	tr.Poll("f", []Job{{ID: 1, Labels: []string{"gpu"}}, {ID: 2, Labels: []string{"gpu"}}}, time.Now())
	if n := tr.QueuedFor("p"); n != 2 {
		t.Fatalf("%d queued", n)
	}
	// Job 1 was taken: the next poll no longer lists it.
	tr.Poll("f", []Job{{ID: 2, Labels: []string{"gpu"}}}, time.Now())
	if n := tr.QueuedFor("p"); n != 1 {
		t.Fatalf("%d queued after job 1 left the queue", n)
	}
	// Job 3 is reported by a webhook after the next listing was asked
	// for: missing from it, it stays queued.
	listed := time.Now()
	tr.Observe(Job{Forge: "f", ID: 3, Status: Queued, Labels: []string{"gpu"}})
	tr.Poll("f", []Job{{ID: 2, Labels: []string{"gpu"}}}, listed)
	if n := tr.QueuedFor("p"); n != 2 {
		t.Fatalf("%d queued, want 2", n)
	}
	// Its start's webhook is lost: the next listing, asked for after it
	// was reported, no longer has it, so it left the queue.
	tr.Poll("f", []Job{{ID: 2, Labels: []string{"gpu"}}}, time.Now())
	if n := tr.QueuedFor("p"); n != 1 {
		t.Fatalf("%d queued, want 1: job 3's start was missed", n)
	}
}

func TestConcurrentReports(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for id := range int64(200) {
				st := forge.JobStatus(1 + (int(id)+w)%3)
				tr.Observe(Job{Forge: "f", ID: id, Status: st, Labels: []string{"gpu"}})
				tr.Queued()
			}
		})
	}
	wg.Wait()
	for _, j := range tr.Recent(1000) {
		if j.Status != Completed {
			t.Fatalf("job %d ended %s, want completed (the furthest report wins)", j.ID, j.Status)
		}
	}
}

// A runner that took a job is subtracted from the queue until the job's
// start is heard of, by the runner's name or by a poll, so the pool does
// not start a replacement for a job already taken.
func TestUnservedSubtractsRunnersThatTookJobs(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	for id := range int64(3) {
		tr.Observe(Job{Forge: "f", ID: id + 1, Status: Queued, Labels: []string{"gpu"}})
	}
	if n := tr.Unserved("p", nil, time.Minute); n != 3 {
		t.Fatalf("unserved %d, want 3", n)
	}
	// p-1 and p-2 took jobs; no report yet.
	if n := tr.Unserved("p", []int64{11, 12}, time.Minute); n != 1 {
		t.Fatalf("unserved %d, want 1", n)
	}
	// A webhook names p-1's job: it is no longer queued, p-1 is known.
	tr.Observe(Job{Forge: "f", ID: 1, Status: InProgress, Runner: "p-1", RunnerID: 11})
	if n := tr.Unserved("p", []int64{11, 12}, time.Minute); n != 1 {
		t.Fatalf("unserved %d after p-1's webhook, want 1", n)
	}
	// A poll sees job 2 leave the queue, without a runner's name: p-2
	// is accounted for by it.
	tr.Poll("f", []Job{{ID: 3, Labels: []string{"gpu"}}}, time.Now())
	if n := tr.Unserved("p", []int64{11, 12}, time.Minute); n != 1 {
		t.Fatalf("unserved %d after the poll, want 1 (job 3)", n)
	}
	if n := tr.Unserved("p", []int64{11, 12, 13}, time.Minute); n != 0 {
		t.Fatalf("unserved %d with p-3 busy too, want 0", n)
	}
}

// A job seen leaving the queue by a poll accounts for one runner only:
// once its runner is gone, it cannot account for the next one.
func TestUnservedClaimsEachPolledStartOnce(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	tr.Poll("f", []Job{{ID: 1, Labels: []string{"gpu"}}, {ID: 2, Labels: []string{"gpu"}}}, time.Now())
	tr.Poll("f", []Job{{ID: 2, Labels: []string{"gpu"}}}, time.Now()) // job 1 taken
	if n := tr.Unserved("p", []int64{21}, time.Minute); n != 1 {
		t.Fatalf("unserved %d, want 1: runner 21 took job 1", n)
	}
	// Runner 21 is done; runner 22 takes job 2 before the next poll.
	if n := tr.Unserved("p", []int64{22}, time.Minute); n != 0 {
		t.Fatalf("unserved %d, want 0: job 1's start was runner 21's, not 22's", n)
	}
}

// A runner whose job the forge reports ended, before or without reporting
// it started, is accounted for by that job: it took a queued job, and the
// queue is not counted short for it.
func TestUnservedCountsEndedJobsRunner(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	tr.Observe(Job{Forge: "f", ID: 1, Status: Queued, Labels: []string{"gpu"}})
	tr.Observe(Job{Forge: "f", ID: 2, Status: Queued, Labels: []string{"gpu"}})
	// Runner 31 ran job 1 in a second; the only report is its end.
	tr.Observe(Job{Forge: "f", ID: 1, Status: Completed, Conclusion: "success", RunnerID: 31})
	if n := tr.Unserved("p", []int64{31}, time.Minute); n != 1 {
		t.Fatalf("unserved %d, want 1 (job 2): runner 31's job is accounted for by its end", n)
	}
}

// A pool of a forge that says how its jobs' labels are met is matched by
// that, not by names.
func TestMatchByForgeRule(t *testing.T) {
	prefix := func(labels, want []string) bool { // a job label is met by a pool label it begins
		for _, w := range want {
			found := false
			for _, l := range labels {
				found = found || len(w) >= len(l) && w[:len(l)] == l
			}
			if !found {
				return false
			}
		}
		return true
	}
	tr := New([]Pool{
		{Name: "gpu", Forge: "az", Labels: []string{"gpu"}, Meets: prefix},
		{Name: "named", Forge: "gh", Labels: []string{"gpu"}},
	}, nil)
	if got := tr.Match(Job{Forge: "az", Labels: []string{"gpu -equals a100"}}); got != "gpu" {
		t.Errorf("matched %q, want the pool by its forge's rule", got)
	}
	if got := tr.Match(Job{Forge: "gh", Labels: []string{"gpu -equals a100"}}); got != "" {
		t.Errorf("matched %q, want none by names", got)
	}
}

// A job a poll saw leave the queue is in progress without its runner; a
// later report that names the runner is news (the history needs it), one
// that repeats it is not.
func TestRunnerOfAJobInferredInProgress(t *testing.T) {
	var events []Event
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, func(e Event) { events = append(events, e) })
	tr.Observe(Job{Forge: "f", ID: 1, Labels: []string{"gpu"}, Status: Queued})
	tr.Poll("f", nil, time.Now().Add(time.Second)) // gone from the queue: in progress
	if !tr.Observe(Job{Forge: "f", ID: 1, Status: InProgress, RunnerID: 7}) {
		t.Fatal("the runner of a job in progress was not news")
	}
	if tr.Observe(Job{Forge: "f", ID: 1, Status: InProgress, RunnerID: 7}) {
		t.Fatal("a repeated report was news")
	}
	if !tr.Taken("f")[7] || tr.Taken("other")[7] {
		t.Fatalf("Taken = %v", tr.Taken("f"))
	}
	if last := events[len(events)-1]; last.Job.RunnerID != 7 || last.From != InProgress {
		t.Fatalf("last event %+v", last)
	}
}

// A dynamic pool's demand comes by shape, less the runners of each shape
// that took a job; Fewer finds a queued job a bigger runner could take.
func TestShapes(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}, Meets: func(have, want []string) bool { return true }}}, nil)
	for id, labels := range map[int64][]string{1: {"gpu", "gpus=2"}, 2: {"gpu", "gpus=2"}, 3: {"gpu", "gpus=2", "mem=8g"}, 4: {"gpu"}} {
		tr.Observe(Job{Forge: "f", ID: id, Labels: labels, Status: Queued})
	}
	got := tr.UnservedShapes("p", map[string][]int64{"gpus=2": {11}}, time.Minute)
	if got["gpus=2"] != 1 || got["gpus=2,mem=8g"] != 1 || got[""] != 1 || len(got) != 3 {
		t.Fatalf("UnservedShapes = %v", got)
	}
	if job, ok := tr.Fewer("f", []string{"gpu", "gpus=2", "mem=8g"}, "gpus=2,mem=8g"); !ok || strings.Contains(job, "mem=8g") {
		t.Fatalf("Fewer for the mem=8g runner: %q %v", job, ok)
	}
	tr.Observe(Job{Forge: "f", ID: 1, Status: InProgress, RunnerID: 11})
	tr.Observe(Job{Forge: "f", ID: 2, Status: InProgress, RunnerID: 12})
	tr.Observe(Job{Forge: "f", ID: 4, Status: InProgress, RunnerID: 14})
	if job, ok := tr.Fewer("f", []string{"gpu", "gpus=2", "mem=8g"}, "gpus=2,mem=8g"); ok {
		t.Fatalf("Fewer once the smaller jobs were taken: %q", job)
	}
}

// A queued job no pool of this manager serves holds no runner back: it
// waits for another fleet.
func TestFewerIgnoresOtherFleetsJobs(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	tr.Observe(Job{Forge: "f", ID: 1, Labels: []string{"self-hosted"}, Status: Queued})
	if job, ok := tr.Fewer("f", []string{"self-hosted", "gpu", "gpus=2"}, "gpus=2"); ok {
		t.Fatalf("held back for %s", job)
	}
	tr.Observe(Job{Forge: "f", ID: 2, Labels: []string{"gpu"}, Status: Queued})
	if _, ok := tr.Fewer("f", []string{"self-hosted", "gpu", "gpus=2"}, "gpus=2"); !ok {
		t.Fatal("not held back for a job of this manager's pool")
	}
}

// A pool's view answers for that pool, and holds a runner back for a job
// whose labels are among the runner's with the forge's implicit ones
// (GitHub's self-hosted), which the runner registers without naming.
func TestPoolDemand(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"self-hosted", "gpu"}, Meets: func(have, want []string) bool { return true }}}, nil)
	tr.Observe(Job{Forge: "f", ID: 1, Labels: []string{"self-hosted", "gpu"}, Status: Queued})
	tr.Observe(Job{Forge: "f", ID: 2, Labels: []string{"self-hosted", "gpu", "gpus=2"}, Status: Queued})
	d := tr.For("p", "f", []string{"self-hosted"}, time.Minute)
	if n := d.Unserved(nil); n != 2 {
		t.Errorf("Unserved = %d, want 2", n)
	}
	if got := d.Shapes(nil); got[""] != 1 || got["gpus=2"] != 1 {
		t.Errorf("Shapes = %v", got)
	}
	if _, ok := d.HoldBack([]string{"gpu", "gpus=2"}, "gpus=2"); !ok {
		t.Error("the gpus=2 runner is not held back for the job asking [self-hosted, gpu]")
	}
	if _, ok := tr.For("p", "f", nil, time.Minute).HoldBack([]string{"gpu", "gpus=2"}, "gpus=2"); ok {
		t.Error("held back without the implicit label the job names")
	}
}
