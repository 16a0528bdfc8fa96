// Package slurm is the Slurm provider: each runner is a batch job, for the
// clusters where GPUs are reached only through the scheduler. The manager
// runs as an ordinary user where sbatch works (a login node); it needs no
// root and no container engine.
//
// A runner's job is named after the runner and carries the manager id and
// pool in its comment, so that the queue alone finds it again. A record per
// runner (in the spool directory, written before the job is submitted)
// names the job, so that a kill -9 at any instant leaves nothing unnamed.
// The runner's credential never reaches sbatch's arguments, the job's
// script or the environment Slurm records: it waits in the spool, readable
// by the submitting user only, until the job moves it into a fresh
// directory on its node, removed when the job ends.
package slurm

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// Options configures a Provider.
type Options struct {
	Manager, Pool string
	// ReadOnly: only List and Output are used; nothing is written.
	ReadOnly bool
	Section  Section
	// Spool is the pool's spool directory: records, runners' files until
	// their jobs start, the agents' output. The nodes must see it.
	Spool string
	// Workdir is the parent of the runners' directories on the nodes.
	Workdir string
	// GPUs is how many GPUs each runner's job asks for.
	GPUs        int
	MaxLifetime time.Duration
	// JobTimeout is the longest job of the pool (PoolConfig.JobTimeout):
	// each runner's --time makes room for one after its idle life.
	JobTimeout time.Duration
	// IdleTimeout is the pool's idle_timeout: how long a runner started
	// for one job's own partition or time waits for it.
	IdleTimeout time.Duration
	// Cluster runs the commands; queue is the cluster's queue shared by
	// the manager's pools (made from Cluster when nil).
	Cluster Cluster
	queue   *queue
	Logger  *slog.Logger
	// KeepLogs is how many agents' outputs are kept (200).
	KeepLogs int
}

// Provider runs runners as Slurm batch jobs.
type Provider struct {
	opt    Options
	log    *slog.Logger
	q      *queue
	poller *vm.Poller
	times  times

	mu        sync.Mutex
	creating  map[string]bool
	claimed   map[string]string    // run_as account by runner, while its Create runs
	cancelled map[string]bool      // job ids this manager cancelled
	parts     map[string]Partition // the limits of partitions jobs chose
	qoses     map[string]QOS       // the limits of the QOSes read
	ended     map[string]string    // by job id: the state accounting told

	noAccounting atomic.Bool       // sacct said the cluster keeps none
	last         map[string]string // by name: what the last poll saw, for Watch
	// nodes are the systems of the nodes jobs ran on (nodes.go).
	nodes provider.NodeSystems
}

// record is what is kept per runner, before and after its job exists.
type record struct {
	Name    string    `json:"name"`
	Manager string    `json:"manager"`
	Pool    string    `json:"pool"`
	JobID   string    `json:"job_id,omitempty"`
	Created time.Time `json:"created"`
	// User is the run_as account the job runs as; empty: the manager's.
	User string `json:"user,omitempty"`
}

var runnerNameRE = lazyregexp.New(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// New returns a provider. It creates its directories.
func New(opt Options) (*Provider, error) {
	if opt.Spool == "" || opt.Workdir == "" || opt.Cluster == nil {
		return nil, errors.New("slurm provider: spool, work directory and cluster are required")
	}
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	if opt.KeepLogs == 0 {
		opt.KeepLogs = 200
	}
	if opt.queue == nil {
		opt.queue = &queue{cluster: opt.Cluster}
	}
	p := &Provider{opt: opt, log: opt.Logger, q: opt.queue, creating: map[string]bool{}, claimed: map[string]string{},
		cancelled: map[string]bool{}, last: map[string]string{}, parts: map[string]Partition{}, qoses: map[string]QOS{}, ended: map[string]string{}}
	if err := p.openAccounts(); err != nil {
		return nil, err
	}
	if err := p.fitTimes(); err != nil {
		return nil, err
	}
	for _, d := range []string{p.recordDir(), p.filesDir(), p.logDir(), p.noticeDir()} {
		if opt.ReadOnly {
			break
		}
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("slurm provider: %w", err)
		}
	}
	if len(opt.Section.RunAs) > 0 && !opt.ReadOnly {
		if err := p.shareSpool(); err != nil {
			return nil, fmt.Errorf("slurm provider: %w", err)
		}
	}
	p.poller = &vm.Poller{Interval: opt.Section.PollInterval.Duration, Poll: p.poll, What: "reading the Slurm queue", Logger: p.log}
	if nr, ok := opt.Cluster.(NodeReader); ok {
		p.nodes = provider.NodeSystems{Read: nr.Node, Log: p.log}
	}
	return p, nil
}

