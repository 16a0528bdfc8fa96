package cli

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/spf13/cobra"
)

// defaultHealthURL is the status listener's default address (status_listen
// when listen is set).
const defaultHealthURL = "http://127.0.0.1:9180/healthz"

// healthCmd asks a running manager's /healthz, for a container's health
// check: an image FROM scratch has no curl or wget to do it.
func healthCmd() *cobra.Command {
	var url string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "health",
		Short: "Exit 0 if the manager's /healthz says it is healthy (for a container's health check)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			return checkHealth(ctx, url, cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVar(&url, "url", cmp.Or(os.Getenv("RUNFLEET_HEALTH_URL"), defaultHealthURL), "the manager's /healthz [env RUNFLEET_HEALTH_URL]")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "how long to wait for the answer")
	return cmd
}

func checkHealth(ctx context.Context, url string, w io.Writer) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return &ExitError{ExitUsage, fmt.Errorf("--url: %w", err)}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("health: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("health: %s: %s", resp.Status, body)
	}
	_, err = w.Write(body)
	return err
}
