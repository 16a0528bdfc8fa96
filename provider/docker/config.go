package docker

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/docker/go-units"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/gpu"
)

// Section is a pool's `docker:` section: its runner containers.
type Section struct {
	// Image runs the agent; it must hold the agent binary and whatever the
	// jobs need. It may be a template of the driver's CUDA version:
	// "nvidia/cuda:{{.CUDA}}.0-runtime-ubuntu24.04" (also .CUDAMajor,
	// .CUDAMinor, .Driver).
	Image string `json:"image"`
	// Images, instead of Image: each with the oldest CUDA version it
	// needs; the newest one the host's driver supports is used.
	Images []Image `json:"images"`
	// Pull is when the image is pulled: missing (the default), always or
	// never.
	Pull string `json:"pull"`
	// Network is the network mode or the name of a network; Docker's
	// default bridge when empty.
	Network string `json:"network"`
	// CPUs limits the container's CPU time, in CPUs ("1.5").
	CPUs float64 `json:"cpus"`
	// Memory limits the container's memory ("8g", "512m").
	Memory string `json:"memory"`
	// ShmSize sizes /dev/shm ("2g"); data loaders that share tensors
	// through it need more than Docker's 64m.
	ShmSize string `json:"shm_size"`
	// OOMScoreAdj is the containers' oom_score_adj, 1000 by default, so
	// that the kernel kills a job before the host's own services when
	// memory runs out.
	OOMScoreAdj *int `json:"oom_score_adj"`
	// Volumes are bind mounts "source:target[:ro|rw]", read-only unless
	// ":rw" is written out. A source that is not an absolute path names
	// a Docker volume.
	Volumes []string `json:"volumes"`
	// GPUs asks for GPUs: "all", or a list of device indexes or UUIDs.
	GPUs GPUList `json:"gpus"`
	// ExtraHosts are added to the container's /etc/hosts ("name:ip").
	// host.docker.internal always points at the host.
	ExtraHosts []string `json:"extra_hosts"`
	// MountDockerSocket gives jobs the host's Docker socket. Any job can
	// then take over the host; it is off unless set here.
	MountDockerSocket bool `json:"mount_docker_socket"`
	// Workdir is where the agent runs inside the container.
	Workdir string `json:"workdir"`
	// User runs the agent ("uid[:gid]" or a name known to the image); the
	// image's user when empty.
	User string `json:"user"`
}

// Image is one of a pool's images, with the oldest CUDA version it needs
// ("12.4").
type Image struct {
	Image   string `json:"image"`
	MinCUDA string `json:"min_cuda"`
}

// Section defaults.
const (
	DefaultOOMScoreAdj      = 1000
	DefaultContainerWorkdir = "/runner"
)

// PullPolicies are the values of pull.
var PullPolicies = []string{"missing", "always", "never"}

// DecodeSection reads a pool's docker section strictly, fills in the
// defaults and checks it. gpusPerRunner is the pool's gpus_per_runner.
// Every problem found is returned, each naming its field relative to the
// pool ("docker.memory: ...").
func DecodeSection(raw json.RawMessage, gpusPerRunner int) (Section, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return Section{}, errors.New("docker: is required with provider docker (at least docker.image)")
	}
	if raw = bytes.TrimSpace(raw); raw[0] != '{' {
		return Section{}, errors.New("docker: must be a mapping")
	}
	var s Section
	var errs []error
	// A key that did not decode leaves its field empty: the rest is
	// checked all the same, so that every problem shows at once.
	errs = append(errs, config.Within("docker", config.DecodeSection(raw, &s)))
	s.setDefaults()
	errs = append(errs, config.Within("docker", errors.Join(s.validate()...)))
	if gpusPerRunner != 0 && s.GPUs.Any() {
		errs = append(errs, errors.New("gpus_per_runner: is set with docker.gpus, which gives every runner the same GPUs; keep one of them"))
	}
	return s, errors.Join(errs...)
}

// GPUImages returns the images in the gpu package's terms; call it on a
// checked section.
func (d *Section) GPUImages() []gpu.Image {
	var out []gpu.Image
	for _, im := range d.Images {
		v, _ := gpu.ParseVersion(im.MinCUDA)
		out = append(out, gpu.Image{Image: im.Image, MinCUDA: v})
	}
	return out
}