// fitTimes works out the runners' --time within the partition's MaxTime
// and the QOS's MaxWall, read from the cluster where they can be (not for
// a pool opened to be read): a pool whose jobs cannot fit is refused with
// both figures.
func (p *Provider) fitTimes() error {
	var b bound
	if !p.opt.ReadOnly {
		ctx, cancel := context.WithTimeout(context.Background(), CallTimeout)
		defer cancel()
		part, err := p.partition(ctx, p.opt.Section.Partition)
		if err != nil {
			return fmt.Errorf("slurm.partition: %w", err)
		}
		if b, err = p.boundIn(ctx, part); err != nil {
			return err
		}
	}
	t, err := fit(p.opt.Section, p.opt.MaxLifetime, p.opt.JobTimeout, b)
	if err != nil {
		return err
	}
	p.times = t
	if p.opt.MaxLifetime > t.idle && !p.opt.ReadOnly {
		p.log.Info("the runners' jobs are bounded: idle runners retire early", "time_limit", t.limit, "bound", b.what, "bound_time", b.max,
			"max_lifetime", p.opt.MaxLifetime, "idle_lifetime", t.idle)
	}
	return nil
}

// IdleLifetime is how long a runner may stay idle from its job's start,
// so that a job it takes can end within its --time (provider.Lifetimer).
func (p *Provider) IdleLifetime() time.Duration { return p.times.idle }

func (p *Provider) recordDir() string { return filepath.Join(p.opt.Spool, "runners") }
func (p *Provider) filesDir() string  { return filepath.Join(p.opt.Spool, "files") }
func (p *Provider) logDir() string    { return filepath.Join(p.opt.Spool, "logs") }

// noticeDir holds the files the jobs leave when Slurm tells them their
// end is near (batchScript), named after the job.
func (p *Provider) noticeDir() string { return filepath.Join(p.opt.Spool, "notices") }
func (p *Provider) recordPath(name string) string {
	return filepath.Join(p.recordDir(), name+".json")
}
func (p *Provider) logPath(name, job string) string {
	return filepath.Join(p.logDir(), name+"-"+job+".log")
}

// comment marks a job as a runner of this manager and pool.
func comment(manager, pool, name string) string {
	return "runfleet manager=" + manager + " pool=" + pool + " runner=" + name
}

// owner reads a job's comment: the manager and pool it is a runner of.
func owner(c string) (manager, pool string, ok bool) {
	rest, ok := strings.CutPrefix(c, "runfleet ")
	if !ok {
		return "", "", false
	}
	for _, f := range strings.Fields(rest) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "manager":
			manager = v
		case "pool":
			pool = v
		}
	}
	return manager, pool, manager != "" && pool != ""
}

// Traits: the agent runs on a node of the cluster, found where this host
// finds it (clusters share their software), and Slurm hands out the
// nodes' GPUs; a job may be preempted or lose its node.
func (p *Provider) Traits() provider.Traits {
	return provider.Traits{Local: true, Preemptible: true, SchedulesGPUs: true}
}

// HardwareLabels describe the GPUs each runner's job asks for.
func (p *Provider) HardwareLabels() []string {
	if p.opt.GPUs <= 0 {
		return nil
	}
	l := []string{"gpu"}
	if t := p.opt.Section.GPUType; t != "" {
		l = append(l, "gpu-"+strings.ToLower(t))
	}
	return append(l, fmt.Sprintf("gpus-%d", p.opt.GPUs))
}

// Calls counts the Slurm commands run, for the metrics.
func (p *Provider) Calls() int64 {
	if c, ok := p.opt.Cluster.(provider.CallCounter); ok {
		return c.Calls()
	}
	return 0
}

