// Package provider defines what runfleet needs from a compute backend: create
// a machine (a process, container, pod or cloud instance) that runs a forge's
// runner agent, list the ones this manager owns, and delete them. Each
// backend has a driver in a sub-package.
package provider

import (
	"context"
	"time"
)

// Spec describes one runner machine.
type Spec struct {
	// Name is unique per manager and doubles as the runner's name at the
	// forge. Create is idempotent by Name.
	Name    string
	Manager string // the manager id, recorded so another manager never touches it
	Pool    string

	// Command and Args start the agent. Command is resolved on the
	// machine that runs it.
	Command string
	Args    []string
	// Env is the agent's whole environment: nothing is inherited from
	// the manager, whose environment may hold forge tokens.
	Env map[string]string
	// Files are written into the runner's fresh working directory, keyed
	// by relative path, with mode 0600, before the agent starts.
	Files map[string][]byte
	// GPUs are the GPU (or MIG device) ids this runner alone may use:
	// Docker's DeviceIDs, or CUDA_VISIBLE_DEVICES and
	// NVIDIA_VISIBLE_DEVICES for a host process. The provider records
	// them with the machine, so that a restarted manager knows which
	// GPUs are taken.
	GPUs []string
}

// State is a machine's lifecycle state.
type State string

const (
	StateRunning State = "running"
	StateExited  State = "exited" // the agent ended; Delete cleans up what is left
)

// Instance is a machine the provider knows about.
type Instance struct {
	Name    string
	Manager string
	Pool    string
	State   State
	Created time.Time
	// ID is the provider's own identifier (a pid, a container id).
	ID string
	// Log is a file on this host holding the agent's output, when the
	// provider keeps one.
	Log string
	// GPUs are the ids the machine was given (Spec.GPUs).
	GPUs []string
}

// Provider is a compute backend.
type Provider interface {
	// Create starts a machine. Calling it again with a Name that exists
	// returns the existing instance.
	Create(ctx context.Context, spec Spec) (Instance, error)
	// Delete stops a machine and removes everything it left. Deleting a
	// machine that does not exist is not an error.
	Delete(ctx context.Context, name string) error
	// List returns the machines of the given manager, found by their
	// recorded owner, including ones created before a restart.
	List(ctx context.Context, manager string) ([]Instance, error)
}

// Watcher is implemented by providers that can report state changes as
// they happen (a process exit, a Docker event), so that the pool refills a
// slot at once instead of at its next periodic pass.
type Watcher interface {
	// Watch calls changed with the instance name whenever an instance's
	// state changes, until ctx ends. An empty name means that changes may
	// have been missed (the event source reconnected), so everything
	// should be re-read.
	Watch(ctx context.Context, changed func(name string))
}
