// Package docker runs each runner in its own throw-away container on a
// Docker engine, through the Engine API.
//
// A container takes exactly one job: the agent's ephemeral registration
// makes it exit after the job, and AutoRemove deletes the container with
// everything the job wrote. On an engine with live-restore the provider
// removes exited containers itself instead: engines before 24.0.8 kill
// AutoRemove containers when they restart (moby/moby#46308), and with them
// the jobs that live-restore is there to keep. Containers carry the manager id, pool and slot
// in their labels; the labels are the truth after a restart, and a
// container without this manager's label is never touched.
package docker

import (
	"archive/tar"
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/api/pkg/stdcopy"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/api/types/events"
	mountpkg "github.com/moby/moby/api/types/mount"
	"github.com/moby/moby/api/types/system"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
	"github.com/runfleet/runfleet/sysinfo"
	"github.com/runfleet/runfleet/version"
)

// Labels on every container runfleet creates.
const (
	LabelManager = "runfleet.manager"
	LabelPool    = "runfleet.pool"
	LabelRunner  = "runfleet.runner" // the runner's name, <pool>-<slot>
	LabelSlot    = "runfleet.slot"
	// LabelGPUs holds the GPU ids a container was given, comma-separated.
	LabelGPUs = "runfleet.gpus"
)

// Mount is a bind mount or a named volume.
type Mount struct {
	Source   string // an absolute host path, or a volume name
	Target   string
	ReadOnly bool
}

// GPUs asks for GPU devices through the nvidia device driver.
type GPUs struct {
	All bool
	IDs []string // indexes or UUIDs; used when All is false
}

// Options configures the containers of one pool.
type Options struct {
	Client *client.Client
	// ReadOnly: only List and Output are used; no directory is made.
	ReadOnly bool
	// Manager and Pool select this provider's containers. Pool may be
	// empty to list every pool of the manager.
	Manager string
	Pool    string

	Image string
	// Pull is missing, always or never.
	Pull    string
	Network string
	User    string
	// Workdir is the agent's directory inside the container; the spec's
	// files are there (mounted or copied) before the container starts.
	Workdir     string
	NanoCPUs    int64
	Memory      int64
	ShmSize     int64
	OOMScoreAdj int
	Mounts      []Mount
	GPUs        GPUs
	ExtraHosts  []string
	// MountDockerSocket gives jobs the host's Docker engine.
	MountDockerSocket bool

	// LogDir receives a copy of each agent's output, which AutoRemove
	// would otherwise delete with its container.
	LogDir string
	// FilesDir, when set, holds each container's files (the runner's
	// registration), bind-mounted as its workdir. It must be on
	// the engine's host. Without it, files are copied into the container.
	FilesDir string
	Logger   *slog.Logger

	// CallTimeout bounds each request to the engine (1 min when 0), and
	// PullTimeout an image pull (30 min when 0): an engine that accepts
	// connections and never answers must not hang the pool. The event
	// stream and log copies are streams, watched otherwise.
	CallTimeout, PullTimeout time.Duration

	// closeClient is set when the provider made the client itself, and
	// so closes it.
	closeClient bool
}

// Provider runs runners as Docker containers.
type Provider struct {
	opt Options
	cli *client.Client
	log *slog.Logger

	mu     sync.Mutex
	pulled map[string]bool // images pulled since the start, for pull: always
	// The image's user (to choose between mounting and copying files)
	// and its identity (for runners' records), read once, and again
	// after a pull.
	images map[string]imageFacts // by reference
	// Whether the engine has live-restore, and its host's name, asked
	// once.
	liveRestoreKnown, liveRestoreOn bool
	engineHost                      string
	engineSystem                    *record.System // the engine's host, as it says
	// followed holds the containers whose output this provider copies
	// (true) or has copied (false), until they are gone.
	followed map[string]bool
	copied   map[string]chan struct{} // closed when a container's copy ends
	wg       sync.WaitGroup
	// watching is set once the pool runs (Watch was called): only then
	// does List adopt output copies and prune files.
	watching atomic.Bool
	// creating counts the Creates under way and created those done: a
	// listing that no Create overlapped shows every container there is,
	// so any files directory it does not show is stale, however young.
	creating, created atomic.Int64
	// bg bounds the output copies, which outlive the calls that start
	// them; Close ends it.
	bg     context.Context
	cancel context.CancelFunc
}