// Create submits the runner's job. A runner of that name whose job is
// still queued or running is returned instead.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if err := ctx.Err(); err != nil {
		return provider.Instance{}, err
	}
	if !runnerNameRE.MatchString(spec.Name) {
		return provider.Instance{}, fmt.Errorf("create runner: invalid name %q", spec.Name)
	}
	defer p.markCreating(spec.Name)()
	if rec, err := p.readRecord(spec.Name); err == nil {
		if inst, ok := p.live(ctx, rec); ok {
			return inst, nil
		}
		if err := p.Delete(ctx, spec.Name); err != nil {
			return provider.Instance{}, err
		}
	}
	account, release, err := p.claim(spec.Name)
	if err != nil {
		return provider.Instance{}, fmt.Errorf("create runner %s: %w", spec.Name, err)
	}
	defer release()
	rec := record{Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool, Created: time.Now().UTC(), User: account}
	// The record first: a crash from here on leaves a name to clean up.
	err = p.writeRecord(rec)
	spool := filepath.Join(p.filesDir(), spec.Name)
	if spec.Record != nil {
		sec := p.section(spec.Request)
		m := &spec.Record.Machine
		m.Zone, m.Memory = sec.Partition, sec.Memory
		if c := sec.CPUs; c > 0 {
			m.CPUs = strconv.Itoa(c)
		}
		// The directory is made on the node: the script sets the path.
		spec = spec.WithRecordOnNode(".")
		delete(spec.Env, "RUNFLEET_RECORD")
	}
	if err == nil {
		err = p.writeSpool(ctx, account, spool, spec)
	}
	if err == nil {
		rec.JobID, err = p.submit(ctx, spec, spool, account)
	}
	if err == nil {
		err = p.writeRecord(rec)
	}
	if err != nil {
		if rec.JobID != "" {
			_ = p.as(account).Cancel(context.WithoutCancel(ctx), []string{rec.JobID})
		}
		_ = p.removeSpool(context.WithoutCancel(ctx), account, spool)
		_ = os.Remove(p.recordPath(spec.Name))
		return provider.Instance{}, fmt.Errorf("create runner %s: %w", spec.Name, err)
	}
	p.log.Debug("runner job submitted", "runner", spec.Name, "job", rec.JobID)
	return provider.Instance{Name: rec.Name, Manager: rec.Manager, Pool: rec.Pool, ID: rec.JobID,
		State: provider.StateCreated, Created: rec.Created, Reason: "submitted", Queued: p.opt.Section.QueueWait}, nil
}

func (p *Provider) submit(ctx context.Context, spec provider.Spec, spool, account string) (string, error) {
	t, err := p.timesFor(ctx, spec.Request)
	if err != nil {
		return "", err
	}
	args := []string{
		"--job-name=" + spec.Name,
		"--comment=" + comment(spec.Manager, spec.Pool, spec.Name),
		"--output=" + p.logPath(spec.Name, "%j"),
		// The job starts with the user's login environment on its node,
		// not sbatch's (which is the manager's: see cleanEnv).
		"--export=NONE",
		// Its credential is single-use and gone once it started: a job
		// requeued after a preemption could not run again.
		"--no-requeue",
		"--chdir=" + p.opt.Spool,
		// Slurm's word that the end is near (NoticeSignal): ahead of
		// the time limit, and at a preemption where the site sends it.
		fmt.Sprintf("--signal=B:%s@%d", NoticeSignal, int(noticeLead(t.job)/time.Second)),
	}
	args = append(args, p.section(spec.Request).submitArgs(cmp.Or(spec.Request.GPUs, p.opt.GPUs), t.limit)...)
	return p.as(account).Submit(ctx, batchScript(spec, spool, p.opt.Workdir, p.noticeDir()), args)
}

// live returns a record's job when the queue holds it queued or running.
func (p *Provider) live(ctx context.Context, rec record) (provider.Instance, bool) {
	insts, err := p.List(ctx, rec.Manager)
	if err != nil {
		return provider.Instance{}, false
	}
	for _, in := range insts {
		if in.Name == rec.Name && in.State != provider.StateExited {
			return in, true
		}
	}
	return provider.Instance{}, false
}

// markCreating notes a Create under way, so that a List meanwhile does
// not take its record without a job for one a crash left.
func (p *Provider) markCreating(name string) (done func()) {
	p.mu.Lock()
	p.creating[name] = true
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		delete(p.creating, name)
		p.mu.Unlock()
	}
}