// NeedsGPUs reports whether the image is chosen by the host's CUDA
// version.
func (d *Section) NeedsGPUs() bool { return len(d.Images) > 0 || gpu.IsTemplate(d.Image) }

func (d *Section) setDefaults() {
	if d.Pull == "" {
		d.Pull = "missing"
	}
	if d.OOMScoreAdj == nil {
		v := DefaultOOMScoreAdj
		d.OOMScoreAdj = &v
	}
	if d.Workdir == "" {
		d.Workdir = DefaultContainerWorkdir
	}
}

// MemoryBytes is the memory limit in bytes; 0 when unset.
func (d *Section) MemoryBytes() (int64, error) { return bytesize(d.Memory) }

// ShmBytes is the /dev/shm size in bytes; 0 when unset.
func (d *Section) ShmBytes() (int64, error) { return bytesize(d.ShmSize) }

func bytesize(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	n, err := units.RAMInBytes(s)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%q is not a size (write \"512m\", \"8g\")", s)
	}
	return n, nil
}

// validate returns each problem as "field: message", relative to the
// docker section.
func (d *Section) validate() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	switch {
	case d.Image == "" && len(d.Images) == 0:
		bad("image", "is required (or images)")
	case d.Image != "" && len(d.Images) > 0:
		bad("images", "is set with image; keep one of them")
	case strings.ContainsAny(d.Image, " \t\n") && !gpu.IsTemplate(d.Image):
		bad("image", "%q is not an image reference", d.Image)
	case gpu.IsTemplate(d.Image):
		if err := gpu.CheckTemplate(d.Image); err != nil {
			bad("image", "%q is not a valid template: %v", d.Image, err)
		}
	}
	for i, im := range d.Images {
		f := fmt.Sprintf("images[%d]", i)
		if im.Image == "" || strings.ContainsAny(im.Image, " \t\n") {
			bad(f+".image", "%q is not an image reference", im.Image)
		}
		if _, err := gpu.ParseVersion(im.MinCUDA); err != nil {
			bad(f+".min_cuda", "%v", err)
		}
	}
	if !slices.Contains(PullPolicies, d.Pull) {
		bad("pull", "unknown policy %q (known: %s)", d.Pull, strings.Join(PullPolicies, ", "))
	}
	if d.CPUs < 0 {
		bad("cpus", "must not be negative, got %g", d.CPUs)
	}
	if _, err := d.MemoryBytes(); err != nil {
		bad("memory", "%v", err)
	}
	if _, err := d.ShmBytes(); err != nil {
		bad("shm_size", "%v", err)
	}
	if d.OOMScoreAdj != nil && (*d.OOMScoreAdj < -1000 || *d.OOMScoreAdj > 1000) {
		bad("oom_score_adj", "%d is outside -1000..1000", *d.OOMScoreAdj)
	}
	for i, v := range d.Volumes {
		m, err := ParseVolume(v)
		if err != nil {
			bad(fmt.Sprintf("volumes[%d]", i), "%v", err)
			continue
		}
		if IsDockerSocket(m.Source) && !d.MountDockerSocket {
			bad(fmt.Sprintf("volumes[%d]", i), "%q mounts the Docker socket, which gives every job the host; set mount_docker_socket: true if that is meant", v)
		}
	}
	if d.GPUs.invalid != "" {
		bad("gpus", "%s is not \"all\" or a list of GPU indexes or UUIDs", d.GPUs.invalid)
	}
	for i, id := range d.GPUs.IDs {
		if id == "" || strings.ContainsAny(id, ", \t") {
			bad(fmt.Sprintf("gpus[%d]", i), "%q is not a GPU index or UUID", id)
		}
	}
	for i, h := range d.ExtraHosts {
		if name, ip, ok := strings.Cut(h, ":"); !ok || name == "" || ip == "" {
			bad(fmt.Sprintf("extra_hosts[%d]", i), "%q is not name:ip", h)
		}
	}
	if !path.IsAbs(d.Workdir) || path.Clean(d.Workdir) == "/" {
		bad("workdir", "%q must be an absolute path below /", d.Workdir)
	}
	return errs
}

