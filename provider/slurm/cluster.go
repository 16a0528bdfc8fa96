package slurm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// Cluster is what the provider asks of Slurm: the three commands a user
// on a login node has.
type Cluster interface {
	// Submit queues a batch job and returns its id.
	Submit(ctx context.Context, script []byte, args []string) (id string, err error)
	// Queue returns the jobs of the manager's user the controller holds,
	// in every state, the ended ones too while it keeps them (MinJobAge).
	Queue(ctx context.Context) ([]Job, error)
	// Cancel cancels jobs; one that has ended already is no error.
	Cancel(ctx context.Context, ids []string) error
}

// Job is one job of the queue, in the fields the provider reads.
type Job struct {
	ID, Name, Comment, User string
	// State is Slurm's job state (PENDING, RUNNING, COMPLETED, ...);
	// Reason why it is pending or how it ended ("Resources", "None").
	State, Reason string
	Nodes         string
	Submit, Start time.Time
	// GPUs are the GPUs it got, as "<node>:<index>" (SLURM_JOB_GPUS).
	GPUs []string
	// GRES is what it asked of each node (squeue's %b: gres/gpu:2),
	// where the queue was read by format.
	GRES string
}

// CallTimeout bounds each command: a controller that does not answer
// fails the call rather than holding a pass.
const CallTimeout = 30 * time.Second

// CLI runs sbatch, squeue and scancel. No Go library speaks Slurm's RPC
// (it is C's, behind munge), so the commands are the interface, as for
// every user of a cluster.
type CLI struct {
	// Bin is the directory of the commands; the PATH when empty.
	Bin string
	// User is whose jobs Queue reads, besides the run_as accounts As
	// was asked for: the manager's user when empty.
	User     string
	mu       sync.Mutex
	accounts []string
	calls    atomic.Int64
	bytes    atomic.Int64
	// unfiltered is set once `squeue --json` was seen to ignore the
	// user filter (Slurm 22.05 and before: "All other formatting and
	// filtering arguments will be ignored", squeue(1)).
	unfiltered atomic.Bool
	gpus       sync.Map // job id -> []string: what scontrol said of a job's GPUs
}

// Calls counts the commands run.
func (c *CLI) Calls() int64 { return c.calls.Load() }

// Bytes counts what the commands printed.
func (c *CLI) Bytes() int64 { return c.bytes.Load() }

func (c *CLI) run(ctx context.Context, stdin []byte, name string, args ...string) ([]byte, error) {
	return c.runAs(ctx, "", stdin, name, args...)
}

// runAs runs a command as the manager's user, or as a run_as account
// through `sudo -n -u <account>` (never a password prompt), with the
// same clean environment given through env -i, since sudo's own keeps
// less (SLURM_CONF).
func (c *CLI) runAs(ctx context.Context, account string, stdin []byte, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	path := name
	if c.Bin != "" && !filepath.IsAbs(name) {
		path = filepath.Join(c.Bin, name)
	}
	// The manager's environment may hold forge tokens: the commands get
	// only what finds the cluster. sbatch records its environment with
	// the job; with --export=NONE the job does not get it either.
	env := cleanEnv()
	cmd := exec.CommandContext(ctx, path, args...)
	if account != "" {
		cmd = exec.CommandContext(ctx, "sudo", append(append([]string{"-n", "-u", account, "--", "env", "-i"}, env...), append([]string{path}, args...)...)...)
	}
	cmd.Env = env
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	c.calls.Add(1)
	err := cmd.Run()
	c.bytes.Add(int64(stdout.Len()))
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if ctx.Err() != nil {
			msg = "no answer within " + CallTimeout.String()
		}
		return stdout.Bytes(), &CommandError{Command: name, Message: msg, Err: err}
	}
	return stdout.Bytes(), nil
}

// cleanEnv is what the Slurm commands need of the manager's environment.
func cleanEnv() []string {
	var env []string
	for _, k := range []string{"PATH", "HOME", "USER", "LOGNAME", "SLURM_CONF", "SLURM_CLUSTERS", "MUNGE_SOCKET"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	// TZ: the times squeue prints are read as UTC.
	return append(env, "LC_ALL=C", "TZ=UTC")
}

// CommandError is a Slurm command that failed, with what it said.
type CommandError struct {
	Command, Message string
	Err              error
}

func (e *CommandError) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("%s: %v", e.Command, e.Err)
	}
	return fmt.Sprintf("%s: %s", e.Command, e.Message)
}

func (e *CommandError) Unwrap() []error {
	if refused(e.Message) {
		return []error{e.Err, provider.ErrRejected}
	}
	return []error{e.Err}
}

// What sbatch says of a job that can never run as asked: no retry helps,
// so the pool stops and shows it (provider.ErrRejected). Anything else
// (the controller unreachable or busy, a QOS's submit limit reached) is
// worth another try after the pool's backoff.
var refusals = []string{
	"invalid partition", "invalid account", "invalid qos", "invalid generic resource",
	"invalid trackable resource", "invalid feature specification", "invalid node name",
	"requested node configuration is not available", "requested time limit is invalid",
	"memory required by task is not available", "unrecognized option", "invalid option",
	"user's group not permitted to use this partition", "access/permission denied",
	"invalid user id", "no partition specified", "invalid reservation", "invalid licenses",
	"command not found", "no such file or directory", "permission denied",
}

func refused(msg string) bool {
	m := strings.ToLower(msg)
	for _, r := range refusals {
		if strings.Contains(m, r) {
			return true
		}
	}
	return false
}