// New returns a provider for one pool's containers.
func New(opt Options) (*Provider, error) {
	if opt.Client == nil {
		return nil, errors.New("docker provider: no client")
	}
	if opt.Manager == "" {
		return nil, errors.New("docker provider: no manager id")
	}
	if opt.Workdir == "" {
		opt.Workdir = "/runner"
	}
	if opt.Pull == "" {
		opt.Pull = "missing"
	}
	if opt.CallTimeout <= 0 {
		opt.CallTimeout = time.Minute
	}
	if opt.PullTimeout <= 0 {
		opt.PullTimeout = 30 * time.Minute
	}
	if opt.Logger == nil {
		opt.Logger = slog.New(slog.DiscardHandler)
	}
	for _, d := range []string{opt.LogDir, opt.FilesDir} {
		if d == "" || opt.ReadOnly {
			continue
		}
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("docker provider: %w", err)
		}
	}
	if opt.MountDockerSocket {
		opt.Logger.Warn("pool mounts the Docker socket: every job can control the host's Docker engine, and so the host", "pool", opt.Pool)
	}
	bg, cancel := context.WithCancel(context.Background())
	return &Provider{opt: opt, cli: opt.Client, log: opt.Logger, followed: map[string]bool{}, pulled: map[string]bool{}, images: map[string]imageFacts{}, copied: map[string]chan struct{}{}, bg: bg, cancel: cancel}, nil
}

// NewClient connects to the engine named by DOCKER_HOST (the local socket
// by default), negotiating the API version so that older engines work.
func NewClient() (*client.Client, error) {
	c, err := client.New(client.FromEnv, client.WithUserAgent(version.UserAgent()))
	if err != nil {
		return nil, fmt.Errorf("docker client: %w", err)
	}
	return c, nil
}

// containerName names a new container for a runner: the manager id
// first, so that two managers on one engine never collide, and a random
// suffix, so that a runner's replacement need not wait for the engine to
// finish removing the container it replaces.
func containerName(manager, runner string) string {
	return manager + "-" + runner + "-" + strings.ToLower(rand.Text()[:8])
}

// Create starts a container for spec. It is idempotent: a running
// container of this manager for the same runner is returned as it is;
// one that is not running (left by a crash between create and start) is
// removed and replaced.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	p.creating.Add(1)
	defer func() {
		p.created.Add(1)
		p.creating.Add(-1)
	}()
	existing, err := p.containers(ctx, spec.Manager, spec.Name)
	if err != nil {
		return provider.Instance{}, err
	}
	for _, c := range existing {
		if running(c) {
			return p.instance(c, provider.StateRunning), nil
		}
	}
	for _, c := range existing {
		p.remove(ctx, c.ID, containerNameOf(c))
	}
	id, name, err := p.create(ctx, spec)
	if err != nil {
		return provider.Instance{}, err
	}
	if err := p.start(ctx, id, spec.Name); err != nil {
		// Never half-applied: a container that did not start goes.
		p.remove(context.WithoutCancel(ctx), id, name)
		return provider.Instance{}, err
	}
	return provider.Instance{
		Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool,
		State: provider.StateRunning, Created: time.Now(), ID: id, GPUs: slices.Clone(spec.GPUs),
	}, nil
}

// call bounds one request to the engine.
func (p *Provider) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, p.opt.CallTimeout)
}

func (p *Provider) createContainer(ctx context.Context, opts client.ContainerCreateOptions) (client.ContainerCreateResult, error) {
	ctx, cancel := p.call(ctx)
	defer cancel()
	return p.cli.ContainerCreate(ctx, opts)
}

func (p *Provider) inspectImage(ctx context.Context, ref string) (client.ImageInspectResult, error) {
	ctx, cancel := p.call(ctx)
	defer cancel()
	return p.cli.ImageInspect(ctx, ref)
}

// imageOf is a runner's image: the one its job asked for (a dynamic
// pool's image=<name>), or the pool's.
func (p *Provider) imageOf(spec provider.Spec) string {
	return cmp.Or(spec.Request.Image, p.opt.Image)
}

// containers lists the manager's containers of one runner, or of every
// runner of this provider's pool when runner is "".
func (p *Provider) containers(ctx context.Context, manager, runner string) ([]container.Summary, error) {
	f := p.filters(manager)
	if runner != "" {
		f.Add("label", LabelRunner+"="+runner)
	}
	ctx, cancel := p.call(ctx)
	defer cancel()
	res, err := p.cli.ContainerList(ctx, client.ContainerListOptions{All: true, Filters: f})
	if err != nil {
		return nil, fmt.Errorf("list containers: %w", err)
	}
	return res.Items, nil
}

// running reports whether a container's process runs (paused and
// restarting ones count: their agent is still there).
func running(c container.Summary) bool {
	switch c.State {
	case container.StateRunning, container.StatePaused, container.StateRestarting:
		return true
	}
	return false
}

func containerNameOf(c container.Summary) string {
	if len(c.Names) == 0 {
		return ""
	}
	return strings.TrimPrefix(c.Names[0], "/")
}

