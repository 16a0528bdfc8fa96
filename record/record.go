// Package record describes the environment a runner was given: the
// manager, pool and provider that made it, the machine it ran on, its
// image, GPUs and limits, and the job it took. A job reads its runner's
// record from a file in its work area (the path in RUNFLEET_RECORD) and
// from environment variables, so that a training script can keep it with
// its model; the manager keeps the same records as the history of jobs.
//
// A record holds no secret: nothing of the forge's credentials, the
// runner's own credential or the pool's environment goes into it.
package record

import (
	"encoding/json"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"
)

// Schema is the version of the record's JSON shape.
const Schema = 1

// File is where the record is written, relative to the runner's working
// directory; RUNFLEET_RECORD gives the job its absolute path.
const File = "runfleet-record.json"

// NodeMark stands for the node in a record's file written before the
// machine has one (a pod, a batch job); the machine replaces it as it
// starts.
const NodeMark = "@RUNFLEET_NODE@"

// Record is what one runner was given and what became of its job.
type Record struct {
	Schema int `json:"schema"`
	// ID names the record in the manager's history (IDOf): the job gets
	// it too (RUNFLEET_RECORD_ID), so that a training run can store it and
	// find its record later (`runfleet jobs --id`, /jobs/<id>).
	ID     string `json:"id,omitempty"`
	Runner string `json:"runner"`
	// Registration is the runner's id at its forge, never reused.
	Registration   int64    `json:"registration,omitempty"`
	Manager        string   `json:"manager"`
	ManagerVersion string   `json:"manager_version,omitempty"`
	Forge          string   `json:"forge"`      // the config's name for the forge
	ForgeType      string   `json:"forge_type"` // gitea, github, ...
	Pool           string   `json:"pool"`
	Provider       string   `json:"provider"`
	Labels         []string `json:"labels,omitempty"`
	Machine        Machine  `json:"machine"`
	GPUs           []GPU    `json:"gpus,omitempty"`
	Driver         string   `json:"driver_version,omitempty"` // the GPU driver's
	CUDA           string   `json:"cuda_version,omitempty"`   // the newest the driver supports

	Created    time.Time `json:"created"`              // the registration made, the machine asked for
	Online     time.Time `json:"online,omitzero"`      // first seen waiting for a job
	JobStarted time.Time `json:"job_started,omitzero"` // first seen running one
	Ended      time.Time `json:"ended,omitzero"`       // its agent ended, or its machine went
	Job        *Job      `json:"job,omitempty"`        // once the forge names the job
	// Price is what its machine costs by the hour; nil where the pool
	// says nothing of it.
	Price *Price `json:"price,omitempty"`
	// System is what its machine's host runs on, where the provider can
	// tell (this host, a Docker engine's); nil elsewhere.
	System *System `json:"system,omitempty"`
}

// System is a host's operating system, kernel, CPU and memory, and the
// container runtime it runs machines with.
type System struct {
	OS        string `json:"os,omitempty"` // os-release's PRETTY_NAME: "Debian GNU/Linux 12 (bookworm)"
	Kernel    string `json:"kernel,omitempty"`
	Arch      string `json:"arch,omitempty"` // Go's: amd64, arm64
	CPU       string `json:"cpu,omitempty"`  // the CPU's model
	CPUs      int    `json:"cpus,omitempty"` // the host's, not the runner's limit
	MemoryMiB uint64 `json:"memory_mib,omitempty"`
	// Runtime is the container runtime and its version ("Docker Engine
	// 28.2.2"), and Runtimes the OCI runtimes it has (nvidia among them
	// where NVIDIA's container toolkit is set up).
	Runtime  string   `json:"runtime,omitempty"`
	Runtimes []string `json:"runtimes,omitempty"`
	// NvidiaToolkit is the version of NVIDIA's container toolkit that
	// gives the containers their GPUs, where the engine runs on the
	// manager's host and has its runtime.
	NvidiaToolkit string `json:"nvidia_container_toolkit,omitempty"`
}

// Price is what a runner's machine costs by the hour.
type Price struct {
	PerHour  float64 `json:"per_hour"`
	Currency string  `json:"currency,omitempty"`
	// Source says where the figure came from: "price_per_hour" or
	// "prices" (the pool's config), or a cloud's price list.
	Source string `json:"source,omitempty"`
}