// Delete cancels the runner's job (and any other job of its name this
// manager's pool submitted) and removes its files and record. The job's
// own trap removes its directory on the node.
func (p *Provider) Delete(ctx context.Context, name string) error {
	rec, err := p.readRecord(name)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	var ids []string
	byAccount := map[string][]string{} // the account each job runs as, for scancel
	if rec.JobID != "" {
		ids = append(ids, rec.JobID)
		byAccount[rec.User] = append(byAccount[rec.User], rec.JobID)
	}
	jobs, _, err := p.q.read(ctx, p.opt.Section.PollInterval.Duration)
	if err != nil {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	for _, j := range jobs {
		if m, pool, ok := owner(j.Comment); ok && m == p.opt.Manager && pool == p.opt.Pool && j.Name == name && !finished(j.State) && !slices.Contains(ids, j.ID) {
			ids = append(ids, j.ID)
			account := ""
			if slices.Contains(p.opt.Section.RunAs, j.User) {
				account = j.User
			}
			byAccount[account] = append(byAccount[account], j.ID)
		}
	}
	// Marked as ours before scancel: a poll in between must not take
	// the job's end for someone else's cancel (a notice, a lost job).
	p.mu.Lock()
	fresh := []string{}
	for _, id := range ids {
		if !p.cancelled[id] {
			p.cancelled[id] = true
			fresh = append(fresh, id)
		}
	}
	p.mu.Unlock()
	for account, some := range byAccount {
		if err := p.as(account).Cancel(ctx, some); err != nil {
			p.mu.Lock()
			for _, id := range fresh {
				delete(p.cancelled, id)
			}
			p.mu.Unlock()
			return fmt.Errorf("delete runner %s: %w", name, err)
		}
	}
	if err := p.removeSpool(ctx, rec.User, filepath.Join(p.filesDir(), name)); err != nil {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	for _, id := range ids {
		_ = os.Remove(filepath.Join(p.noticeDir(), id))
	}
	p.mu.Lock()
	delete(p.ended, rec.JobID)
	p.mu.Unlock()
	_ = os.Remove(p.recordPath(name) + ".tmp") // a crash mid-write left it
	if err := os.Remove(p.recordPath(name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete runner %s: %w", name, err)
	}
	provider.PruneFiles(p.logDir(), p.opt.KeepLogs)
	return nil
}

// LocalOutput: the output is a file on this host (provider.LocalOutput).
func (*Provider) LocalOutput() {}

// Output opens the end of a runner's output (sbatch's --output).
func (p *Provider) Output(_ context.Context, inst provider.Instance, max int64) (io.ReadCloser, error) {
	if inst.ID == "" {
		return nil, provider.ErrNoOutput
	}
	return provider.TailFile(p.logPath(inst.Name, inst.ID), max)
}

// Watch reports the runners whose jobs changed state, from one queue
// read per poll interval.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) {
	p.poller.Watch(ctx, changed)
}

// WatchPreemption reports the runners whose jobs Slurm preempted, lost
// with their node, or someone cancelled.
func (p *Provider) WatchPreemption(ctx context.Context, notice func(provider.Notice)) {
	p.poller.WatchPreemption(ctx, notice)
}

// closeWait bounds how long Close waits for cancelled jobs to end.
const closeWait = time.Minute

// Close stops the polling and waits, within closeWait, for the jobs this
// manager cancelled to end (their processes gone, their directories
// removed by their traps), so that a pool that drained leaves nothing on
// a node. Jobs it did not cancel keep running.
func (p *Provider) Close() error {
	p.poller.Stop()
	p.nodes.Close()
	ctx, cancel := context.WithTimeout(context.Background(), closeWait)
	defer cancel()
	for {
		p.mu.Lock()
		ids := maps.Clone(p.cancelled)
		p.mu.Unlock()
		if len(ids) == 0 {
			return nil
		}
		jobs, _, err := p.q.read(ctx, 0)
		if err != nil {
			return fmt.Errorf("slurm provider: waiting for cancelled jobs to end: %w", err)
		}
		var live []string
		for _, j := range jobs {
			if ids[j.ID] && !finished(j.State) {
				live = append(live, j.ID)
			}
		}
		if len(live) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("slurm provider: cancelled jobs %v still ending after %s", live, closeWait)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func (p *Provider) readRecord(name string) (record, error) {
	var rec record
	b, err := os.ReadFile(p.recordPath(name))
	if err != nil {
		return rec, err
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return rec, fmt.Errorf("record of %s: %w", name, err)
	}
	return rec, nil
}

// writeRecord replaces a record whole (a temporary file renamed), so that
// a crash never leaves half of one.
func (p *Provider) writeRecord(rec record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	tmp := p.recordPath(rec.Name) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p.recordPath(rec.Name))
}
