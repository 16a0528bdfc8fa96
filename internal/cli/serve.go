package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/daemon"
)

// runElected runs the fleet while this manager holds the config's Lease,
// and waits as a standby while another does. Set by elect.go, in builds
// with the Kubernetes client (the kubernetes driver's).
var runElected func(ctx context.Context, fleet *daemon.Fleet, le *config.LeaderElection, log *slog.Logger) error

func serveCmd() *cobra.Command {
	var path, listen, statusListen string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the manager: keep every pool's runners ready, scale them with the queue, until stopped",
		Long: `serve keeps each pool of the config at its size, plus a runner for each
queued job that matches it (from webhooks and polling the forge's queue), up
to its max: fresh single-job runners, a new one as soon as one takes or ends a
job. Idle runners above the size go after idle_timeout; a runner that took a
job is never removed.

It serves, on listen, /webhook/<forge> for workflow_job webhooks and nothing
else; and on status_listen (127.0.0.1:9180 unless said otherwise; "off" for
none) a status page at /, /metrics for Prometheus and /healthz, which show
repository, job and runner names: keep them off the forges' way, or set
status_token. Should another program hold the default address, serve says so
and runs without the page.

SIGHUP reloads the config: sizes, limits, timeouts, labels and environment
change in place, new pools start, removed pools drain; busy runners are not
touched. On SIGTERM or SIGINT it drains: it creates nothing more, removes idle
runners and their registrations, waits for busy runners (up to drain_timeout)
and exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Signals are caught before anything slow (a cluster's client,
			// a forge's first answer): a SIGTERM during start-up is a
			// drain, not a death that leaves what was made behind.
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			slog.Debug("starting; SIGTERM drains from here on", "config", path)
			cfg, err := loadConfig(path)
			if err != nil {
				return err
			}
			if cmd.Flags().Changed("listen") {
				cfg.Listen = listen
			}
			if cmd.Flags().Changed("status-listen") {
				cfg.StatusListen, cfg.StatusListenGiven = cfg.DefaultStatus(statusListen), true
			}
			if err := cfg.Validate(); err != nil {
				return &ExitError{ExitUsage, err}
			}
			log := slog.Default()
			fleet, err := daemon.New(ctx, cfg, log)
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			servers, err := startServers(fleet, log)
			if err != nil {
				fleet.Close()
				return &ExitError{ExitUsage, err}
			}
			go func() {
				for {
					select {
					case <-ctx.Done():
						return
					case <-hup:
						reload(ctx, fleet, path, log)
					}
				}
			}()
			var runErr error
			if le := cfg.LeaderElection; le != nil {
				// Config.Validate refused leader_election in a build
				// without the Kubernetes client, which sets runElected.
				runErr = runElected(ctx, fleet, le, log)
			} else {
				fleet.Run(ctx)
			}
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			for _, srv := range servers {
				_ = srv.Shutdown(sctx)
			}
			if runErr != nil {
				// A manager that lost its lease exits for a supervisor
				// to restart it as a candidate.
				return &ExitError{ExitFailure, runErr}
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "config file (YAML)")
	cmd.Flags().StringVar(&listen, "listen", "", "address of the webhook listener; overrides the config's listen")
	cmd.Flags().StringVar(&statusListen, "status-listen", "", "address of the status page, /metrics and /healthz (default 127.0.0.1:9180, \"off\" for none); overrides the config's status_listen")
	return cmd
}

// startServers starts the webhook listener and the status listener (one
// server when they share an address, the status token then guarding the
// status side).
func startServers(fleet *daemon.Fleet, log *slog.Logger) ([]*http.Server, error) {
	cfg := fleet.Config
	type listener struct {
		addr, what string
		h          http.Handler
	}
	var ls []listener
	switch {
	case cfg.Listen != "" && cfg.Listen == cfg.StatusListen:
		ls = append(ls, listener{cfg.Listen, "webhooks, and the status page, metrics and health behind the status token", fleet.Handler()})
	default:
		if cfg.Listen != "" {
			ls = append(ls, listener{cfg.Listen, "webhooks", fleet.WebhookHandler()})
		}
		if cfg.StatusListen != "" {
			ls = append(ls, listener{cfg.StatusListen, "the status page, metrics and health", fleet.StatusHandler()})
		}
	}
	var servers []*http.Server
	for _, l := range ls {
		ln, err := net.Listen("tcp", l.addr)
		if err != nil && l.addr == cfg.StatusListen && !cfg.StatusListenGiven && l.addr != cfg.Listen {
			// The default address, which another manager on this host
			// may hold: no page, said once, rather than no manager.
			log.Warn("the status page, metrics and health are not served: the default address is taken; set status_listen", "addr", l.addr, "err", err)
			continue
		}
		if err != nil {
			for _, s := range servers {
				_ = s.Close()
			}
			return nil, fmt.Errorf("listen for %s: %w", l.what, err)
		}
		// Bounded reads: a slow or endless request cannot hold the
		// server.
		srv := &http.Server{Handler: l.h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute, IdleTimeout: 2 * time.Minute}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("http server stopped", "err", err)
			}
		}()
		servers = append(servers, srv)
		log.Info("serving "+l.what, "addr", ln.Addr().String())
	}
	if h, _, err := net.SplitHostPort(cfg.StatusListen); err == nil && cfg.StatusToken == "" {
		if !isLoopback(h) {
			log.Warn("the status page and /metrics are served beyond this host without a token; they show repository, job and runner names", "status_listen", cfg.StatusListen)
		}
	}
	return servers, nil
}

// reload re-reads the config on SIGHUP. A config that does not load, or
// that changes what needs a restart, is refused and the running one stays.
func reload(ctx context.Context, fleet *daemon.Fleet, path string, log *slog.Logger) {
	cfg, err := config.Load(path)
	if err != nil {
		log.Error("reload refused: the config does not load; keeping the running one", "err", err)
		return
	}
	cfg.Listen, cfg.StatusListen = fleet.Config.Listen, fleet.Config.StatusListen
	if err := fleet.Reload(ctx, cfg); err != nil {
		log.Error("reload", "err", err)
		return
	}
	log.Info("config reloaded", "pools", len(cfg.Pools))
}
