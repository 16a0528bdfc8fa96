// Package docker runs each runner in its own throw-away container on a
// Docker engine, through the Engine API.
//
// A container takes exactly one job: the agent's ephemeral registration
// makes it exit after the job, and AutoRemove deletes the container with
// everything the job wrote. Containers carry the manager id, pool and slot
// in their labels; the labels are the truth after a restart, and a
// container without this manager's label is never touched.
package docker

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/api/pkg/stdcopy"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/api/types/events"
	"github.com/moby/moby/api/types/mount"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/provider"
)

// Labels on every container runfleet creates.
const (
	LabelManager = "runfleet.manager"
	LabelPool    = "runfleet.pool"
	LabelRunner  = "runfleet.runner" // the runner's name, <pool>-<slot>
	LabelSlot    = "runfleet.slot"
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
	// files are copied there before the container starts.
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
	Logger *slog.Logger
}

// Provider runs runners as Docker containers.
type Provider struct {
	opt Options
	cli *client.Client
	log *slog.Logger

	mu     sync.Mutex
	pulled bool
	// followed holds the containers whose output this provider copies
	// (true) or has copied (false), until they are gone.
	followed map[string]bool
	wg       sync.WaitGroup
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
	if opt.Logger == nil {
		opt.Logger = slog.New(slog.DiscardHandler)
	}
	if opt.LogDir != "" {
		if err := os.MkdirAll(opt.LogDir, 0o700); err != nil {
			return nil, fmt.Errorf("docker provider: log dir: %w", err)
		}
	}
	if opt.MountDockerSocket {
		opt.Logger.Warn("pool mounts the Docker socket: every job can control the host's Docker engine, and so the host", "pool", opt.Pool)
	}
	bg, cancel := context.WithCancel(context.Background())
	return &Provider{opt: opt, cli: opt.Client, log: opt.Logger, followed: map[string]bool{}, bg: bg, cancel: cancel}, nil
}

// NewClient connects to the engine named by DOCKER_HOST (the local socket
// by default), negotiating the API version so that older engines work.
func NewClient() (*client.Client, error) {
	c, err := client.New(client.FromEnv)
	if err != nil {
		return nil, fmt.Errorf("docker client: %w", err)
	}
	return c, nil
}

// ContainerName is the container's name for a runner: the manager id
// first, so that two managers on one engine never collide.
func ContainerName(manager, runner string) string { return manager + "-" + runner }

// Create starts a container for spec. It is idempotent: a running
// container of this manager with the same name is returned as it is; a
// stopped one is removed and replaced.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	name := ContainerName(spec.Manager, spec.Name)
	if inst, ok, err := p.existing(ctx, name, spec.Manager); err != nil || ok {
		return inst, err
	}
	id, err := p.create(ctx, spec)
	if err != nil {
		return provider.Instance{}, err
	}
	if err := p.start(ctx, id, spec.Name); err != nil {
		// Never half-applied: a container that did not start goes.
		p.remove(context.WithoutCancel(ctx), id)
		return provider.Instance{}, err
	}
	return provider.Instance{
		Name: spec.Name, Manager: spec.Manager, Pool: spec.Pool,
		State: provider.StateRunning, Created: time.Now(), ID: id,
	}, nil
}

// existing looks for a container of that name. It returns ok when a
// running one of this manager can be used as it is.
func (p *Provider) existing(ctx context.Context, name, manager string) (provider.Instance, bool, error) {
	res, err := p.cli.ContainerInspect(ctx, name, client.ContainerInspectOptions{})
	if cerrdefs.IsNotFound(err) {
		return provider.Instance{}, false, nil
	}
	if err != nil {
		return provider.Instance{}, false, fmt.Errorf("inspect container %s: %w", name, err)
	}
	c := res.Container
	var labels map[string]string
	if c.Config != nil {
		labels = c.Config.Labels
	}
	if labels[LabelManager] != manager {
		return provider.Instance{}, false, fmt.Errorf("container name %s is taken by a container that manager %q does not own", name, manager)
	}
	if c.State != nil && c.State.Running {
		created, _ := time.Parse(time.RFC3339Nano, c.Created)
		return provider.Instance{
			Name: labels[LabelRunner], Manager: manager, Pool: labels[LabelPool],
			State: provider.StateRunning, Created: created, ID: c.ID,
		}, true, nil
	}
	// Left by a crash between create and start, or exiting now: replace.
	p.remove(ctx, c.ID)
	return provider.Instance{}, false, nil
}

