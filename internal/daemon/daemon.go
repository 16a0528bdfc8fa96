// Package daemon wires a configuration into forge drivers, providers and
// pool reconcilers, runs them, and drains them on shutdown.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/gitea"
	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/metrics"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/docker"
	"github.com/runfleet/runfleet/provider/process"

	dockerclient "github.com/moby/moby/client"
)

// Version is the runfleet version, set by the build.
var Version = "dev"

// Fleet is a configured set of pools.
type Fleet struct {
	Config *config.Config
	Pools  []*pool.Pool
	// Forges by pool name, for reading jobs.
	Forges map[string]forge.Forge
	// Providers by pool name.
	Providers map[string]provider.Provider
	// Inventory is this host's GPUs, read when a pool needs them.
	Inventory *gpu.Inventory
	// GPUs hands out the GPUs to the pools' runners; nil when no pool
	// gives runners GPUs of their own.
	GPUs *gpu.Allocator
	// Demand tracks queued jobs, from webhooks and polls.
	Demand *demand.Tracker
	// Metrics are the manager's Prometheus metrics.
	Metrics *metrics.Metrics
	log     *slog.Logger

	drivers map[string]forge.Forge    // by forge name
	written map[string]*config.Docker // pools' docker sections as written
	mu      sync.Mutex                // guards Pools, Config and runs during a reload
	runs    map[string]*poolRun       // by pool name, while Run runs
	runCtx  context.Context

	docker  *dockerclient.Client
	closers []func()
}

// New builds the fleet for a validated config. It makes no network call;
// it fails only on what is wrong locally (an agent binary that is missing,
// a directory that cannot be made), which is a configuration error.
func New(cfg *config.Config, log *slog.Logger) (*Fleet, error) {
	f := &Fleet{Config: cfg, Forges: map[string]forge.Forge{}, Providers: map[string]provider.Provider{}, log: log, runs: map[string]*poolRun{}, written: map[string]*config.Docker{}}
	f.Metrics = metrics.New(f)
	drivers := map[string]forge.Forge{}
	for _, fc := range cfg.Forges {
		switch fc.Type {
		case "gitea":
			owner, repo, _ := strings.Cut(fc.Repo, "/")
			if fc.Scope == "org" {
				owner = fc.Org
			}
			drivers[fc.Name] = gitea.New(gitea.Config{
				URL:       fc.URL,
				RunnerURL: fc.RunnerURL,
				Token:     fc.Token.Reveal(),
				Scope:     gitea.Scope{Kind: fc.Scope, Owner: owner, Repo: repo},
				Version:   "runfleet-" + Version,
				Logger:    log.With("forge", fc.Name),
			})
		case "github":
			d, err := github.New(github.Config{
				URL:            fc.URL,
				APIURL:         fc.APIURL,
				Token:          fc.Token.Reveal(),
				AppID:          fc.AppID,
				InstallationID: fc.InstallationID,
				PrivateKey:     []byte(fc.PrivateKey.Reveal()),
				RunnerGroupID:  fc.RunnerGroupID,
				CacheTTL:       fc.CacheTTL.Duration,
				Version:        Version,
				Logger:         log.With("forge", fc.Name),
			})
			if err != nil {
				return nil, fmt.Errorf("forges: %s: %w", fc.Name, err)
			}
			drivers[fc.Name] = d
		default:
			return nil, fmt.Errorf("forges: type %q is not supported by this build", fc.Type)
		}
	}
	f.drivers = drivers
	var errs []error
	f.detectGPUs(cfg)
	f.Demand = demand.New(nil, f.jobChanged)
	for i := range cfg.Pools {
		p, err := f.buildPool(&cfg.Pools[i])
		if err != nil {
			errs = append(errs, fmt.Errorf("pools[%d]: %w", i, err))
			continue
		}
		f.Pools = append(f.Pools, p)
	}
	if err := errors.Join(errs...); err != nil {
		f.Close()
		return nil, err
	}
	f.Demand.SetPools(f.demandPools(cfg))
	return f, nil
}

// buildPool makes one pool's provider, agent and reconciler. It may set
// the pool's size (from its GPUs) and image (by CUDA version).
func (f *Fleet) buildPool(pc *config.Pool) (*pool.Pool, error) {
	per, err := f.fitGPUs(pc)
	if err != nil {
		return nil, err
	}
	fc, _ := f.Config.Forge(pc.Forge)
	prov, ag, err := f.newProvider(*pc, fc.Type)
	if err != nil {
		return nil, err
	}
	fd := f.drivers[pc.Forge]
	f.Forges[pc.Name] = fd
	f.Providers[pc.Name] = prov
	name := pc.Name
	pcfg := f.poolConfig(*pc)
	if per != 0 {
		pcfg.GPUs, pcfg.GPUsPerRunner = f.GPUs, per
		pcfg.CUDA, pcfg.HardwareLabels = f.Inventory.CUDA, pc.HasHardwareLabels()
	}
	pcfg.TookWindow = time.Minute
	pcfg.Demand = func(took []int64) int { return f.Demand.Unserved(name, took, pcfg.TookWindow) }
	pcfg.OnStarted = func(d time.Duration) { f.Metrics.RunnerStart.WithLabelValues(name).Observe(d.Seconds()) }
	pcfg.OnError = func(op string) { f.Metrics.ProviderErrors.WithLabelValues(name, op).Inc() }
	return pool.New(pcfg, fd, prov, ag, pool.WithLogger(f.log)), nil
}