func (p *Provider) instance(c container.Summary, st provider.State) provider.Instance {
	in := provider.Instance{
		Name:    c.Labels[LabelRunner],
		Manager: c.Labels[LabelManager],
		Pool:    c.Labels[LabelPool],
		State:   st,
		Created: time.Unix(c.Created, 0),
		ID:      c.ID,
	}
	if g := c.Labels[LabelGPUs]; g != "" {
		in.GPUs = strings.Split(g, ",")
	}
	return in
}

// logFile is where a container's output is copied.
func (p *Provider) logFile(id, runner string) string {
	short := id
	if len(short) > 12 {
		short = short[:12]
	}
	return filepath.Join(p.opt.LogDir, runner+"-"+short+".log")
}

// containerConfig is what Create asks the engine for, before the files
// are added.
func (p *Provider) containerConfig(spec provider.Spec) (*container.Config, *container.HostConfig) {
	env := make([]string, 0, len(spec.Env))
	for _, k := range slices.Sorted(maps.Keys(spec.Env)) {
		env = append(env, k+"="+spec.Env[k])
	}
	labels := map[string]string{
		LabelManager: spec.Manager,
		LabelPool:    spec.Pool,
		LabelRunner:  spec.Name,
		LabelSlot:    strings.TrimPrefix(spec.Name, spec.Pool+"-"),
	}
	if len(spec.GPUs) > 0 {
		labels[LabelGPUs] = strings.Join(spec.GPUs, ",")
	}
	cfg := &container.Config{
		Image:      p.imageOf(spec),
		Entrypoint: []string{spec.Command},
		Cmd:        spec.Args,
		Env:        env,
		Labels:     labels,
		WorkingDir: p.opt.Workdir,
		User:       p.opt.User,
	}
	init := true // reaps the job's orphans and forwards signals to the agent
	host := &container.HostConfig{
		AutoRemove:  true,
		NetworkMode: container.NetworkMode(p.opt.Network),
		OomScoreAdj: p.opt.OOMScoreAdj,
		ShmSize:     p.opt.ShmSize,
		Init:        &init,
		// Linux engines resolve host-gateway to the host, so a forge on
		// the host is reachable as host.docker.internal.
		ExtraHosts: append([]string{"host.docker.internal:host-gateway"}, p.opt.ExtraHosts...),
		Resources: container.Resources{
			NanoCPUs: cmp.Or(int64(spec.Request.CPUs*1e9), p.opt.NanoCPUs),
			Memory:   cmp.Or(spec.Request.Memory, p.opt.Memory),
		},
	}
	for _, m := range p.opt.Mounts {
		mt := mountpkg.TypeBind
		if !strings.HasPrefix(m.Source, "/") {
			mt = mountpkg.TypeVolume
		}
		host.Mounts = append(host.Mounts, mountpkg.Mount{Type: mt, Source: m.Source, Target: m.Target, ReadOnly: m.ReadOnly})
	}
	if p.opt.MountDockerSocket {
		host.Mounts = append(host.Mounts, mountpkg.Mount{Type: mountpkg.TypeBind, Source: "/var/run/docker.sock", Target: "/var/run/docker.sock"})
	}
	if len(spec.GPUs) > 0 || p.opt.GPUs.All || len(p.opt.GPUs.IDs) > 0 {
		req := container.DeviceRequest{Driver: "nvidia", Capabilities: [][]string{{"gpu"}}}
		// One of Count and DeviceIDs, never both: the engine refuses that.
		switch {
		case len(spec.GPUs) > 0: // this runner's own, from the pool
			req.DeviceIDs = slices.Clone(spec.GPUs)
		case p.opt.GPUs.All:
			req.Count = -1
		default:
			req.DeviceIDs = slices.Clone(p.opt.GPUs.IDs)
		}
		host.DeviceRequests = []container.DeviceRequest{req}
	}
	return cfg, host
}