// Options turns a checked section into the provider's options for its
// containers; the caller adds what is not in the section (client, manager,
// pool, directories).
func (d *Section) Options() (Options, error) {
	mem, err := d.MemoryBytes()
	if err != nil {
		return Options{}, fmt.Errorf("memory: %w", err)
	}
	shm, err := d.ShmBytes()
	if err != nil {
		return Options{}, fmt.Errorf("shm_size: %w", err)
	}
	opt := Options{
		Image:             d.Image,
		Pull:              d.Pull,
		Network:           d.Network,
		User:              d.User,
		Workdir:           d.Workdir,
		NanoCPUs:          int64(d.CPUs * 1e9),
		Memory:            mem,
		ShmSize:           shm,
		OOMScoreAdj:       DefaultOOMScoreAdj,
		GPUs:              GPUs{All: d.GPUs.All, IDs: d.GPUs.IDs},
		ExtraHosts:        d.ExtraHosts,
		MountDockerSocket: d.MountDockerSocket,
	}
	if d.OOMScoreAdj != nil {
		opt.OOMScoreAdj = *d.OOMScoreAdj
	}
	for _, v := range d.Volumes {
		m, err := ParseVolume(v)
		if err != nil {
			return Options{}, err
		}
		opt.Mounts = append(opt.Mounts, m)
	}
	return opt, nil
}

// ParseVolume parses "source:target[:ro|rw]". A mount is read-only unless
// it says rw: datasets must not be changed by a job.
func ParseVolume(s string) (Mount, error) {
	parts := strings.Split(s, ":")
	if len(parts) < 2 || len(parts) > 3 {
		return Mount{}, fmt.Errorf("%q is not source:target[:ro|rw]", s)
	}
	v := Mount{Source: parts[0], Target: parts[1], ReadOnly: true}
	if len(parts) == 3 {
		switch parts[2] {
		case "ro":
		case "rw":
			v.ReadOnly = false
		default:
			return Mount{}, fmt.Errorf("%q: mode %q is not ro or rw", s, parts[2])
		}
	}
	if v.Source == "" {
		return Mount{}, fmt.Errorf("%q has no source", s)
	}
	if !path.IsAbs(v.Target) {
		return Mount{}, fmt.Errorf("%q: target %q must be an absolute path", s, v.Target)
	}
	if !strings.HasPrefix(v.Source, "/") && strings.Contains(v.Source, "/") {
		return Mount{}, fmt.Errorf("%q: source %q must be an absolute path or a volume name", s, v.Source)
	}
	return v, nil
}

// IsDockerSocket reports whether a mount source is the Docker socket or
// the directory holding it.
func IsDockerSocket(src string) bool {
	src = path.Clean(src)
	return strings.HasSuffix(src, "/docker.sock") || src == "/var/run" || src == "/run" || src == "/run/docker" || src == "/var/run/docker"
}

// GPUList is "all" or a list of device indexes or UUIDs.
type GPUList struct {
	All bool
	IDs []string
	// invalid keeps what did not parse, for validate to name.
	invalid string
}

// Any reports whether GPUs were asked for.
func (g GPUList) Any() bool { return g.All || len(g.IDs) > 0 }

func (g GPUList) MarshalJSON() ([]byte, error) {
	if g.All {
		return json.Marshal("all")
	}
	return json.Marshal(g.IDs)
}

func (g *GPUList) UnmarshalJSON(b []byte) error {
	*g = GPUList{}
	b = bytes.TrimSpace(b)
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		if s == "all" {
			g.All = true
		} else {
			g.invalid = strconv.Quote(s)
		}
		return nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(b, &list); err != nil {
		g.invalid = string(b)
		return nil
	}
	for _, raw := range list {
		var id string
		var n int
		switch {
		case json.Unmarshal(raw, &id) == nil:
		case json.Unmarshal(raw, &n) == nil && n >= 0:
			id = strconv.Itoa(n)
		default:
			g.invalid = string(b)
			return nil
		}
		g.IDs = append(g.IDs, id)
	}
	return nil
}