// poolConfig is the part of a pool's settings that a reload may change.
func (f *Fleet) poolConfig(pc config.Pool) pool.Config {
	return pool.Config{
		Name:             pc.Name,
		Manager:          f.Config.ID,
		Labels:           pc.Labels,
		Env:              pc.Env,
		Size:             pc.Size,
		Max:              pc.Max,
		IdleTimeout:      pc.IdleTimeout.Duration,
		MaxLifetime:      pc.MaxLifetime.Duration,
		BootstrapTimeout: pc.BootstrapTimeout.Duration,
		Resync:           f.Config.Resync.Duration,
		RetryLost:        pc.RetryLost == nil || *pc.RetryLost,
		Once:             pc.Single,
	}
}

// needsGPUs reports whether a pool needs the host's inventory: it gives
// runners GPUs, or chooses its image by CUDA version.
func needsGPUs(pc config.Pool) bool {
	return pc.GPUsPerRunner != 0 || pc.Docker != nil && (len(pc.Docker.Images) > 0 || gpu.IsTemplate(pc.Docker.Image))
}

// detectGPUs reads the host's GPUs once, if a pool needs them: a CPU-only
// configuration never runs nvidia-smi.
func (f *Fleet) detectGPUs(cfg *config.Config) {
	if !slices.ContainsFunc(cfg.Pools, needsGPUs) || f.Inventory != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	inv := gpu.Detect(ctx, cfg.GPU.NvidiaSMI)
	f.Inventory = &inv
	f.GPUs = gpu.NewAllocator(inv.Units())
	if len(inv.GPUs) == 0 {
		f.log.Warn("no GPU found", "reason", inv.Reason, "source", inv.Source)
		return
	}
	f.log.Info("GPUs found", "gpus", len(inv.GPUs), "units", f.GPUs.Len(), "driver", inv.Driver, "cuda", inv.CUDA, "source", inv.Source)
}

// fitGPUs checks a pool's GPU needs against the host, sizes a pool whose
// size comes from its GPUs, and picks its image by CUDA version. It
// returns the GPUs per runner for the pool (-1 all, 0 none).
func (f *Fleet) fitGPUs(pc *config.Pool) (int, error) {
	f.written[pc.Name] = pc.Docker
	if !needsGPUs(*pc) {
		return 0, nil
	}
	inv := *f.Inventory
	if pc.Docker != nil {
		image, err := gpu.PickImage(pc.Docker.Image, pc.Docker.GPUImages(), inv)
		if err != nil {
			return 0, fmt.Errorf("docker.image: %w", err)
		}
		if image != pc.Docker.Image {
			f.log.Info("image chosen for the driver's CUDA version", "pool", pc.Name, "image", image, "cuda", inv.CUDA)
		}
		d := *pc.Docker
		d.Image, d.Images = image, nil
		pc.Docker = &d
	}
	per := int(pc.GPUsPerRunner)
	if per == 0 {
		return 0, nil
	}
	units := f.GPUs.Len()
	switch {
	case units == 0:
		return 0, fmt.Errorf("gpus_per_runner: %s, and this host has no GPU (%s)", gpusText(per), inv.Reason)
	case per > units:
		return 0, fmt.Errorf("gpus_per_runner: %d, and this host has %d GPUs", per, units)
	}
	fit := 1 // runners the GPUs allow at once
	if per > 0 {
		fit = units / per
	}
	switch {
	case pc.SizeFromGPUs:
		pc.Size = fit
		pc.Max = max(pc.Max, pc.Size)
		f.log.Info("pool sized by its GPUs", "pool", pc.Name, "size", pc.Size, "gpus_per_runner", gpusText(per))
	case pc.Max > fit:
		f.log.Warn("the pool asks for more runners than the GPUs allow; it runs at most what they allow", "pool", pc.Name, "max", pc.Max, "runners_the_gpus_allow", fit)
	}
	return per, nil
}

func gpusText(per int) string {
	if per < 0 {
		return "all"
	}
	return strconv.Itoa(per)
}

// Holders maps each GPU id held by a runner of this manager to the
// runner, from the providers' own records (container labels, process
// records), so it holds whether or not the manager runs.
func (f *Fleet) Holders(ctx context.Context) (map[string]string, error) {
	out := map[string]string{}
	seen := map[provider.Provider]bool{}
	for _, prov := range f.Providers {
		if seen[prov] {
			continue
		}
		seen[prov] = true
		insts, err := prov.List(ctx, f.Config.ID)
		if err != nil {
			return nil, err
		}
		for _, in := range insts {
			for _, id := range in.GPUs {
				out[id] = in.Name
			}
		}
	}
	return out, nil
}