// ContainerConfig is what Create asks the engine for: exported so that
// tests and `runfleet status` can show what a pool's containers get.
func (p *Provider) ContainerConfig(spec provider.Spec) (*container.Config, *container.HostConfig) {
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
	cfg := &container.Config{
		Image:      p.opt.Image,
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
			NanoCPUs: p.opt.NanoCPUs,
			Memory:   p.opt.Memory,
		},
	}
	for _, m := range p.opt.Mounts {
		mt := mount.TypeBind
		if !strings.HasPrefix(m.Source, "/") {
			mt = mount.TypeVolume
		}
		host.Mounts = append(host.Mounts, mount.Mount{Type: mt, Source: m.Source, Target: m.Target, ReadOnly: m.ReadOnly})
	}
	if p.opt.MountDockerSocket {
		host.Mounts = append(host.Mounts, mount.Mount{Type: mount.TypeBind, Source: "/var/run/docker.sock", Target: "/var/run/docker.sock"})
	}
	if p.opt.GPUs.All || len(p.opt.GPUs.IDs) > 0 {
		req := container.DeviceRequest{Driver: "nvidia", Capabilities: [][]string{{"gpu"}}}
		// One of Count and DeviceIDs, never both: the engine refuses that.
		if p.opt.GPUs.All {
			req.Count = -1
		} else {
			req.DeviceIDs = slices.Clone(p.opt.GPUs.IDs)
		}
		host.DeviceRequests = []container.DeviceRequest{req}
	}
	return cfg, host
}

// create makes the container and copies the spec's files into it, without
// starting it.
func (p *Provider) create(ctx context.Context, spec provider.Spec) (string, error) {
	name := ContainerName(spec.Manager, spec.Name)
	cfg, host := p.ContainerConfig(spec)
	if err := p.pull(ctx, false); err != nil {
		return "", err
	}
	opts := client.ContainerCreateOptions{Name: name, Config: cfg, HostConfig: host}
	res, err := p.cli.ContainerCreate(ctx, opts)
	if cerrdefs.IsNotFound(err) && p.opt.Pull != "never" {
		if err = p.pull(ctx, true); err == nil {
			res, err = p.cli.ContainerCreate(ctx, opts)
		}
	}
	if err != nil {
		return "", fmt.Errorf("create container %s from %s: %w", name, p.opt.Image, err)
	}
	for _, w := range res.Warnings {
		p.log.Warn("docker warning", "container", name, "warning", w)
	}
	archive, err := tarFiles(path.Base(p.opt.Workdir), spec.Files)
	if err == nil {
		// Files go straight into the container's own layer: no host
		// directory holds the credential, and AutoRemove deletes it.
		_, err = p.cli.CopyToContainer(ctx, res.ID, client.CopyToContainerOptions{
			DestinationPath: path.Dir(p.opt.Workdir),
			Content:         archive,
			CopyUIDGID:      true,
		})
	}
	if err != nil {
		p.remove(context.WithoutCancel(ctx), res.ID)
		return "", fmt.Errorf("copy files into container %s: %w", name, err)
	}
	return res.ID, nil
}

// pull fetches the image per the pull policy: when always is set on the
// first use, or when missing (force) and the policy allows it.
func (p *Provider) pull(ctx context.Context, missing bool) error {
	p.mu.Lock()
	do := (p.opt.Pull == "always" && !p.pulled) || (missing && p.opt.Pull != "never")
	p.mu.Unlock()
	if !do {
		return nil
	}
	p.log.Info("pulling image", "image", p.opt.Image)
	start := time.Now()
	resp, err := p.cli.ImagePull(ctx, p.opt.Image, client.ImagePullOptions{})
	if err == nil {
		err = resp.Wait(ctx)
	}
	if err != nil {
		return fmt.Errorf("pull image %s: %w", p.opt.Image, err)
	}
	p.mu.Lock()
	p.pulled = true
	p.mu.Unlock()
	p.log.Info("pulled image", "image", p.opt.Image, "took", time.Since(start).Round(time.Millisecond))
	return nil
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
		clean := path.Clean(rel)
		if path.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") {
			return nil, fmt.Errorf("file %q is outside the workdir", rel)
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
	if _, err := p.cli.ContainerStart(ctx, id, client.ContainerStartOptions{}); err != nil {
		return fmt.Errorf("start container for %s: %w", runner, err)
	}
	p.follow(id, runner, false)
	return nil
}