// create makes the container with the spec's files in its workdir,
// without starting it. It returns the container's id and name.
func (p *Provider) create(ctx context.Context, spec provider.Spec) (string, string, error) {
	name := containerName(spec.Manager, spec.Name)
	autoRemove := !p.liveRestore(ctx)
	ref := p.imageOf(spec)
	if err := p.pull(ctx, ref, false); err != nil {
		return "", "", err
	}
	if err := p.describe(ctx, spec); err != nil {
		return "", "", err
	}
	spec = spec.WithRecord(p.opt.Workdir)
	cfg, host := p.containerConfig(spec)
	host.AutoRemove = autoRemove
	mount, err := p.mountFiles(ctx, ref)
	if err != nil {
		return "", "", err
	}
	if mount {
		dir, err := p.writeFiles(name, spec.Files)
		if err != nil {
			return "", "", err
		}
		// Writable: the agent rewrites its registration file on start.
		host.Mounts = append(host.Mounts, mountpkg.Mount{Type: mountpkg.TypeBind, Source: dir, Target: p.opt.Workdir})
	}
	opts := client.ContainerCreateOptions{Name: name, Config: cfg, HostConfig: host}
	res, err := p.createContainer(ctx, opts)
	if cerrdefs.IsNotFound(err) && p.opt.Pull != "never" {
		if err = p.pull(ctx, ref, true); err == nil {
			res, err = p.createContainer(ctx, opts)
		}
	}
	if err != nil {
		p.removeFiles(name)
		return "", "", fmt.Errorf("create container %s from %s: %w", name, ref, err)
	}
	for _, w := range res.Warnings {
		p.log.Warn("docker warning", "container", name, "warning", w)
	}
	if mount {
		return res.ID, name, nil
	}
	archive, err := tarFiles(path.Base(p.opt.Workdir), spec.Files)
	if err == nil {
		// Files go straight into the container's own layer, and
		// go with it.
		cctx, cancel := p.call(ctx)
		_, err = p.cli.CopyToContainer(cctx, res.ID, client.CopyToContainerOptions{
			DestinationPath: path.Dir(p.opt.Workdir),
			Content:         archive,
			CopyUIDGID:      true,
		})
		cancel()
	}
	if err != nil {
		p.remove(context.WithoutCancel(ctx), res.ID, name)
		return "", "", fmt.Errorf("copy files into container %s: %w", name, err)
	}
	return res.ID, name, nil
}

// imageFacts is what the provider reads of its image.
type imageFacts struct {
	user string
	// digest is the registry's digest where the engine knows one, else
	// the image's id: both name its content.
	digest string
}

// image inspects an image once (and again after a pull), pulling it when
// it is missing and the pool may.
func (p *Provider) image(ctx context.Context, ref string) (imageFacts, error) {
	p.mu.Lock()
	img, known := p.images[ref]
	p.mu.Unlock()
	if known {
		return img, nil
	}
	res, err := p.inspectImage(ctx, ref)
	if cerrdefs.IsNotFound(err) {
		if p.opt.Pull == "never" {
			return img, fmt.Errorf("image %s is not on the engine, and pull is never", ref)
		}
		if err := p.pull(ctx, ref, true); err != nil {
			return img, fmt.Errorf("image %s is not on the engine: %w", ref, err)
		}
		res, err = p.inspectImage(ctx, ref)
	}
	if err != nil {
		return img, fmt.Errorf("inspect image %s: %w", ref, err)
	}
	if res.Config != nil {
		img.user = res.Config.User
	}
	img.digest = res.ID
	for _, d := range res.RepoDigests {
		if _, dg, ok := strings.Cut(d, "@"); ok {
			img.digest = dg
			break
		}
	}
	p.mu.Lock()
	p.images[ref] = img
	p.mu.Unlock()
	return img, nil
}

// describe fills in a runner's record what this pool gives its machines:
// the engine's host, the image and its digest, limits and datasets.
func (p *Provider) describe(ctx context.Context, spec provider.Spec) error {
	r := spec.Record
	if r == nil {
		return nil
	}
	ref := p.imageOf(spec)
	img, err := p.image(ctx, ref)
	if err != nil {
		return err
	}
	p.liveRestore(ctx) // reads the engine's host name with it
	p.mu.Lock()
	host, sys := p.engineHost, p.engineSystem
	p.mu.Unlock()
	if sys != nil {
		s := *sys
		r.System = &s
	}
	m := &r.Machine
	m.Host, m.Image, m.ImageDigest = host, ref, img.digest
	if cpus := cmp.Or(int64(spec.Request.CPUs*1e9), p.opt.NanoCPUs); cpus > 0 {
		m.CPUs = strconv.FormatFloat(float64(cpus)/1e9, 'f', -1, 64)
	}
	if mem := cmp.Or(spec.Request.Memory, p.opt.Memory); mem > 0 {
		m.Memory = record.Bytes(mem)
	}
	m.Datasets = nil
	for _, d := range p.opt.Mounts {
		m.Datasets = append(m.Datasets, record.Mount{Source: d.Source, Target: d.Target, ReadOnly: d.ReadOnly})
	}
	return nil
}

// mountFiles reports whether the spec's files are bind-mounted from the
// manager's host rather than copied into the container. Mounting saves a
// copy into the container's layer, which the engine does by unpacking a
// tar in a helper process (about 100ms). It needs a files directory on
// the engine's own host, and an agent that runs as root, since the files
// are the manager's and 0600; otherwise the files are copied, owned by
// the container's user.
func (p *Provider) mountFiles(ctx context.Context, ref string) (bool, error) {
	if p.opt.FilesDir == "" || p.opt.User != "" {
		return false, nil
	}
	img, err := p.image(ctx, ref)
	if err != nil {
		return false, err
	}
	user := img.user
	return user == "" || user == "root" || user == "0" || strings.HasPrefix(user, "0:") || strings.HasPrefix(user, "root:"), nil
}

