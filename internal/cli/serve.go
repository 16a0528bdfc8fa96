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

func serveCmd() *cobra.Command {
	var path, listen string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the manager: keep every pool's runners ready, scale them with the queue, until stopped",
		Long: `serve keeps each pool of the config at its size, plus a runner for each
queued job that matches it (from webhooks and polling the forge's queue), up
to its max: fresh single-job runners, a new one as soon as one takes or ends a
job. Idle runners above the size go after idle_timeout; a runner that took a
job is never removed.

It serves, on listen: /webhook/<forge> for workflow_job webhooks, /metrics for
Prometheus, /healthz, and a status page at /.

SIGHUP reloads the config: sizes, limits, timeouts, labels and environment
change in place, new pools start, removed pools drain; busy runners are not
touched. On SIGTERM or SIGINT it drains: it creates nothing more, removes idle
runners and their registrations, waits for busy runners (up to drain_timeout)
and exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadConfig(path)
			if err != nil {
				return err
			}
			if cmd.Flags().Changed("listen") {
				cfg.Listen = listen
			}
			log := slog.Default()
			fleet, err := daemon.New(cfg, log)
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			var srv *http.Server
			if cfg.Listen != "" {
				ln, err := net.Listen("tcp", cfg.Listen)
				if err != nil {
					fleet.Close()
					return &ExitError{ExitUsage, fmt.Errorf("listen: %w", err)}
				}
				srv = &http.Server{Handler: fleet.Handler(), ReadHeaderTimeout: 10 * time.Second}
				go func() {
					if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
						log.Error("http server stopped", "err", err)
					}
				}()
				log.Info("serving webhooks, metrics and the status page", "addr", ln.Addr().String())
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			go func() {
				for {
					select {
					case <-ctx.Done():
						return
					case <-hup:
						reload(fleet, path, log)
					}
				}
			}()
			fleet.Run(ctx)
			if srv != nil {
				sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_ = srv.Shutdown(sctx)
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "config file (YAML)")
	cmd.Flags().StringVar(&listen, "listen", "", "address of the HTTP server (webhooks, /metrics, /healthz, status page); overrides the config's listen")
	return cmd
}

// reload re-reads the config on SIGHUP. A config that does not load, or
// that changes what needs a restart, is refused and the running one stays.
func reload(fleet *daemon.Fleet, path string, log *slog.Logger) {
	cfg, err := config.Load(path)
	if err != nil {
		log.Error("reload refused: the config does not load; keeping the running one", "err", err)
		return
	}
	cfg.Listen = fleet.Config.Listen
	if err := fleet.Reload(cfg); err != nil {
		log.Error("reload", "err", err)
		return
	}
	log.Info("config reloaded", "pools", len(cfg.Pools))
}
