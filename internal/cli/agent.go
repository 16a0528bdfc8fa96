package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/bootstrap"
)

// agentCmd is the instance side of a cloud runner: the user data of an
// instance that a cloud provider started runs it with the plan it wrote.
func agentCmd() *cobra.Command {
	var plan string
	var keep bool
	cmd := &cobra.Command{
		Use:   "agent --plan FILE",
		Short: "Run one runner's agent on a cloud instance, then power the instance off",
		Long: `agent runs on an instance that runfleet started for one runner: it writes
the runner's files, starts the forge's agent, watches the cloud's metadata
service for interruption notices, and powers the instance off when the agent
ends, when no job came within the idle timeout, or at the runner's deadline,
also when the manager is gone. The plan file is removed once read.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if plan == "" {
				return &ExitError{ExitUsage, errors.New("--plan: is required")}
			}
			p, err := bootstrap.Read(plan)
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			if !keep {
				// The credential now lives only in the agent's files and
				// environment.
				_ = os.Remove(plan)
			}
			notices, err := bootstrap.NoticesFor(p)
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, os.Interrupt)
			defer stop()
			why, err := bootstrap.Run(ctx, p, bootstrap.Options{Notices: notices, Output: cmd.OutOrStdout()})
			fmt.Fprintln(cmd.ErrOrStderr(), "runfleet agent:", why)
			return err
		},
	}
	cmd.Flags().StringVar(&plan, "plan", "", "the runner's plan, written by the instance's user data")
	cmd.Flags().BoolVar(&keep, "keep-plan", false, "keep the plan file (for debugging)")
	return cmd
}
