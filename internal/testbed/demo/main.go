// Command demo shows runfleet end to end on this machine with nothing to
// set up (`make demo`): a throw-away Gitea from the test bed, a pool of
// fresh gitea-runner agents managed in process by the daemon, and a matrix
// workflow whose jobs each take a runner of their own. It lives in the test
// bed because it builds and starts Gitea, which the runfleet binary never
// does.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	sdk "code.gitea.io/sdk/gitea"
	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	_ "github.com/runfleet/runfleet/forge/gitea" // the demo's forge and provider register themselves
	"github.com/runfleet/runfleet/internal/daemon"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	_ "github.com/runfleet/runfleet/provider/process"
)

func main() {
	if err := demoCmd().Execute(); err != nil {
		// cobra has printed the error and, for a usage error, the usage.
		os.Exit(1)
	}
}

func demoCmd() *cobra.Command {
	var (
		jobs, size int
		keep       bool
		timeout    time.Duration
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a local Gitea and a pool of fresh runners, and watch jobs run",
		Long: `demo shows runfleet end to end on this machine, with nothing to set up:
it builds Gitea and gitea-runner from the Go module proxy on first use
(several minutes, cached afterwards), starts a throw-away Gitea, creates a
repository with a workflow of --jobs matrix jobs, keeps a pool of --size
warm runners, and shows each job start and finish on its own fresh runner.
It needs Go and git on PATH.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if jobs < 1 || jobs > 256 {
				return fmt.Errorf("--jobs: %d is not between 1 and 256", jobs)
			}
			if size < 1 || size > 32 {
				return fmt.Errorf("--size: %d is not between 1 and 32", size)
			}
			cmd.SilenceUsage = true // from here on, errors are not about usage
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return runDemo(ctx, cmd.OutOrStdout(), jobs, size, keep, timeout)
		},
	}
	cmd.Flags().IntVar(&jobs, "jobs", 6, "number of matrix jobs in the demo workflow")
	cmd.Flags().IntVar(&size, "size", 2, "warm runners to keep in the pool")
	cmd.Flags().BoolVar(&keep, "keep", false, "keep Gitea and the pool running after the jobs, until Ctrl-C")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Minute, "give up if the jobs have not finished by then")
	return cmd
}

const demoWorkflow = `name: demo
on: [push]
jobs:
  hello:
    runs-on: runfleet-demo
    strategy:
      matrix:
        n: [%s]
    steps:
      - run: |
          echo "job ${{ matrix.n }} runs on a fresh runner in $PWD"
          test ! -e "$HOME/left-by-an-earlier-job" && echo "nothing left by an earlier job"
          touch "$HOME/left-by-an-earlier-job"
          sleep 1
`

func runDemo(ctx context.Context, w io.Writer, jobs, size int, keep bool, timeout time.Duration) error {
	step := func(n int, format string, args ...any) {
		fmt.Fprintf(w, "[%d/5] %s\n", n, fmt.Sprintf(format, args...))
	}
	step(1, "building gitea-runner %s and Gitea %s (cached in %s)", peers.RunnerVersion, peers.GiteaVersion, peers.CacheDir())
	runnerBin, err := peers.RunnerBinary(ctx, w)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "runfleet-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	g, err := peers.StartGitea(ctx, peers.GiteaOptions{Dir: filepath.Join(dir, "gitea"), Progress: w})
	if err != nil {
		return err
	}
	defer g.Stop()
	step(2, "Gitea is up at %s (user %s)", g.URL, g.User)
	if err := g.CreateRepo("demo"); err != nil {
		return err
	}

	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(g.Token), 0o600); err != nil {
		return err
	}
	cfgText := fmt.Sprintf(`id: demo
state_dir: %s
forges:
  - name: local
    type: gitea
    url: %s
    token_file: %s
    repo: %s/demo
pools:
  - name: demo
    labels: [runfleet-demo]
    size: %d
    max: %d
    agent:
      path: %s
      fetch_interval: 1s
`, filepath.Join(dir, "state"), g.URL, tokenFile, g.User, size, size, runnerBin)
	cfgPath := filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfgText), 0o600); err != nil {
		return err
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		return err
	}
	logPath := filepath.Join(os.TempDir(), "runfleet-demo.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	fleet, err := daemon.New(ctx, cfg, slog.New(slog.NewTextHandler(logf, nil)))
	if err != nil {
		return err
	}
	runCtx, stopFleet := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	go func() { fleet.Run(runCtx); close(done) }()
	defer func() {
		stopFleet()
		<-done
	}()
	step(3, "pool %q keeps %d fresh runners ready (manager log: %s)", "demo", size, logPath)
	if err := waitIdle(ctx, fleet, size, time.Minute); err != nil {
		return err
	}

	ns := make([]string, jobs)
	for i := range ns {
		ns[i] = fmt.Sprint(i + 1)
	}
	start := time.Now()
	if err := g.PutFile("demo", ".gitea/workflows/demo.yaml", fmt.Sprintf(demoWorkflow, strings.Join(ns, ", ")), "add demo workflow"); err != nil {
		return err
	}
	step(4, "pushed a workflow with %d jobs; each takes a fresh runner", jobs)
	ok, runners, err := watchJobs(ctx, w, g, jobs, timeout)
	if err != nil {
		return err
	}
	step(5, "%d of %d jobs succeeded in %s on %d distinct runners", ok, jobs, time.Since(start).Round(100*time.Millisecond), runners)
	if keep {
		fmt.Fprintf(w, "Gitea stays up at %s (user %s, token in %s); press Ctrl-C to stop.\n", g.URL, g.User, tokenFile)
		<-ctx.Done()
	}
	fmt.Fprintln(w, "draining the pool and stopping Gitea")
	if ok != jobs {
		return fmt.Errorf("%d of %d jobs failed", jobs-ok, jobs)
	}
	return nil
}

func waitIdle(ctx context.Context, fleet *daemon.Fleet, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		idle := 0
		for _, r := range fleet.Pools[0].Runners() {
			if r.State == "idle" {
				idle++
			}
		}
		if idle >= n {
			return nil
		}
		if err := fleet.Pools[0].LastError(); err != nil && time.Until(deadline) < timeout/2 {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return errors.New("the pool's runners did not come online; see the manager log")
}

// watchJobs prints each job's transitions until all are done.
func watchJobs(ctx context.Context, w io.Writer, g *peers.Gitea, want int, timeout time.Duration) (succeeded, runners int, err error) {
	c, err := g.Client()
	if err != nil {
		return 0, 0, err
	}
	seen := map[int64]string{}
	runnerOf := map[int64]string{}
	registrations := map[int64]bool{} // runner ids: names are reused, registrations never
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		resp, _, err := c.ListRepoActionJobs(g.User, "demo", sdk.ListRepoActionJobsOptions{ListOptions: sdk.ListOptions{PageSize: 100}})
		if err == nil {
			done := 0
			succeeded = 0
			for _, j := range resp.Jobs {
				state := j.Status
				if j.Conclusion != "" {
					state = j.Conclusion
				}
				if j.RunnerName != "" {
					runnerOf[j.ID] = j.RunnerName
				}
				if j.RunnerID != 0 {
					registrations[j.RunnerID] = true
				}
				if seen[j.ID] != state {
					seen[j.ID] = state
					fmt.Fprintf(w, "      %-12s %-12s %s\n", j.Name, state, runnerOf[j.ID])
				}
				if j.Status == "completed" {
					done++
					if j.Conclusion == "success" {
						succeeded++
					}
				}
			}
			if done >= want && len(resp.Jobs) >= want {
				return succeeded, len(registrations), nil
			}
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
	return 0, 0, fmt.Errorf("jobs did not finish within %s", timeout)
}
