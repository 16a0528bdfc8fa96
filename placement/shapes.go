package placement

import (
	"fmt"
	"maps"
	"time"
)

// A shape's backoff: 1 s after its first failure, doubling to 5 minutes,
// as a pool's; a shape its provider refused waits the longest at once,
// since the same request is refused again.
const (
	shapeBackoffMin = time.Second
	shapeBackoffMax = 5 * time.Minute
)

// Shapes is what a dynamic pool keeps of its shapes (the distinct sets
// of requests its jobs make, package dynamic) between passes: the shape
// each slot's runner was made for, why a shape starts no runner (outside
// the pool's limits, or its runners failing), since when a shape's runner
// waits for a job with fewer labels, and each shape's own backoff, so
// that a shape that cannot be placed holds back that shape alone and the
// pool's other shapes run. The zero value is ready; it is not safe for
// concurrent use (the pool holds its lock).
type Shapes struct {
	of      map[string]string    // slot -> the shape its runner was made for
	refused map[string]string    // shape -> why the pool's limits refuse it
	held    map[string]time.Time // shape -> since when its runner waits
	backoff map[string]shapeBackoff
}

type shapeBackoff struct {
	failures int
	until    time.Time
	reason   string
}

func (s *Shapes) init() {
	if s.of == nil {
		s.of, s.refused, s.held, s.backoff = map[string]string{}, map[string]string{}, map[string]time.Time{}, map[string]shapeBackoff{}
	}
}

// Made notes the shape a slot's runner is made for.
func (s *Shapes) Made(slot, shape string) {
	s.init()
	s.of[slot] = shape
}

// Of is the shape a slot's runner was made for; "" where none is noted.
func (s *Shapes) Of(slot string) string { return s.of[slot] }

// Refuse notes why the pool's limits refuse a shape; first is set the
// first time, for one log line.
func (s *Shapes) Refuse(shape, why string) (first bool) {
	s.init()
	_, told := s.refused[shape]
	s.refused[shape] = why
	return !told
}

// Allow drops a shape's refusal: the pool's limits let it be.
func (s *Shapes) Allow(shape string) { delete(s.refused, shape) }

// Asked keeps what is noted of the shapes the queue still asks for: the
// refusals and backoffs of shapes whose jobs left the queue go with them.
func (s *Shapes) Asked(want map[string]int) {
	for shape := range s.refused {
		if _, ok := want[shape]; !ok {
			delete(s.refused, shape)
		}
	}
	for shape := range s.backoff {
		if _, ok := want[shape]; !ok {
			delete(s.backoff, shape)
		}
	}
}

// Hold notes that a shape's runner waits; it returns since when, and
// whether this is the wait's start.
func (s *Shapes) Hold(shape string, now time.Time) (since time.Time, first bool) {
	s.init()
	since, ok := s.held[shape]
	if !ok {
		s.held[shape] = now
		return now, true
	}
	return since, false
}

// Unhold ends a shape's wait.
func (s *Shapes) Unhold(shape string) { delete(s.held, shape) }

// Failed notes that a runner of a shape failed to start or to take a
// job, and returns how long the shape starts none. A refusal by the
// provider (no node has what it asks) waits the longest at once.
func (s *Shapes) Failed(shape, reason string, refused bool, now time.Time) time.Duration {
	s.init()
	b := s.backoff[shape]
	b.failures++
	wait := min(shapeBackoffMin<<min(b.failures-1, 16), shapeBackoffMax)
	if refused {
		wait = shapeBackoffMax
	}
	b.until, b.reason = now.Add(wait), reason
	s.backoff[shape] = b
	return wait
}

// Ready reports whether a shape may start a runner now.
func (s *Shapes) Ready(shape string, now time.Time) bool {
	return !now.Before(s.backoff[shape].until)
}

// Recovered ends a shape's backoff: one of its runners took a job.
func (s *Shapes) Recovered(shape string) { delete(s.backoff, shape) }

// Refusals returns, by shape, why the pool starts no runner for jobs
// that ask for it: outside its limits, or backing off.
func (s *Shapes) Refusals() map[string]string {
	out := map[string]string{}
	maps.Copy(out, s.Backoffs())
	maps.Copy(out, s.refused)
	return out
}

// Backoffs returns, by shape, why its runners back off; nil for none.
func (s *Shapes) Backoffs() map[string]string {
	var out map[string]string
	for shape, b := range s.backoff {
		if out == nil {
			out = map[string]string{}
		}
		out[shape] = fmt.Sprintf("%d runner starts failed in a row; next try at %s: %s", b.failures, b.until.Format(time.RFC3339), b.reason)
	}
	return out
}
