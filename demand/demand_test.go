package demand

import (
	"fmt"
	"sync"
	"testing"
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
	tr.Poll("f", []Job{{ID: 1, Labels: []string{"gpu"}}, {ID: 2, Labels: []string{"gpu"}}})
	if n := tr.QueuedFor("p"); n != 2 {
		t.Fatalf("%d queued", n)
	}
	// Job 1 was taken: the next poll no longer lists it.
	tr.Poll("f", []Job{{ID: 2, Labels: []string{"gpu"}}})
	if n := tr.QueuedFor("p"); n != 1 {
		t.Fatalf("%d queued after job 1 left the queue", n)
	}
	// A job known from a webhook only is not taken for gone by a poll
	// that raced with its delivery.
	tr.Observe(Job{Forge: "f", ID: 3, Status: Queued, Labels: []string{"gpu"}})
	tr.Poll("f", []Job{{ID: 2, Labels: []string{"gpu"}}})
	if n := tr.QueuedFor("p"); n != 2 {
		t.Fatalf("%d queued, want 2", n)
	}
}

func TestConcurrentReports(t *testing.T) {
	tr := New([]Pool{{Name: "p", Forge: "f", Labels: []string{"gpu"}}}, nil)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for id := range int64(200) {
				st := Status(1 + (int(id)+w)%3)
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
