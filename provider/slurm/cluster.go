package slurm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// Cluster is what the provider asks of Slurm: the three commands a user
// on a login node has.
type Cluster interface {
	// Submit queues a batch job and returns its id.
	Submit(ctx context.Context, script []byte, args []string) (id string, err error)
	// Queue returns every job the controller holds (squeue --json lists
	// the whole cluster's, whatever it is asked).
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
}

// CallTimeout bounds each command: a controller that does not answer
// fails the call rather than holding a pass.
const CallTimeout = 30 * time.Second

// CLI runs sbatch, squeue and scancel. No Go library speaks Slurm's RPC
// (it is C's, behind munge), so the commands are the interface, as for
// every user of a cluster.
type CLI struct {
	// Bin is the directory of the commands; the PATH when empty.
	Bin   string
	calls atomic.Int64
}

// Calls counts the commands run.
func (c *CLI) Calls() int64 { return c.calls.Load() }

func (c *CLI) run(ctx context.Context, stdin []byte, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	path := name
	if c.Bin != "" {
		path = filepath.Join(c.Bin, name)
	}
	cmd := exec.CommandContext(ctx, path, args...)
	// The manager's environment may hold forge tokens: the commands get
	// only what finds the cluster. sbatch records its environment with
	// the job; with --export=NONE the job does not get it either.
	cmd.Env = cleanEnv()
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	c.calls.Add(1)
	err := cmd.Run()
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
	return append(env, "LC_ALL=C")
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
	out, err := c.run(ctx, script, "sbatch", append([]string{"--parsable"}, args...)...)
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

// Queue runs squeue --json.
func (c *CLI) Queue(ctx context.Context) ([]Job, error) {
	out, err := c.run(ctx, nil, "squeue", "--json")
	if err != nil {
		return nil, err
	}
	return ParseQueue(out)
}

// Cancel runs scancel. A job already gone or ending is what was wanted.
func (c *CLI) Cancel(ctx context.Context, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	_, err := c.run(ctx, nil, "scancel", ids...)
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
}

// read returns the queue as read at most maxAge ago (0: a new read).
func (q *queue) read(ctx context.Context, maxAge time.Duration) ([]Job, time.Time, error) {
	return q.last.Get(ctx, maxAge, time.Now, q.cluster.Queue)
}