// newProvider makes a pool's provider and agent.
func (f *Fleet) newProvider(pc config.Pool, forgeType string) (provider.Provider, agent.Agent, error) {
	path := pc.Agent.Path
	inContainer := pc.Provider == "docker"
	if path == "" {
		path = "gitea-runner"
		if forgeType == "github" {
			path = "run.sh"
			if inContainer {
				path = "/home/runner/run.sh" // images/github-runner
			}
		}
	}
	if !inContainer {
		abs, err := exec.LookPath(path)
		if err != nil {
			return nil, nil, fmt.Errorf("agent.path: %q: %w", path, err)
		}
		path = abs
	}
	var ag agent.Agent = agent.GiteaRunner{Path: path, FetchInterval: pc.Agent.FetchInterval.Duration, InContainer: inContainer}
	if forgeType == "github" {
		ag = agent.GitHubRunner{Path: path, InContainer: inContainer}
	}
	switch pc.Provider {
	case "docker":
		// The agent runs from the image's PATH: nothing to look up here.
		if f.docker == nil {
			c, err := docker.NewClient()
			if err != nil {
				return nil, nil, err
			}
			f.docker = c
		}
		opt, err := dockerOptions(pc.Docker)
		if err != nil {
			return nil, nil, fmt.Errorf("docker: %w", err)
		}
		opt.Client = f.docker
		opt.Manager = f.Config.ID
		opt.Pool = pc.Name
		opt.LogDir = filepath.Join(f.Config.StateDir, "logs")
		// The runners' files are bind-mounted where the engine shares
		// this host's filesystem, and copied into the container where it
		// does not (a remote engine).
		if strings.HasPrefix(f.docker.DaemonHost(), "unix://") {
			opt.FilesDir = filepath.Join(f.Config.StateDir, "docker")
		}
		opt.Logger = f.log.With("provider", "docker", "pool", pc.Name)
		prov, err := docker.New(opt)
		if err != nil {
			return nil, nil, err
		}
		f.closers = append(f.closers, prov.Close)
		return prov, ag, nil
	default:
		prov, err := process.New(process.Options{
			StateDir: f.Config.StateDir, WorkRoot: pc.Workdir, Logger: f.log.With("provider", "process"),
		})
		if err != nil {
			return nil, nil, err
		}
		return prov, ag, nil
	}
}

// dockerOptions turns a validated docker section into provider options.
func dockerOptions(d *config.Docker) (docker.Options, error) {
	mem, err := d.MemoryBytes()
	if err != nil {
		return docker.Options{}, fmt.Errorf("memory: %w", err)
	}
	shm, err := d.ShmBytes()
	if err != nil {
		return docker.Options{}, fmt.Errorf("shm_size: %w", err)
	}
	opt := docker.Options{
		Image:             d.Image,
		Pull:              d.Pull,
		Network:           d.Network,
		User:              d.User,
		Workdir:           d.Workdir,
		NanoCPUs:          int64(d.CPUs * 1e9),
		Memory:            mem,
		ShmSize:           shm,
		OOMScoreAdj:       config.DefaultOOMScoreAdj,
		GPUs:              docker.GPUs{All: d.GPUs.All, IDs: d.GPUs.IDs},
		ExtraHosts:        d.ExtraHosts,
		MountDockerSocket: d.MountDockerSocket,
	}
	if d.OOMScoreAdj != nil {
		opt.OOMScoreAdj = *d.OOMScoreAdj
	}
	for _, v := range d.Volumes {
		m, err := config.ParseVolume(v)
		if err != nil {
			return docker.Options{}, err
		}
		opt.Mounts = append(opt.Mounts, docker.Mount{Source: m.Source, Target: m.Target, ReadOnly: m.ReadOnly})
	}
	return opt, nil
}

// Close releases what the fleet holds (event streams, output copies, the
// Docker connection). Runners keep running.
func (f *Fleet) Close() {
	for _, c := range f.closers {
		c()
	}
	if f.docker != nil {
		_ = f.docker.Close()
	}
}

// Drain drains every pool at once, for up to timeout.
func (f *Fleet) Drain(ctx context.Context, timeout time.Duration) []pool.Runner {
	f.log.Info("draining: removing idle runners, waiting for busy ones", "timeout", timeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var (
		mu   sync.Mutex
		left []pool.Runner
		wg   sync.WaitGroup
	)
	for _, p := range f.pools() {
		wg.Go(func() {
			l := p.Drain(ctx)
			mu.Lock()
			left = append(left, l...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if len(left) > 0 {
		names := make([]string, len(left))
		for i, r := range left {
			names[i] = r.Name + " (" + string(r.State) + ")"
		}
		f.log.Warn("drain timed out; runners left running (a restarted manager adopts them)", "runners", strings.Join(names, ", "))
	} else {
		f.log.Info("drained: no runner left")
	}
	return left
}