// writeFiles writes a container's files into its own directory under
// FilesDir, readable by the manager's user only.
func (p *Provider) writeFiles(name string, files map[string][]byte) (string, error) {
	dir := filepath.Join(p.opt.FilesDir, name)
	err := os.MkdirAll(dir, 0o700)
	for _, rel := range slices.Sorted(maps.Keys(files)) {
		if err != nil {
			break
		}
		var clean string
		if clean, err = inWorkdir(rel); err != nil {
			break
		}
		target := filepath.Join(dir, clean)
		if err = os.MkdirAll(filepath.Dir(target), 0o700); err == nil {
			err = os.WriteFile(target, files[rel], 0o600)
		}
	}
	if err != nil {
		p.removeFiles(name)
		return "", fmt.Errorf("write files of container %s: %w", name, err)
	}
	return dir, nil
}

// removeFiles deletes a container's files directory, if it has one.
func (p *Provider) removeFiles(name string) {
	if p.opt.FilesDir == "" || name == "" || strings.ContainsAny(name, "/\\") || name == "." || name == ".." {
		return
	}
	if err := os.RemoveAll(filepath.Join(p.opt.FilesDir, name)); err != nil {
		p.log.Warn("remove container files", "container", name, "err", err)
	}
}

// pruneFiles deletes files directories whose container is gone. Unless
// the listing was quiet (no Create overlapped it), a directory younger
// than a minute may belong to a container being created now, and stays.
func (p *Provider) pruneFiles(present map[string]bool, quiet bool) {
	if p.opt.FilesDir == "" {
		return
	}
	entries, err := os.ReadDir(p.opt.FilesDir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if present[e.Name()] || !strings.HasPrefix(e.Name(), p.opt.Manager+"-") {
			continue
		}
		if info, err := e.Info(); err == nil && (quiet || time.Since(info.ModTime()) > time.Minute) {
			p.removeFiles(e.Name())
		}
	}
}

// pull fetches the image per the pull policy: when always is set on the
// first use, or when missing (force) and the policy allows it.
func (p *Provider) pull(ctx context.Context, ref string, missing bool) error {
	p.mu.Lock()
	do := (p.opt.Pull == "always" && !p.pulled[ref]) || (missing && p.opt.Pull != "never")
	p.mu.Unlock()
	if !do {
		return nil
	}
	p.log.Info("pulling image", "image", ref)
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, p.opt.PullTimeout)
	defer cancel()
	resp, err := p.cli.ImagePull(ctx, ref, client.ImagePullOptions{})
	if err == nil {
		err = resp.Wait(ctx)
	}
	if err != nil {
		return fmt.Errorf("pull image %s: %w", ref, err)
	}
	p.mu.Lock()
	p.pulled[ref] = true
	delete(p.images, ref) // it may be another image now
	p.mu.Unlock()
	p.log.Info("pulled image", "image", ref, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// inWorkdir cleans a spec file's relative path, refusing one that would
// leave the workdir.
func inWorkdir(rel string) (string, error) {
	clean := path.Clean(rel)
	if path.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") {
		return "", fmt.Errorf("file %q is outside the workdir", rel)
	}
	return clean, nil
}

// tarFiles archives files under dir, the directory first so that it is
// made with the right owner. Files are 0600: only the agent reads them.
func tarFiles(dir string, files map[string][]byte) (io.Reader, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	now := time.Now()
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir + "/", Mode: 0o700, ModTime: now}); err != nil {
		return nil, err
	}
	made := map[string]bool{}
	for _, rel := range slices.Sorted(maps.Keys(files)) {
		clean, err := inWorkdir(rel)
		if err != nil {
			return nil, err
		}
		// Parent directories of nested files.
		for d := path.Dir(clean); d != "." && !made[d]; d = path.Dir(d) {
			made[d] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir + "/" + d + "/", Mode: 0o700, ModTime: now}); err != nil {
				return nil, err
			}
		}
		data := files[rel]
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: dir + "/" + clean, Mode: 0o600, Size: int64(len(data)), ModTime: now}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return &buf, nil
}

func (p *Provider) start(ctx context.Context, id, runner string) error {
	cctx, cancel := p.call(ctx)
	defer cancel()
	if _, err := p.cli.ContainerStart(cctx, id, client.ContainerStartOptions{}); err != nil && !p.startedAnyway(ctx, id) {
		return fmt.Errorf("start container for %s: %w", runner, err)
	}
	p.follow(id, runner, false)
	return nil
}

