package placement

import (
	"strings"
	"testing"
	"time"
)

// A shape's backoff doubles from 1 s to 5 minutes, starts at 5 minutes
// for a refusal, is said with the refusals, and goes when a runner of
// the shape takes a job or its jobs leave the queue.
func TestShapeBacksOffAlone(t *testing.T) {
	var s Shapes
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
		if got := s.Failed("gpus=2", "image pull failed", false, now); got != want {
			t.Fatalf("failure %d: wait %v, want %v", i+1, got, want)
		}
	}
	if s.Ready("gpus=2", now.Add(3*time.Second)) || !s.Ready("gpus=2", now.Add(4*time.Second)) || !s.Ready("gpus=1", now) {
		t.Error("a shape is ready before its backoff ends, or another shape is held")
	}
	if why := s.Refusals()["gpus=2"]; !strings.Contains(why, "3 runner starts failed in a row") || !strings.Contains(why, "image pull failed") {
		t.Errorf("refusals %v", s.Refusals())
	}
	s.Recovered("gpus=2")
	if len(s.Refusals()) != 0 {
		t.Errorf("after a runner took a job: %v", s.Refusals())
	}
	if got := s.Failed("gpu=h100", "no node has it", true, now); got != 5*time.Minute {
		t.Errorf("a refused shape waits %v, want 5m", got)
	}
	s.Refuse("gpus=8", "gpus=8: the pool allows gpus=1|2")
	s.Asked(map[string]int{"": 1})
	if len(s.Refusals()) != 0 {
		t.Errorf("after the shapes' jobs left the queue: %v", s.Refusals())
	}
}
