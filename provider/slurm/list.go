package slurm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// submitLag is how long a job just submitted may be missing from a queue
// read: the read may have started before the submission.
const submitLag = 30 * time.Second

// finished says whether a job state is one its job ended in. A job
// COMPLETING has not: its processes are still ending (the agent reporting
// its job), and whether it ends COMPLETED or CANCELLED is not known yet.
func finished(state string) bool {
	switch state {
	case "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD",
		"RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "POWER_UP_NODE":
		return false
	}
	return true
}

// running says whether a job's processes run (or are ending) on its node.
func running(state string) bool {
	switch state {
	case "RUNNING", "COMPLETING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "RESIZING":
		return true
	}
	return false
}

// takenBack says whether a job that ended lost its node under it, or was
// cancelled by someone else: its runner's job, if it ran one, is lost.
func takenBack(state string) bool {
	switch state {
	case "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "CANCELLED", "TIMEOUT":
		return true
	}
	return false
}

// List returns the pool's runners of a manager: its records joined with
// the queue (one `squeue --json` per poll interval for every pool), and
// the jobs of the pool the queue holds without a record (a runner whose
// record went, another manager's leftovers for `gc`).
//
// A job taken back (preempted, lost with its node, cancelled by someone
// else) is noticed here, before List returns, by whichever read sees it
// first: a pass that saw the job ended without its notice would retire its
// runner as one whose job simply ended.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	recs, err := p.records(manager)
	if err != nil {
		return nil, fmt.Errorf("list runners: %w", err)
	}
	if len(recs) == 0 && !p.opt.ReadOnly {
		// Every job this pool submits has its record first: with none,
		// there is nothing to ask slurmctld about (a pool of size 0).
		return nil, nil
	}
	jobs, at, err := p.q.read(ctx, p.opt.Section.PollInterval.Duration)
	if err != nil {
		return nil, fmt.Errorf("list runners: %w", err)
	}
	out, notices, gone := p.join(manager, jobs, at, recs, p.signalled())
	if len(gone) > 0 {
		notices = append(notices, p.accounted(ctx, gone)...)
	}
	for _, n := range notices {
		p.poller.Notify(n, "runner's job taken back by Slurm")
	}
	return out, nil
}

// join joins a manager's records with the queue, and finds the jobs taken
// back; gone are the records whose jobs left the queue before a read saw
// how they ended, and left no notice, for accounting to tell.
func (p *Provider) join(manager string, jobs []Job, at time.Time, recs []record, signalled map[string]string) (out []provider.Instance, notices []provider.Notice, gone []record) {
	byID := map[string]Job{}
	named := map[string]Job{} // live jobs of the pool by runner name, for records without a job id
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, j := range jobs {
		if m, pool, ok := owner(j.Comment); !ok || m != manager || pool != p.opt.Pool {
			continue
		}
		byID[j.ID] = j
		if !finished(j.State) {
			named[j.Name] = j
		}
	}
	known := map[string]bool{}
	for _, rec := range recs {
		if rec.JobID == "" {
			if p.creating[rec.Name] {
				continue
			}
			// A manager killed between sbatch and the record's update:
			// the job is found by its name.
			if j, ok := named[rec.Name]; ok {
				rec.JobID = j.ID
				if !p.opt.ReadOnly {
					_ = p.writeRecord(rec)
				}
			}
		}
		known[rec.JobID] = true
		j, ok := byID[rec.JobID]
		// The signal first: the job's script leaves its notice before
		// the job ends (a preemption's TERM ends it at once), so a read
		// that sees it ended sees the notice too.
		switch sig := signalled[rec.JobID]; {
		case p.cancelled[rec.JobID]:
		case sig != "" && rec.JobID != "":
			notices = append(notices, provider.Notice{Name: rec.Name, ID: rec.JobID, At: time.Now(),
				Reason: "Slurm signalled the job's end (" + sig + "): preempted, or at its time limit"})
		case ok && takenBack(j.State):
			notices = append(notices, provider.Notice{Name: rec.Name, ID: j.ID, At: time.Now(), Reason: "Slurm job " + j.State})
		}
		switch {
		case ok:
			out = append(out, p.instance(rec, j))
		case rec.JobID != "" && rec.Created.After(at.Add(-submitLag)):
			// Submitted after (or just before) the queue was read.
			out = append(out, provider.Instance{Name: rec.Name, Manager: rec.Manager, Pool: rec.Pool, ID: rec.JobID,
				State: provider.StateCreated, Created: rec.Created, Reason: "submitted", Queued: p.opt.Section.QueueWait})
		default:
			// Ended long enough ago to have left the queue, or never
			// submitted: Delete clears what is left.
			if rec.JobID != "" && signalled[rec.JobID] == "" && !p.cancelled[rec.JobID] {
				gone = append(gone, rec)
			}
			out = append(out, provider.Instance{Name: rec.Name, Manager: rec.Manager, Pool: rec.Pool, ID: rec.JobID,
				State: provider.StateExited, Created: rec.Created})
		}
	}
	for _, j := range byID {
		if known[j.ID] || finished(j.State) || p.cancelled[j.ID] {
			continue
		}
		out = append(out, p.instance(record{Name: j.Name, Manager: manager, Pool: p.opt.Pool, JobID: j.ID, Created: j.Submit}, j))
	}
	return out, notices, gone
}