// startedAnyway reports whether a container whose start failed runs all
// the same: the engine carries out a start whose caller gave up (a drain
// cancelled it, the call timed out), and its agent may already have taken
// a job, so it must not be removed as a container that did not start.
func (p *Provider) startedAnyway(ctx context.Context, id string) bool {
	cctx, cancel := p.call(context.WithoutCancel(ctx))
	defer cancel()
	res, err := p.cli.ContainerInspect(cctx, id, client.ContainerInspectOptions{})
	return err == nil && res.Container.State != nil && res.Container.State.Running
}

// liveRestore reports whether the engine keeps containers running through
// its own restart, asking it once. Its containers are then made without
// AutoRemove (see the package comment).
func (p *Provider) liveRestore(ctx context.Context) bool {
	p.mu.Lock()
	known, on := p.liveRestoreKnown, p.liveRestoreOn
	p.mu.Unlock()
	if known {
		return on
	}
	ctx, cancel := p.call(ctx)
	defer cancel()
	res, err := p.cli.Info(ctx, client.InfoOptions{})
	if err != nil {
		return false // asked again at the next Create
	}
	on = res.Info.LiveRestoreEnabled
	sys := engineSystem(res.Info)
	if slices.Contains(sys.Runtimes, "nvidia") && res.Info.Name == provider.Hostname() {
		// The engine's host is this one: its toolkit is the one here.
		sys.NvidiaToolkit = sysinfo.NvidiaToolkit(ctx)
	}
	p.mu.Lock()
	p.liveRestoreKnown, p.liveRestoreOn, p.engineHost = true, on, res.Info.Name
	p.engineSystem = sys
	p.mu.Unlock()
	if on {
		p.log.Info("the engine has live-restore: runfleet removes exited runner containers itself, not AutoRemove")
	}
	return on
}

// removesExited reports whether this provider's containers are made
// without AutoRemove.
func (p *Provider) removesExited() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.liveRestoreOn
}

// removeExited removes a container whose agent exited, in the
// background: the pool learns of the exit at once, and the name of a
// replacement never waits for it. A container that exits while no manager
// runs is listed as exited and removed by the pool.
func (p *Provider) removeExited(id, name string) {
	p.wg.Go(func() {
		ctx, cancel := context.WithTimeout(p.bg, time.Minute)
		defer cancel()
		if err := p.removeContainer(ctx, id, name); err != nil && p.bg.Err() == nil {
			p.log.Warn("remove exited container", "container", name, "err", err)
		}
	})
}

// remove deletes a container, and its files. The engine may already be
// removing it (AutoRemove); it finishes that on its own, and since names
// are never reused there is nothing to wait for.
func (p *Provider) remove(ctx context.Context, id, name string) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := p.removeContainer(ctx, id, name); err != nil {
		p.log.Warn("remove container", "container", name, "err", err)
	}
}

// removeTries bounds the removals of one container: the engine can fail
// one with its files half gone ("unable to remove filesystem for <id>:
// ... directory not empty", when something still wrote in its directory
// as it was removed: moby's daemon/delete.go marks the container dead,
// SetRemovalError), and a removal a moment later takes it.
var removeTries = []time.Duration{250 * time.Millisecond, time.Second, 3 * time.Second}

func (p *Provider) removeContainer(ctx context.Context, id, name string) error {
	for i := 0; ; i++ {
		cctx, cancel := p.call(ctx)
		_, err := p.cli.ContainerRemove(cctx, id, client.ContainerRemoveOptions{Force: true, RemoveVolumes: true})
		cancel()
		// On conflict the engine is already removing it (AutoRemove): its
		// agent is gone, and so may its files be.
		if err == nil || cerrdefs.IsNotFound(err) || cerrdefs.IsConflict(err) {
			p.removeFiles(name)
			return nil
		}
		if i == len(removeTries) || !cerrdefs.IsInternal(err) {
			return fmt.Errorf("remove container %s: %w", name, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("remove container %s: %w", name, err)
		case <-time.After(removeTries[i]):
		}
	}
}

// Delete kills and removes the runner's containers. The pool calls it
// only once the forge has let go of the runner (or the agent has exited),
// so there is no job to be graceful to.
func (p *Provider) Delete(ctx context.Context, name string) error {
	cs, err := p.containers(ctx, p.opt.Manager, name)
	if err != nil {
		return err
	}
	var errs []error
	for _, c := range cs {
		errs = append(errs, p.removeContainer(ctx, c.ID, containerNameOf(c)))
	}
	return errors.Join(errs...)
}

func (p *Provider) filters(manager string) client.Filters {
	f := make(client.Filters).Add("label", LabelManager+"="+manager)
	if p.opt.Pool != "" {
		f.Add("label", LabelPool+"="+p.opt.Pool)
	}
	return f
}

// List returns the manager's containers, found by label. A container the
// engine is removing is left out: it is gone as far as the pool is
// concerned. One created but never started (a manager killed mid-create)
// is reported as created. Any other container that is not running is
// reported as exited, for the pool to delete, unless its runner already
// has a running one.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	busy, done := p.creating.Load(), p.created.Load()
	cs, err := p.containers(ctx, manager, "")
	if err != nil {
		return nil, err
	}
	quiet := busy == 0 && p.creating.Load() == 0 && p.created.Load() == done
	live := map[string]bool{} // runners with a running container
	present := make(map[string]bool, len(cs))
	names := make(map[string]bool, len(cs))
	for _, c := range cs {
		present[c.ID] = true
		names[containerNameOf(c)] = true
		if running(c) {
			live[c.Labels[LabelRunner]] = true
		}
	}
	out := make([]provider.Instance, 0, len(cs))
	for _, c := range cs {
		switch {
		case running(c):
			if p.watching.Load() {
				// Adopted after a restart: keep copying its output.
				p.follow(c.ID, c.Labels[LabelRunner], true)
			}
			out = append(out, p.instance(c, provider.StateRunning))
		case c.State == container.StateRemoving, live[c.Labels[LabelRunner]]:
		case c.State == container.StateCreated:
			// Never started: a start sent by a manager killed mid-create
			// may still be carried out, so it is not an agent that ended.
			out = append(out, p.instance(c, provider.StateCreated))
		default:
			out = append(out, p.instance(c, provider.StateExited))
		}
	}
	// Housekeeping is for the manager that runs the pool, not for a
	// reader such as `runfleet status`.
	if manager == p.opt.Manager && p.watching.Load() {
		p.forget(present)
		p.pruneFiles(names, quiet)
	}
	return out, nil
}

