package cli

import (
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/internal/daemon"
)

func serveCmd() *cobra.Command {
	var path string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the manager: keep every pool's runners ready until stopped",
		Long: `serve keeps each pool of the config at its size: fresh single-job runners,
a new one as soon as one takes or ends a job. On SIGTERM or SIGINT it
drains: it creates nothing more, removes idle runners and their
registrations, waits for busy runners (up to drain_timeout) and exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadConfig(path)
			if err != nil {
				return err
			}
			fleet, err := daemon.New(cfg, slog.Default())
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			fleet.Run(ctx)
			return nil
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "config file (YAML)")
	return cmd
}