// Submit runs sbatch with the script on its standard input.
func (c *CLI) Submit(ctx context.Context, script []byte, args []string) (string, error) {
	return c.submitAs(ctx, "", script, args)
}

func (c *CLI) submitAs(ctx context.Context, account string, script []byte, args []string) (string, error) {
	out, err := c.runAs(ctx, account, script, "sbatch", append([]string{"--parsable"}, args...)...)
	if err != nil {
		return "", err
	}
	// --parsable prints "id" or "id;cluster".
	id, _, _ := strings.Cut(strings.TrimSpace(string(out)), ";")
	if _, err := strconv.ParseUint(id, 10, 64); err != nil {
		return "", fmt.Errorf("sbatch: unexpected answer %q", out)
	}
	return id, nil
}

// Queue reads the user's jobs: `squeue --json` with a user filter, which
// Slurm 23.02 and later honour; where it is ignored (the whole cluster's
// jobs come back), squeue's own format from then on, which every release
// filters.
func (c *CLI) Queue(ctx context.Context) ([]Job, error) {
	users := c.users()
	who := strings.Join(users, ",")
	if !c.unfiltered.Load() {
		out, err := c.run(ctx, nil, "squeue", "--json", "--user="+who, "--states=all")
		if err != nil {
			return nil, err
		}
		jobs, err := ParseQueue(out)
		if err != nil {
			return nil, err
		}
		if !slices.ContainsFunc(jobs, func(j Job) bool { return !slices.Contains(users, j.User) }) {
			return jobs, nil
		}
		c.unfiltered.Store(true)
	}
	return c.queueByFormat(ctx, who)
}

func (c *CLI) setUser(u string) {
	c.mu.Lock()
	c.User = u
	c.mu.Unlock()
}

// users are whose jobs Queue reads: the manager's user, and the run_as
// accounts.
func (c *CLI) users() []string {
	c.mu.Lock()
	me := c.User
	c.mu.Unlock()
	if me == "" {
		me = strconv.Itoa(os.Getuid())
		if u, err := user.Current(); err == nil {
			me = u.Username
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string{me}, c.accounts...)
}

// queueByFormat reads the user's jobs with squeue's format (formatFields)
// and, for a running job with GPUs not seen before, its GPUs' indexes with
// `scontrol -d show job`, which the format cannot print.
func (c *CLI) queueByFormat(ctx context.Context, who string) ([]Job, error) {
	out, err := c.run(ctx, nil, "squeue", "--noheader", "--user="+who, "--states=all", "--format="+strings.Join(formatFields, fieldSep))
	if err != nil {
		return nil, err
	}
	jobs, err := parseFormat(out)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	for i, j := range jobs {
		seen[j.ID] = true
		if !running(j.State) || !strings.Contains(j.GRES, "gpu") {
			continue
		}
		if g, ok := c.gpus.Load(j.ID); ok {
			jobs[i].GPUs = g.([]string)
			continue
		}
		show, err := c.run(ctx, nil, "scontrol", "-d", "show", "job", j.ID)
		if err != nil {
			continue // shown without its GPUs; asked again next time
		}
		jobs[i].GPUs = showGPUs(show)
		c.gpus.Store(j.ID, jobs[i].GPUs)
	}
	c.gpus.Range(func(k, _ any) bool {
		if !seen[k.(string)] {
			c.gpus.Delete(k)
		}
		return true
	})
	return jobs, nil
}

// Cancel runs scancel. A job already gone or ending is what was wanted.
func (c *CLI) Cancel(ctx context.Context, ids []string) error {
	return c.cancelAs(ctx, "", ids)
}

func (c *CLI) cancelAs(ctx context.Context, account string, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	_, err := c.runAs(ctx, account, nil, "scancel", ids...)
	var ce *CommandError
	if errors.As(err, &ce) && alreadyEnded(ce.Message) {
		return nil
	}
	return err
}

func alreadyEnded(msg string) bool {
	for _, line := range strings.Split(msg, "\n") {
		l := strings.ToLower(line)
		if strings.TrimSpace(l) == "" {
			continue
		}
		if !strings.Contains(l, "invalid job id") && !strings.Contains(l, "already completing or completed") {
			return false
		}
	}
	return true
}

// queue is one cluster's queue as last read, shared by every pool of the
// manager on that cluster: a pass of any pool reads it at most once per
// interval, and reads in flight are joined.
type queue struct {
	cluster Cluster
	last    provider.Listing[[]Job]
	jobs    atomic.Int64 // how many the last read returned
}

// jobsPerInterval paces the reads to the size of the queue: each so many
// jobs the last read returned add an interval to the next, up to
// maxInterval, so that a manager of hundreds of runners asks slurmctld
// less often for more.
const (
	jobsPerInterval = 50
	maxInterval     = time.Minute
)

// read returns the queue as read at most maxAge ago (0: a new read), or
// longer ago where the last read's size paces the next.
func (q *queue) read(ctx context.Context, maxAge time.Duration) ([]Job, time.Time, error) {
	if n := q.jobs.Load(); maxAge > 0 && n >= jobsPerInterval {
		maxAge = max(maxAge, min(maxAge*time.Duration(1+n/jobsPerInterval), maxInterval))
	}
	return q.last.Get(ctx, maxAge, time.Now, func(ctx context.Context) ([]Job, error) {
		jobs, err := q.cluster.Queue(ctx)
		if err == nil {
			q.jobs.Store(int64(len(jobs)))
		}
		return jobs, err
	})
}