// Watch follows the engine's event stream for this manager's containers
// and reports starts, exits and removals. When the stream breaks (the
// engine restarted, the socket went away) it reconnects with backoff,
// replays what it missed with since, and reports "" so that the pool
// re-reads everything.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) {
	p.watching.Store(true)
	p.wg.Go(func() {
		since := time.Now()
		backoff := time.Duration(0)
		for ctx.Err() == nil {
			connected := time.Now()
			last, err := p.watchOnce(ctx, since, changed)
			if !last.IsZero() {
				since = last
			}
			if ctx.Err() != nil {
				return
			}
			if time.Since(connected) > time.Minute {
				backoff = 0
			}
			backoff = min(max(2*backoff, time.Second), 30*time.Second)
			p.log.Warn("docker event stream lost; reconnecting", "err", err, "retry_in", backoff)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			changed("")
		}
	})
}

var watched = []string{string(events.ActionStart), string(events.ActionDie), string(events.ActionDestroy), string(events.ActionOOM)}

func (p *Provider) watchOnce(ctx context.Context, since time.Time, changed func(string)) (time.Time, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	f := p.filters(p.opt.Manager).Add("type", string(events.ContainerEventType)).Add("event", watched...)
	res := p.cli.Events(ctx, client.EventsListOptions{
		Since:   fmt.Sprintf("%d.%09d", since.Unix(), since.Nanosecond()),
		Filters: f,
	})
	var last time.Time
	for {
		select {
		case m := <-res.Messages:
			if m.TimeNano != 0 {
				last = time.Unix(0, m.TimeNano)
			}
			runner := m.Actor.Attributes[LabelRunner]
			switch m.Action {
			case events.ActionDestroy:
				p.removeFiles(m.Actor.Attributes["name"])
			case events.ActionDie:
				p.log.Info("runner container exited", "runner", runner, "exit_code", m.Actor.Attributes["exitCode"])
				p.awaitCopy(m.Actor.ID)
				if p.removesExited() {
					p.removeExited(m.Actor.ID, m.Actor.Attributes["name"])
				}
			case events.ActionOOM:
				p.log.Warn("runner container ran out of memory", "runner", runner)
			}
			changed(runner)
		case err := <-res.Err:
			if err == nil {
				err = io.EOF
			}
			return last, err
		}
	}
}

// follow copies a container's output to the pool's log directory, once
// per container and provider (again after a broken stream). Lines carry the engine's timestamps, so that
// the copy of a container adopted after a restart goes on exactly after
// the last line an earlier manager wrote: nothing written while no manager
// ran is lost, and nothing is copied twice.
func (p *Provider) follow(id, runner string, adopted bool) {
	if p.opt.LogDir == "" || runner == "" {
		return
	}
	p.mu.Lock()
	// A running container whose copy ended (the engine restarted and
	// closed the stream) is followed again from its last copied line.
	if copying, seen := p.followed[id]; seen && (copying || !adopted) {
		p.mu.Unlock()
		return
	}
	p.followed[id] = true
	done := make(chan struct{})
	p.copied[id] = done
	p.mu.Unlock()
	file := p.logFile(id, runner)
	var since time.Time
	if adopted {
		since = lastTimestamp(file)
	}
	p.wg.Go(func() {
		err := p.copyLogs(id, file, since)
		if err != nil && !cerrdefs.IsNotFound(err) && p.bg.Err() == nil {
			p.log.Debug("container output copy ended", "runner", runner, "err", err)
		}
		p.mu.Lock()
		p.followed[id] = false
		delete(p.copied, id)
		p.mu.Unlock()
		close(done)
	})
}

