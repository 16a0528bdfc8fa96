package pool

import (
	"bytes"
	"fmt"
	"time"
)

// Backoff is why, and until when, a pool holds off starting runners:
// runners that failed to start, or whose agent ended without taking a job
// (a broken image, a wrong path), one after another. Without it such a
// pool would register and remove runners as fast as the forge answers.
type Backoff struct {
	// Failures counts the runners in a row that failed; 0 when the last
	// runner started and took a job.
	Failures int `json:"failures"`
	// Until is when the next runner may start.
	Until time.Time `json:"until,omitzero"`
	// Reason is what the last one did, with the last lines of its
	// agent's output where there is some.
	Reason string `json:"reason,omitempty"`
	// Halted is set when the forge refused a registration as invalid
	// (forge.ErrRejected): no retry can fix that, so no runner starts
	// until the pool's config changes.
	Halted bool `json:"halted,omitempty"`
	// Shapes says, by shape of a dynamic pool, why its runners back off
	// (placement.Shapes): a shape backs off alone, and the pool's
	// Failures do not count it.
	Shapes map[string]string `json:"shapes,omitempty"`
}

// String says it for people: the status page and `status`.
func (b Backoff) String() string {
	switch {
	case b.Halted:
		return "not starting runners: " + b.Reason
	case b.Failures == 0:
		return ""
	}
	return fmt.Sprintf("%d runner starts failed in a row; next try at %s: %s", b.Failures, b.Until.Format(time.RFC3339), b.Reason)
}

// Backoff's bounds: 1s after the first failure, doubling to 5 minutes.
const (
	minBackoff = time.Second
	maxBackoff = 5 * time.Minute
)

// backOff notes a runner that failed and returns how long no runner
// starts. Called with p.mu held.
func (p *Pool) backOff(reason string) time.Duration {
	return p.backOffFrom(minBackoff, reason)
}

// backOffFrom is backOff doubling from first rather than minBackoff.
func (p *Pool) backOffFrom(first time.Duration, reason string) time.Duration {
	p.backoff.Failures++
	wait := min(first<<min(p.backoff.Failures-1, 16), maxBackoff)
	p.backoff.Until = p.now().Add(wait)
	p.backoff.Reason = reason
	p.backoffChanged = true
	return wait
}

// halt stops starting runners until the config changes. Called with p.mu
// held.
func (p *Pool) halt(reason string) {
	p.backoff.Failures++
	p.backoff.Halted, p.backoff.Reason = true, reason
	p.backoffChanged = true
}

// recovered ends a backoff: a runner took a job. Called with p.mu held.
func (p *Pool) recovered() {
	if p.backoff.Failures > 0 {
		p.backoff = Backoff{Shapes: p.backoff.Shapes}
		p.backoffChanged = true
	}
}

// Backoff returns the pool's backoff; its Failures is 0 when runners
// start freely.
func (p *Pool) Backoff() Backoff {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.backoff
}

// reportBackoff hands a changed backoff to Config.OnBackoff. Called
// without p.mu held.
func (p *Pool) reportBackoff() {
	p.mu.Lock()
	b, changed, report := p.backoff, p.backoffChanged, p.cfg.OnBackoff // Update may replace it
	p.backoffChanged = false
	p.mu.Unlock()
	if changed && report != nil {
		report(b)
	}
}

// lastLines returns up to n last non-empty lines of an agent's output.
func lastLines(out []byte, n int) string {
	lines := bytes.Split(bytes.TrimRight(out, "\n"), []byte("\n"))
	var keep [][]byte
	for i := len(lines) - 1; i >= 0 && len(keep) < n; i-- {
		if l := bytes.TrimSpace(lines[i]); len(l) > 0 {
			keep = append([][]byte{l}, keep...)
		}
	}
	s := string(bytes.Join(keep, []byte("\n")))
	const most = 2000
	if len(s) > most {
		s = "…" + s[len(s)-most:]
	}
	return s
}