// Held is how long the runner's machine was held: from its creation to
// its end, or to now while it lasts.
func (r Record) Held(now time.Time) time.Duration {
	end := r.Ended
	if end.IsZero() {
		end = now
	}
	if end.Before(r.Created) {
		return 0
	}
	return end.Sub(r.Created)
}

// Cost is the machine's price for the time it was held; 0 without one.
func (r Record) Cost(now time.Time) float64 {
	if r.Price == nil {
		return 0
	}
	return r.Price.PerHour * r.Held(now).Hours()
}

// GPUSeconds is the GPU time the runner held: each of its GPUs for as
// long as its machine was held, used or not, as a cloud bills it.
func (r Record) GPUSeconds(now time.Time) float64 {
	return float64(len(r.GPUs)) * r.Held(now).Seconds()
}

// Machine is where a runner ran, as far as its provider knows.
type Machine struct {
	// ID is the provider's own: a pid, a container id, a pod's name, an
	// instance id, a Slurm job id.
	ID string `json:"id,omitempty"`
	// Host is the host that runs a process or container (the manager's).
	Host string `json:"host,omitempty"`
	// Node is the cluster's node: a pod's, a Slurm job's.
	Node         string `json:"node,omitempty"`
	InstanceType string `json:"instance_type,omitempty"`
	Zone         string `json:"zone,omitempty"` // a cloud's zone or region, or a Slurm partition
	Spot         bool   `json:"spot,omitempty"`
	Image        string `json:"image,omitempty"`
	// ImageDigest identifies the image's content: the registry's digest
	// where the image has one, else the engine's image id.
	ImageDigest string  `json:"image_digest,omitempty"`
	CPUs        string  `json:"cpus,omitempty"`   // the limit, "4", "0.5"
	Memory      string  `json:"memory,omitempty"` // the limit, "16g", "512Mi"
	Datasets    []Mount `json:"datasets,omitempty"`
}

// Mount is a dataset given to the runner.
type Mount struct {
	Source   string `json:"source"`
	Target   string `json:"target"`
	ReadOnly bool   `json:"read_only"`
}

// GPU is one GPU (or MIG device) the runner alone was given.
type GPU struct {
	// ID is what selected it: a UUID, "<gpu>:<mig>", a Slurm "node:index".
	ID         string `json:"id"`
	Index      int    `json:"index"`
	UUID       string `json:"uuid,omitempty"`
	Model      string `json:"model,omitempty"`
	MemoryMiB  uint64 `json:"memory_mib,omitempty"`
	MIGProfile string `json:"mig_profile,omitempty"`
}

// Job is the forge's job the runner took.
type Job struct {
	ID         int64     `json:"id"`
	RunID      int64     `json:"run_id,omitempty"`
	Name       string    `json:"name,omitempty"`
	Attempt    int       `json:"attempt,omitempty"`
	URL        string    `json:"url,omitempty"`
	Status     string    `json:"status,omitempty"` // queued, in_progress, completed
	Conclusion string    `json:"conclusion,omitempty"`
	Queued     time.Time `json:"queued,omitzero"`
	Started    time.Time `json:"started,omitzero"`
	Completed  time.Time `json:"completed,omitzero"`
	// Where its code came from, where the forge says: the repository
	// (owner/name, a project's path), the commit, the branch or tag, the
	// workflow or pipeline, and who started the run.
	Repository string `json:"repository,omitempty"`
	Commit     string `json:"commit,omitempty"`
	Ref        string `json:"ref,omitempty"`
	Workflow   string `json:"workflow,omitempty"`
	Actor      string `json:"actor,omitempty"`
}

// IDOf is a record's id in the history: its creation time, fixed-width
// so that ids sort by time, and its runner's name.
func IDOf(r Record) string {
	return fmt.Sprintf("%019d-%s", r.Created.UnixNano(), r.Runner)
}

// Waited is how long the job waited for a runner; zero when unknown.
func (j *Job) Waited() time.Duration {
	if j == nil || j.Queued.IsZero() || j.Started.Before(j.Queued) {
		return 0
	}
	return j.Started.Sub(j.Queued)
}

// Ran is how long the job ran; zero until it completed.
func (j *Job) Ran() time.Duration {
	if j == nil || j.Started.IsZero() || j.Completed.Before(j.Started) {
		return 0
	}
	return j.Completed.Sub(j.Started)
}

// GPUUUIDs are the UUIDs of the runner's GPUs, or their ids where the
// UUID is unknown.
func (r Record) GPUUUIDs() []string {
	var out []string
	for _, g := range r.GPUs {
		if g.UUID != "" {
			out = append(out, g.UUID)
		} else {
			out = append(out, g.ID)
		}
	}
	return out
}

