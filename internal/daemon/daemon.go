// Package daemon wires a configuration into forge drivers, providers and
// pool reconcilers, runs them, and drains them on shutdown.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/gitea"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider/process"
)

// Version is the runfleet version, set by the build.
var Version = "dev"

// Fleet is a configured set of pools.
type Fleet struct {
	Config *config.Config
	Pools  []*pool.Pool
	// Forges by pool name, for reading jobs.
	Forges map[string]forge.Forge
	log    *slog.Logger
}

// New builds the fleet for a validated config. It makes no network call;
// it fails only on what is wrong locally (an agent binary that is missing,
// a directory that cannot be made), which is a configuration error.
func New(cfg *config.Config, log *slog.Logger) (*Fleet, error) {
	f := &Fleet{Config: cfg, Forges: map[string]forge.Forge{}, log: log}
	drivers := map[string]forge.Forge{}
	for _, fc := range cfg.Forges {
		switch fc.Type {
		case "gitea":
			owner, repo, _ := strings.Cut(fc.Repo, "/")
			if fc.Scope == "org" {
				owner = fc.Org
			}
			drivers[fc.Name] = gitea.New(gitea.Config{
				URL:     fc.URL,
				Token:   fc.Token.Reveal(),
				Scope:   gitea.Scope{Kind: fc.Scope, Owner: owner, Repo: repo},
				Version: "runfleet-" + Version,
				Logger:  log.With("forge", fc.Name),
			})
		default:
			return nil, fmt.Errorf("forges: type %q is not supported by this build", fc.Type)
		}
	}
	var errs []error
	for i, pc := range cfg.Pools {
		path := pc.Agent.Path
		if path == "" {
			path = "gitea-runner"
		}
		abs, err := exec.LookPath(path)
		if err != nil {
			errs = append(errs, fmt.Errorf("pools[%d].agent.path: %q: %w", i, path, err))
			continue
		}
		prov, err := process.New(process.Options{
			StateDir: cfg.StateDir, WorkRoot: pc.Workdir, Logger: log.With("provider", "process"),
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("pools[%d]: %w", i, err))
			continue
		}
		fd := drivers[pc.Forge]
		f.Forges[pc.Name] = fd
		f.Pools = append(f.Pools, pool.New(pool.Config{
			Name:             pc.Name,
			Manager:          cfg.ID,
			Labels:           pc.Labels,
			Env:              pc.Env,
			Size:             pc.Size,
			Max:              pc.Max,
			IdleTimeout:      pc.IdleTimeout.Duration,
			MaxLifetime:      pc.MaxLifetime.Duration,
			BootstrapTimeout: pc.BootstrapTimeout.Duration,
			Resync:           cfg.Resync.Duration,
		}, fd, prov, agent.GiteaRunner{Path: abs, FetchInterval: pc.Agent.FetchInterval.Duration}, pool.WithLogger(log)))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return f, nil
}

// Run reconciles every pool until ctx ends, then drains them: no new
// runners, idle ones removed with their registrations, busy ones awaited
// for up to the config's drain timeout. It returns the runners still left
// after that; busy runners are never killed.
func (f *Fleet) Run(ctx context.Context) []pool.Runner {
	var wg sync.WaitGroup
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	for _, p := range f.Pools {
		wg.Go(func() { p.Run(runCtx) })
	}
	f.log.Info("runfleet started", "manager", f.Config.ID, "pools", len(f.Pools), "version", Version)
	<-ctx.Done()
	stop()
	wg.Wait()
	return f.Drain(context.Background(), f.Config.DrainTimeout.Duration)
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
	for _, p := range f.Pools {
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