// awaitCopy waits, briefly, for a dead container's output copy to end, so
// that the pass its exit triggers reads the agent's last lines.
func (p *Provider) awaitCopy(id string) {
	p.mu.Lock()
	done, ok := p.copied[id]
	p.mu.Unlock()
	if !ok {
		return
	}
	t := time.NewTimer(2 * time.Second)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// forget drops what follow remembers of containers that are gone and
// whose copy has ended.
func (p *Provider) forget(present map[string]bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, copying := range p.followed {
		if !present[id] && !copying {
			delete(p.followed, id)
		}
	}
}

// lastTimestamp reads the engine timestamp that starts the last complete
// line of a log copy; the zero time when there is none.
func lastTimestamp(file string) time.Time {
	f, err := os.Open(file)
	if err != nil {
		return time.Time{}
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return time.Time{}
	}
	const tailSize = 64 << 10
	off := max(st.Size()-tailSize, 0)
	buf := make([]byte, st.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil && err != io.EOF {
		return time.Time{}
	}
	lines := bytes.Split(bytes.TrimSuffix(buf, []byte("\n")), []byte("\n"))
	for i := len(lines) - 1; i >= 0; i-- {
		stamp, _, _ := bytes.Cut(lines[i], []byte(" "))
		if t, err := time.Parse(time.RFC3339Nano, string(stamp)); err == nil {
			return t
		}
	}
	return time.Time{}
}

func (p *Provider) copyLogs(id, file string, since time.Time) error {
	f, err := os.OpenFile(file, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	opts := client.ContainerLogsOptions{ShowStdout: true, ShowStderr: true, Follow: true, Timestamps: true}
	if !since.IsZero() {
		opts.Since = since.Add(time.Nanosecond).UTC().Format(time.RFC3339Nano)
	}
	// Not tied to any request: the copy runs as long as the container,
	// and ends when the engine closes the stream at its exit.
	rc, err := p.cli.ContainerLogs(p.bg, id, opts)
	if err != nil {
		return err
	}
	defer rc.Close()
	_, err = stdcopy.StdCopy(f, f, rc)
	return err
}

// Close stops copying output and waits for the event watcher, whose
// context must have ended. Containers keep running. A provider that ran
// its pool first lets the engine finish removing the containers it is
// removing (AutoRemove after an agent's exit, which List already counts
// as gone), and deletes the files of every container of the pool that is
// gone: a drained pool leaves nothing in the engine or on disk.
func (p *Provider) Close() error {
	if p.watching.Load() {
		p.settle(closeSettle)
	}
	p.cancel()
	p.wg.Wait()
	if p.opt.closeClient {
		return p.cli.Close()
	}
	return nil
}

// closeSettle bounds how long Close waits for the engine's removals.
const closeSettle = 30 * time.Second

// settle waits, up to limit, until none of the pool's containers is being
// removed, then prunes the files of those gone and the pool's files
// directory itself once empty.
func (p *Provider) settle(limit time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	for {
		cs, err := p.containers(ctx, p.opt.Manager, "")
		if err != nil {
			p.log.Warn("could not list containers at close; their files stay for the next start", "err", err)
			return
		}
		removing := false
		present := make(map[string]bool, len(cs))
		for _, c := range cs {
			present[containerNameOf(c)] = true
			removing = removing || c.State == container.StateRemoving
		}
		if !removing {
			p.pruneFiles(present, p.creating.Load() == 0)
			if p.opt.FilesDir != "" {
				_ = os.Remove(p.opt.FilesDir) // only if empty
			}
			return
		}
		select {
		case <-ctx.Done():
			p.log.Warn("containers still being removed at close; their files stay for the next start")
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// engineSystem is what a record keeps of the engine's host, from the
// engine's own account of it (GET /info): its OS, kernel, CPUs, memory and
// version, and its runtimes (nvidia among them where NVIDIA's container
// toolkit registered one). The engine does not name the CPU's model.
func engineSystem(info system.Info) *record.System {
	s := &record.System{
		OS: info.OperatingSystem, Kernel: info.KernelVersion, Arch: info.Architecture,
		CPUs: info.NCPU, MemoryMiB: uint64(max(info.MemTotal, 0)) >> 20,
	}
	if info.ServerVersion != "" {
		s.Runtime = "Docker Engine " + info.ServerVersion
	}
	for name := range info.Runtimes {
		s.Runtimes = append(s.Runtimes, name)
	}
	slices.Sort(s.Runtimes)
	return s
}
