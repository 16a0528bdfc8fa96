// Package provider defines what runfleet needs from a compute backend: create
// a machine (a process, container, pod or cloud instance) that runs a forge's
// runner agent, list the ones this manager owns, and delete them, and the
// optional capabilities a backend may add (events, the agent's output,
// notices that a machine is about to be taken back). Each backend has a
// driver in a sub-package, which registers itself with Register.
package provider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/record"
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
	// GPUs are taken. Only providers whose Traits say HostGPUs get any.
	GPUs []string
	// BusyMarker is what the agent prints when it takes a job
	// (agent.Reporter's busy marker), for a machine that decides alone
	// whether it is idle: a cloud instance powers itself off when no
	// job came within the idle timeout, also when the manager is gone.
	// Empty when the agent does not say.
	BusyMarker string
	// Record is the runner's environment record (package record); nil
	// for none. The provider fills in what it decides of the machine
	// (Record.Machine: image and digest, limits, instance type, zone,
	// host) before the machine starts, and gives it to the agent with
	// WithRecord: the file record.File in the working directory and
	// RUNFLEET_RECORD and the record's other variables in the
	// environment, so that the job can read it. Create's caller reads
	// what was filled in.
	Record *record.Record
	// Request is what the runner's job asked its machine to be (a
	// dynamic pool's gpus=2, cpu=8, mem=64g, image=...), within the
	// pool's limits; zero fields keep the pool's settings. Only keys the
	// provider honours (Shaper) come here; GPUs of this host come in
	// GPUs.
	Request dynamic.Request
}

// Hostname is this host's name, for the records of the machines it runs
// (processes, containers); "" when it has none.
func Hostname() string {
	h, _ := os.Hostname()
	return h
}

// WithRecordOnNode is WithRecord for machines whose node is known only
// once they run (a pod, a batch job): the record's file holds
// record.NodeMark where the node goes, for the machine to replace as it
// starts; the environment has no RUNFLEET_NODE, which the machine sets.
func (s Spec) WithRecordOnNode(dir string) Spec {
	if s.Record == nil {
		return s
	}
	s.Record.Machine.Node = ""
	s = s.WithRecord(dir)
	marked := *s.Record
	marked.Machine.Node = record.NodeMark
	s.Files[record.File] = marked.Marshal()
	return s
}

// WithRecord returns the spec with its record, if it has one, among its
// files and its variables in its environment; dir is the runner's working
// directory as the agent sees it, where the files are written.
func (s Spec) WithRecord(dir string) Spec {
	if s.Record != nil {
		s.Files, s.Env = s.Record.WithFiles(s.Files, s.Env, dir)
	}
	return s
}

// State is a machine's lifecycle state.
type State string

const (
	StateRunning State = "running"
	StateExited  State = "exited" // the agent ended; Delete cleans up what is left
	// StateCreated: made but never started. A start may still be under
	// way (sent by a manager killed mid-create, which the engine carries
	// out all the same), so the machine is treated as one coming up, not
	// as one whose agent ended.
	StateCreated State = "created"
)