// remove deletes a container and waits until it is gone, so that its name
// can be used again at once. AutoRemove may already be removing it.
func (p *Provider) remove(ctx context.Context, id string) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	gone := p.cli.ContainerWait(ctx, id, client.ContainerWaitOptions{Condition: container.WaitConditionRemoved})
	_, err := p.cli.ContainerRemove(ctx, id, client.ContainerRemoveOptions{Force: true, RemoveVolumes: true})
	switch {
	case err == nil, cerrdefs.IsNotFound(err):
	case cerrdefs.IsConflict(err): // removal already in progress
	default:
		p.log.Warn("remove container", "container", id, "err", err)
		return
	}
	select {
	case <-gone.Result:
	case <-gone.Error: // not found: already gone
	case <-ctx.Done():
	}
}

// Delete kills and removes the runner's container. The pool calls it only
// once the forge has let go of the runner (or the agent has exited), so
// there is no job to be graceful to.
func (p *Provider) Delete(ctx context.Context, name string) error {
	cname := ContainerName(p.opt.Manager, name)
	res, err := p.cli.ContainerInspect(ctx, cname, client.ContainerInspectOptions{})
	if cerrdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect container %s: %w", cname, err)
	}
	if res.Container.Config == nil || res.Container.Config.Labels[LabelManager] != p.opt.Manager {
		return fmt.Errorf("container %s is not owned by manager %q; left alone", cname, p.opt.Manager)
	}
	p.remove(ctx, res.Container.ID)
	if _, err := p.cli.ContainerInspect(ctx, res.Container.ID, client.ContainerInspectOptions{}); !cerrdefs.IsNotFound(err) {
		if err == nil {
			err = errors.New("still there")
		}
		return fmt.Errorf("remove container %s: %w", cname, err)
	}
	return nil
}

func (p *Provider) filters(manager string) client.Filters {
	f := make(client.Filters).Add("label", LabelManager+"="+manager)
	if p.opt.Pool != "" {
		f.Add("label", LabelPool+"="+p.opt.Pool)
	}
	return f
}

// List returns the manager's containers, found by label. A container that
// is not running (exited, created but never started after a crash, being
// removed) is reported as exited, for the pool to delete.
func (p *Provider) List(ctx context.Context, manager string) ([]provider.Instance, error) {
	res, err := p.cli.ContainerList(ctx, client.ContainerListOptions{All: true, Filters: p.filters(manager)})
	if err != nil {
		return nil, fmt.Errorf("list containers: %w", err)
	}
	out := make([]provider.Instance, 0, len(res.Items))
	present := make(map[string]bool, len(res.Items))
	for _, c := range res.Items {
		present[c.ID] = true
		st := provider.StateExited
		switch c.State {
		case container.StateRunning, container.StatePaused, container.StateRestarting:
			st = provider.StateRunning
			// Adopted after a restart: keep copying its output.
			p.follow(c.ID, c.Labels[LabelRunner], true)
		}
		out = append(out, provider.Instance{
			Name:    c.Labels[LabelRunner],
			Manager: c.Labels[LabelManager],
			Pool:    c.Labels[LabelPool],
			State:   st,
			Created: time.Unix(c.Created, 0),
			ID:      c.ID,
		})
	}
	if manager == p.opt.Manager {
		p.forget(present)
	}
	return out, nil
}

// Watch follows the engine's event stream for this manager's containers
// and reports starts, exits and removals. When the stream breaks (the
// engine restarted, the socket went away) it reconnects with backoff,
// replays what it missed with since, and reports "" so that the pool
// re-reads everything.
func (p *Provider) Watch(ctx context.Context, changed func(name string)) {
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
			case events.ActionDie:
				p.log.Info("runner container exited", "runner", runner, "exit_code", m.Actor.Attributes["exitCode"])
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
// per container and provider. Lines carry the engine's timestamps, so that
// the copy of a container adopted after a restart goes on exactly after
// the last line an earlier manager wrote: nothing written while no manager
// ran is lost, and nothing is copied twice.
func (p *Provider) follow(id, runner string, adopted bool) {
	if p.opt.LogDir == "" || runner == "" {
		return
	}
	p.mu.Lock()
	if _, seen := p.followed[id]; seen {
		p.mu.Unlock()
		return
	}
	p.followed[id] = true
	p.mu.Unlock()
	short := id
	if len(short) > 12 {
		short = short[:12]
	}
	file := filepath.Join(p.opt.LogDir, runner+"-"+short+".log")
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
		p.mu.Unlock()
	})
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
// context must have ended. Containers keep running.
func (p *Provider) Close() {
	p.cancel()
	p.wg.Wait()
}