// Marshal writes the record as the file a job reads.
func (r Record) Marshal() []byte {
	r.Schema = Schema
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		// Only strings, numbers and times: it cannot fail.
		panic(err)
	}
	return append(b, '\n')
}

// Env is what a job finds in its environment, path being where the
// record's file is on the machine: RUNFLEET_RECORD and the facts a
// script most often wants without reading JSON.
func (r Record) Env(path string) map[string]string {
	env := map[string]string{
		"RUNFLEET_RECORD":   path,
		"RUNFLEET_RUNNER":   r.Runner,
		"RUNFLEET_POOL":     r.Pool,
		"RUNFLEET_PROVIDER": r.Provider,
	}
	set := func(k, v string) {
		if v != "" {
			env[k] = v
		}
	}
	set("RUNFLEET_RECORD_ID", r.ID)
	set("RUNFLEET_MANAGER_VERSION", r.ManagerVersion)
	set("RUNFLEET_GPU_UUIDS", strings.Join(r.GPUUUIDs(), ","))
	set("RUNFLEET_DRIVER_VERSION", r.Driver)
	set("RUNFLEET_CUDA_VERSION", r.CUDA)
	set("RUNFLEET_IMAGE", r.Machine.Image)
	set("RUNFLEET_IMAGE_DIGEST", r.Machine.ImageDigest)
	set("RUNFLEET_INSTANCE_TYPE", r.Machine.InstanceType)
	set("RUNFLEET_ZONE", r.Machine.Zone)
	set("RUNFLEET_NODE", r.Machine.Node)
	return env
}

// WithFiles returns files and env with the record added: its file at
// File, and the variables of Env for its path under dir, the runner's
// working directory on the machine. The maps given are not changed.
func (r Record) WithFiles(files map[string][]byte, env map[string]string, dir string) (map[string][]byte, map[string]string) {
	files, env = maps.Clone(files), maps.Clone(env)
	if files == nil {
		files = map[string][]byte{}
	}
	if env == nil {
		env = map[string]string{}
	}
	files[File] = r.Marshal()
	maps.Copy(env, r.Env(strings.TrimSuffix(dir, "/")+"/"+File))
	return files, env
}

// Merge takes what m knows that r's machine does not: a later listing's
// node, a Slurm job's id.
func (m *Machine) Merge(o Machine) bool {
	changed := false
	take := func(dst *string, src string) {
		if src != "" && *dst != src {
			*dst, changed = src, true
		}
	}
	take(&m.ID, o.ID)
	take(&m.Host, o.Host)
	take(&m.Node, o.Node)
	take(&m.InstanceType, o.InstanceType)
	take(&m.Zone, o.Zone)
	take(&m.Image, o.Image)
	take(&m.ImageDigest, o.ImageDigest)
	take(&m.CPUs, o.CPUs)
	take(&m.Memory, o.Memory)
	if o.Spot && !m.Spot {
		m.Spot, changed = true, true
	}
	if len(o.Datasets) > 0 && len(m.Datasets) == 0 {
		m.Datasets, changed = o.Datasets, true
	}
	return changed
}

// Bytes writes a memory limit in the largest unit that divides it, as a
// config would: "16g", "512m", "1536k"; bytes otherwise.
func Bytes(n int64) string {
	for _, u := range []struct {
		suffix string
		size   int64
	}{{"t", 1 << 40}, {"g", 1 << 30}, {"m", 1 << 20}, {"k", 1 << 10}} {
		if n >= u.size && n%u.size == 0 {
			return strconv.FormatInt(n/u.size, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// Prices is what a pool's machines cost by the hour, from its config: one
// price for every machine, or one per machine type.
type Prices struct {
	PerHour  *float64           // price_per_hour; nil: none
	ByType   map[string]float64 // prices, by instance or machine type
	Currency string
}

// For is the price of a machine; nil where the pool names none for it.
func (p *Prices) For(m Machine) *Price {
	if p == nil {
		return nil
	}
	if v, ok := p.ByType[m.InstanceType]; ok && m.InstanceType != "" {
		return &Price{PerHour: v, Currency: p.Currency, Source: "prices"}
	}
	if p.PerHour != nil {
		return &Price{PerHour: *p.PerHour, Currency: p.Currency, Source: "price_per_hour"}
	}
	return nil
}
