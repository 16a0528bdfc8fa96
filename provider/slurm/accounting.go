package slurm

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// ErrNoAccounting is a cluster that keeps no accounting (no slurmdbd):
// sacct has nothing to say of a job that left the queue.
var ErrNoAccounting = errors.New("Slurm accounting storage is disabled")

// Accountant is implemented by Clusters that can read how jobs ended from
// Slurm's accounting once the queue no longer lists them (after
// MinJobAge, 300 s by default): a runner's job lost while the manager was
// away (its node failed, someone cancelled it with SIGKILL, which leaves
// no notice) is still told from one that ended of itself.
type Accountant interface {
	// Ended returns the state each job ended in, for those accounting
	// knows and that ended; it fails with ErrNoAccounting where the
	// cluster keeps none.
	Ended(ctx context.Context, ids []string) (map[string]string, error)
}

// sacctBatch is how many job ids one sacct is asked about.
const sacctBatch = 100

// Ended runs `sacct -X -n -P -j <ids> -o JobID,State`: one line per job
// (-X: the allocation, not its steps), "id|STATE" or "id|CANCELLED by
// uid", in the same form since long before --json; with -j and no -S, its
// window starts at the epoch (sacct(1)).
func (c *CLI) Ended(ctx context.Context, ids []string) (map[string]string, error) {
	out := map[string]string{}
	for len(ids) > 0 {
		n := min(len(ids), sacctBatch)
		b, err := c.run(ctx, nil, "sacct", "-X", "-n", "-P", "-j", strings.Join(ids[:n], ","), "-o", "JobID,State")
		var ce *CommandError
		if errors.As(err, &ce) && strings.Contains(strings.ToLower(ce.Message), "accounting storage is disabled") {
			return nil, ErrNoAccounting
		}
		if err != nil {
			return nil, err
		}
		for id, state := range parseSacct(b) {
			out[id] = state
		}
		ids = ids[n:]
	}
	return out, nil
}

// parseSacct reads sacct's parsable lines into each ended job's state.
func parseSacct(b []byte) map[string]string {
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		id, state, ok := strings.Cut(strings.TrimSpace(line), "|")
		if !ok || id == "" {
			continue
		}
		state, _, _ = strings.Cut(state, " ") // "CANCELLED by 1000"
		if state = strings.ToUpper(state); finished(state) {
			out[id] = state
		}
	}
	return out
}

// accounted asks accounting how the jobs of records the queue no longer
// lists ended, once per job (an ended job's state does not change), and
// returns the notices of those taken back. Without accounting it asks no
// more.
func (p *Provider) accounted(ctx context.Context, gone []record) []provider.Notice {
	a, ok := p.opt.Cluster.(Accountant)
	if !ok || p.opt.ReadOnly || p.noAccounting.Load() {
		return nil
	}
	var ask []string
	p.mu.Lock()
	for _, rec := range gone {
		if _, seen := p.ended[rec.JobID]; !seen && !p.cancelled[rec.JobID] {
			ask = append(ask, rec.JobID)
			// Claimed while asked: a read beside this one (a pass's List
			// and the poller's) neither asks again nor notices twice.
			p.ended[rec.JobID] = ""
		}
	}
	p.mu.Unlock()
	if len(ask) == 0 {
		return nil
	}
	states, err := a.Ended(ctx, ask)
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, id := range ask {
		if _, ok := states[id]; !ok || err != nil {
			delete(p.ended, id) // asked again at the next read
		}
	}
	switch {
	case errors.Is(err, ErrNoAccounting):
		p.noAccounting.Store(true)
		p.log.Info("the cluster keeps no accounting: a runner's job that left the queue before a read saw how it ended is taken as ended")
		return nil
	case err != nil:
		// Asked again at the next read: the record stays until Delete.
		p.log.Warn("could not read how runners' jobs ended from Slurm's accounting", "jobs", len(ask), "error", err)
		return nil
	}
	var out []provider.Notice
	for _, rec := range gone {
		state, ok := states[rec.JobID]
		if !ok {
			continue
		}
		p.ended[rec.JobID] = state
		if takenBack(state) && !p.cancelled[rec.JobID] {
			out = append(out, provider.Notice{Name: rec.Name, ID: rec.JobID, At: time.Now(),
				Reason: fmt.Sprintf("Slurm job %s (from accounting: it had left the queue)", state)})
		}
	}
	return out
}
