// Package forge defines what runfleet needs from a CI forge (Gitea, GitHub,
// GitLab, ...): registering single-use runners, listing and removing them,
// and reading queued jobs. Each forge has a driver in a sub-package.
package forge

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"time"
)

// ErrBusy is returned by RemoveRunner when the runner is running a job.
// A busy runner is never removed: its job would be lost.
var ErrBusy = errors.New("runner is busy")

// ErrNotFound is returned when a runner does not exist at the forge.
var ErrNotFound = errors.New("runner not found")

// RunnerRequest asks the forge for a new single-use runner registration.
type RunnerRequest struct {
	Name   string
	Labels []string
}

// Credential is what one runner needs to act as itself at the forge. It is
// single-use: it can take one job and cannot register further runners.
type Credential struct {
	RunnerID int64
	// Files are written into the runner's working directory, keyed by
	// relative path (gitea-runner's .runner, for instance). They hold
	// the runner's own token and so are written with mode 0600.
	Files map[string][]byte
	// Env is put in the agent's environment for credentials the agent
	// reads from there (GitHub's runner takes its JIT config from
	// ACTIONS_RUNNER_INPUT_JITCONFIG and clears it before any job step
	// runs), so that they are never a process argument.
	Env map[string]string
}

// Status is a runner's state as the forge sees it.
type Status string

const (
	StatusOffline Status = "offline" // registered, never connected or no longer connected
	StatusIdle    Status = "idle"    // connected and waiting for a job
	StatusBusy    Status = "busy"    // running a job
)

// Runner is a runner registration at the forge.
type Runner struct {
	ID     int64
	Name   string
	Status Status
	Labels []string
}

// Job is a workflow job as the forge reports it.
type Job struct {
	ID         int64
	RunID      int64
	Name       string
	Labels     []string
	Status     string // queued, in_progress, ...
	RunnerID   int64  // set once a runner has taken it
	RunnerName string
	CreatedAt  time.Time
	StartedAt  time.Time
}

// Forge is a CI forge that runfleet provides runners for.
type Forge interface {
	// Register creates a single-use registration for one runner.
	Register(ctx context.Context, req RunnerRequest) (Credential, error)
	// Runners lists the runner registrations in the forge's scope.
	Runners(ctx context.Context) ([]Runner, error)
	// RemoveRunner removes a registration. It returns ErrBusy, and
	// removes nothing, while the runner runs a job.
	RemoveRunner(ctx context.Context, id int64) error
	// Jobs lists the jobs in the forge's scope with the given status
	// ("queued", "in_progress").
	Jobs(ctx context.Context, status string) ([]Job, error)
}

// CountCalls wraps a transport so that every request it sends adds one to
// n, for a driver's call count (runfleet_forge_api_calls_total).
func CountCalls(next http.RoundTripper, n *atomic.Int64) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return counting{next: next, n: n}
}

type counting struct {
	next http.RoundTripper
	n    *atomic.Int64
}

func (c counting) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}