// signalled reads the notices the jobs left (batchScript): the signal
// each got, by job id.
func (p *Provider) signalled() map[string]string {
	entries, err := os.ReadDir(p.noticeDir())
	if err != nil || len(entries) == 0 {
		return nil
	}
	out := map[string]string{}
	for _, e := range entries {
		b, _ := os.ReadFile(filepath.Join(p.noticeDir(), e.Name()))
		out[e.Name()] = cmp.Or(strings.TrimSpace(string(b)), "a signal")
	}
	return out
}

// instance is a runner's machine as its job's state says.
func (p *Provider) instance(rec record, j Job) provider.Instance {
	in := provider.Instance{Name: rec.Name, Manager: rec.Manager, Pool: rec.Pool, ID: j.ID, Created: rec.Created, GPUs: j.GPUs}
	in.Machine.ID, in.Machine.Node = j.ID, j.Nodes
	if !strings.ContainsAny(j.Nodes, ",[(") { // one node: not a list, not "(null)"
		in.System = p.nodes.Of(j.Nodes)
	}
	reason := j.Reason
	if reason == "None" {
		reason = ""
	}
	switch {
	case p.cancelled[j.ID] || finished(j.State):
		in.State, in.Reason = provider.StateExited, strings.TrimSuffix(j.State+": "+reason, ": ")
	case running(j.State):
		in.State, in.Started = provider.StateRunning, j.Start
		if in.Started.Before(in.Created) {
			in.Started = time.Time{}
		}
	default:
		// Waiting for a node: the reason is Slurm's (Resources,
		// Priority, QOSMaxGRESPerUser, ...).
		in.State, in.Queued = provider.StateCreated, p.opt.Section.QueueWait
		in.Reason = strings.TrimSuffix(strings.ToLower(j.State)+": "+reason, ": ")
	}
	return in
}

// records reads the manager's records of the pool.
func (p *Provider) records(manager string) ([]record, error) {
	entries, err := os.ReadDir(p.recordDir())
	if errors.Is(err, fs.ErrNotExist) && p.opt.ReadOnly {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []record
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		rec, err := p.readRecord(name)
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return nil, err
		}
		if rec.Manager == manager && rec.Pool == p.opt.Pool {
			out = append(out, rec)
		}
	}
	return out, nil
}

// poll reads the queue for Watch and WatchPreemption: a runner whose job
// changed state is reported changed; List, which it calls, notices the
// jobs taken back.
func (p *Provider) poll(ctx context.Context) error {
	insts, err := p.List(ctx, p.opt.Manager)
	if err != nil {
		return err
	}
	jobs, _, _ := p.q.read(ctx, time.Hour)
	inQueue := map[string]bool{}
	for _, j := range jobs {
		inQueue[j.ID] = true
	}
	var changed []string
	now := map[string]string{}
	p.mu.Lock()
	for _, in := range insts {
		sig := in.ID + "/" + string(in.State) + "/" + in.Reason
		now[in.Name] = sig
		if p.last[in.Name] != sig {
			changed = append(changed, in.Name)
		}
	}
	for name := range p.last {
		if _, ok := now[name]; !ok {
			changed = append(changed, name)
		}
	}
	p.last = now
	for id := range p.cancelled {
		if !inQueue[id] {
			delete(p.cancelled, id) // left the queue: nothing lists it again
		}
	}
	p.mu.Unlock()
	p.poller.Changed(changed)
	p.poller.Forget(func(id string) bool { return inQueue[id] })
	return nil
}