// Instance is the provider's record of one machine.
type Instance struct {
	Name    string
	Manager string
	Pool    string
	State   State
	Created time.Time
	// ID is the provider's own identifier (a pid, a container id). A
	// machine that replaces another under the same Name has a new ID.
	ID string
	// GPUs are the ids the machine was given (Spec.GPUs).
	GPUs []string
	// Reason says, in the backend's words, why a machine is not running
	// ("Unschedulable: 0/3 nodes are available", "ImagePullBackOff",
	// "Evicted", "Resources"); empty when there is nothing to say.
	// Status shows it.
	Reason string
	// Started is when the machine left its backend's queue and began to
	// run (a batch job that waited for a node); zero when it ran as soon
	// as it was made. The bootstrap timeout and the max lifetime count
	// from it.
	Started time.Time
	// Queued is set while the machine waits in its backend's queue and
	// the pool asked to wait as long as that takes (a Slurm pool with
	// queue_wait: on a busy cluster the wait is the point): the bootstrap
	// timeout does not cut the wait short.
	Queued bool
	// Refused, when set, says why the backend will never run the
	// machine as asked, in its words (an image name that does not parse,
	// an image its registry does not have, an image that breaks the
	// pod's runAsNonRoot). As for a Create error wrapping ErrRejected,
	// the pool retires the machine and starts no runner until its config
	// changes.
	Refused string
	// Machine is what a listing tells of where the machine runs, for the
	// runner's record: what was decided after it was made (a pod's node,
	// a Slurm job's node, the zone a cloud placed it in). Empty fields
	// add nothing to what Create filled in.
	Machine record.Machine
	// System is the system of the machine's host where the provider
	// learns it once the machine runs (a pod's node); nil: nothing more
	// than Create filled in.
	System *record.System
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

// The optional capabilities of a Provider, found by type assertion.

// Watcher is implemented by providers that can report state changes as
// they happen (a process exit, a Docker event), so that the pool refills a
// slot at once instead of at its next periodic pass.
type Watcher interface {
	// Watch calls changed with the instance name whenever an instance's
	// state changes, until ctx ends. An empty name means that changes may
	// have been missed (the event source reconnected), so everything
	// should be re-read. It returns at once; the calls come from the
	// provider's own goroutines.
	Watch(ctx context.Context, changed func(name string))
}

// Describer is implemented by providers that say what kind of backend they
// are. A provider that does not is taken to have the zero Traits.
type Describer interface {
	Traits() Traits
}

// Traits says what kind of backend a provider is.
type Traits struct {
	// Local is set when a machine is this host itself: the agent is a
	// program on this host, found in its PATH, run with an environment
	// built from this host's. Otherwise the agent comes with the
	// machine's image (a container, a pod, a cloud image), whose own
	// PATH applies.
	Local bool
	// HostGPUs is set when the provider gives each machine the GPUs of
	// this host named in Spec.GPUs, so that the pool can divide the
	// host's GPUs among its runners.
	HostGPUs bool
	// Preemptible is set when machines may be taken back before their
	// job ends (spot instances, preemptible VMs, evicted pods); such a
	// provider reports it through Preempter.
	Preemptible bool
	// SchedulesGPUs is set when the backend gives each machine GPUs of
	// its own nodes (Slurm's gres, a pod's nvidia.com/gpu), as many as
	// the pool's gpus_per_runner (PoolConfig.GPUsPerRunner), and the
	// provider reports the ones a machine got in Instance.GPUs where its
	// backend says (Slurm). This host's GPUs play no part.
	SchedulesGPUs bool
	// BootGrace is added to the pool's bootstrap_timeout for a machine
	// that waits for its cloud before its agent starts (an Azure VM for
	// Scheduled Events' first answer, which can take two minutes).
	BootGrace time.Duration
	// KeepsBootData is set when a machine's boot data, which carries
	// its runner's credential, stays readable on the machine and to the
	// account's readers for its whole life (cloud user data, instance
	// metadata): its runner needs a credential that enrols no other
	// runner (forge.RunnerRequest.OneRunnerOnly).
	KeepsBootData bool
}

// TraitsOf returns a provider's traits, the zero Traits when it does not
// say.
func TraitsOf(p Provider) Traits {
	if d, ok := p.(Describer); ok {
		return d.Traits()
	}
	return Traits{}
}

// Labeler is implemented by providers that know from the pool's settings
// the hardware each of its machines gets (a Slurm pool's GPUs: gpu,
// gpu-a100, gpus-1). With hardware_labels, the pool's runners carry these
// labels, as runners given this host's GPUs carry those of their GPUs.
type Labeler interface {
	HardwareLabels() []string
}

// Shaper is implemented by providers that give a machine what its job
// asked for in Spec.Request: Honours lists those keys of package dynamic
// (cpu, mem, image, gpus, spot). A pool's dynamic section may allow no
// other, besides gpus and gpu where the pool gives runners this host's
// GPUs.
type Shaper interface {
	Honours() []string
}

// ShapeChecker is implemented by Shapers that can tell at start whether
// what a pool lets its jobs ask for can be given at all (a Slurm
// partition that does not exist, or whose MaxTime the longest time a job
// may ask for does not fit), so that the pool is refused then rather than
// each job that asks.
type ShapeChecker interface {
	CheckShapes(ctx context.Context, l dynamic.Limits) error
}

// OutputReader is implemented by providers that keep what an agent
// prints, which tells the pool whether the agent waits for a job, runs
// one, or has finished it, without asking the forge.
type OutputReader interface {
	// Output opens the end of the agent's output on a machine: at most
	// the last max bytes. The machine may be gone (a container removed
	// when it exited) while its output can still be read. It returns an
	// error wrapping ErrNoOutput when there is none.
	Output(ctx context.Context, inst Instance, max int64) (io.ReadCloser, error)
}

// LocalOutput is implemented by OutputReaders whose output is a file on
// the manager's host, cheap to read several times a second: the pool
// then watches idle agents' output for the moment one takes a job, where
// a forge must be told at once (forge.Cordoner).
type LocalOutput interface {
	OutputReader
	LocalOutput()
}

// CallCounter is implemented by providers that count the requests they
// send to their backend's API (the apiserver, a cloud's endpoint), for the
// metrics.
type CallCounter interface {
	Calls() int64
}

// ErrRejected is wrapped by a Create error that no retry can fix: the
// backend refused the machine as asked (an image that does not exist, no
// permission, a malformed request). The pool stops starting runners and
// shows the reason until its config changes, instead of retrying; for a
// machine of a dynamic pool's job shape, that shape waits alone.
var ErrRejected = errors.New("the provider refused the request")

// Rejected marks err as one no retry can fix (ErrRejected).
func Rejected(err error) error { return fmt.Errorf("%w: %w", ErrRejected, err) }

// ErrNoOutput is returned by Output when a machine's output is not kept
// (or not yet written).
var ErrNoOutput = errors.New("no output kept for this machine")

// Lifetimer is implemented by providers whose machines end at a time limit
// of their backend's, counted from when they start (a Slurm job's --time,
// within its partition's MaxTime): the pool retires an idle runner older
// than IdleLifetime, so that a job it takes has what is left of the limit
// to finish in. The pool's max_lifetime holds where it is shorter.
type Lifetimer interface {
	IdleLifetime() time.Duration
}

// Preempter is implemented by providers whose machines can be taken back
// before their job ends (Traits.Preemptible).
type Preempter interface {
	// WatchPreemption calls notice for each machine that is about to be
	// taken back, until ctx ends. It returns at once.
	WatchPreemption(ctx context.Context, notice func(Notice))
}

// Notice says that a machine is about to be taken back.
type Notice struct {
	Name string // the machine's Instance.Name
	ID   string // its Instance.ID: a later machine of the same name is not meant
	// At is when the machine goes; zero when the backend does not say.
	At     time.Time
	Reason string // "spot interruption", "rebalance recommendation", ...
}

// Handoffer is implemented by providers whose machines take their
// runner's assignment from the manager rather than from their boot data:
// the manager serves HandoffHandler at /handoff/<pool> on its webhook
// listener. A nil handler: the pool's machines do not (no handoff_url).
type Handoffer interface {
	HandoffHandler() http.Handler
}

// Sweeper is implemented by providers whose machines come with resources
// of their own that outlive a machine deleted by anything but the
// provider (a cloud that evicted it, a person, a crash mid-deletion), or
// that outlive any machine: an Azure VM's auto-shutdown schedule (of
// an earlier version), an EBS
// volume kept after its instance. `runfleet gc` lists them and, after the
// machines, removes them.
type Sweeper interface {
	// Leftovers lists the manager's such resources whose machine is
	// gone.
	Leftovers(ctx context.Context, manager string) ([]Resource, error)
	// Sweep removes one; one already gone is no error.
	Sweep(ctx context.Context, r Resource) error
}

// Resource is one resource a machine left.
type Resource struct {
	Kind string // what it is, in a user's words ("auto-shutdown schedule")
	Name string // the machine's runner, where the resource says
	ID   string // the resource's own name or ID, as Sweep takes it
	// State says why it is listed where its machine is not yet gone
	// (one that will outlive it); empty: its machine is gone.
	State string
}

// Pricer is implemented by providers whose cloud publishes what its
// machines cost (package pricing reads it in the background, so that no
// pass waits on a price list, and keeps the answers).
type Pricer interface {
	// Price is the price by the hour of a machine as its record has it
	// (its type, zone or region, and market), in effect at a moment:
	// the on-demand price, or the Spot price the cloud bills then. An
	// error wrapping ErrNotPriced, or ErrRejected (no permission to read
	// the list), is one that asking again does not fix.
	Price(ctx context.Context, m record.Machine, at time.Time) (record.Price, error)
}

// ErrNotPriced is wrapped by a Pricer's error when the price list has no
// price for the machine (a type or region it does not list).
var ErrNotPriced = errors.New("the price list has no price for this machine")
