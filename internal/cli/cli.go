// Package cli holds runfleet's commands.
package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/version"
)

// ExitError carries a process exit code.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// Exit codes.
const (
	ExitFailure = 1
	ExitUsage   = 2 // bad flags or a bad config: nothing was started
)

// ExitCode returns the exit code for an error returned by Execute.
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	if e, ok := errors.AsType[*ExitError](err); ok {
		return e.Code
	}
	return ExitFailure
}

// New returns the root command.
func New() *cobra.Command {
	root := &cobra.Command{
		Use:   "runfleet",
		Short: "Self-hosted CI runners on demand: fresh single-job runners, GPUs included",
		Long: `runfleet keeps pools of fresh single-job CI runners ready for your forge,
starts more when jobs queue, and removes them when idle, leaving no runner
or registration behind.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		// runfleet --version says what runfleet version does.
		Version: version.Get().String() + "\n" + driversLine(),
	}
	root.SetVersionTemplate("{{.Version}}\n")
	var logLevel, logFormat string
	root.PersistentFlags().StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	root.PersistentFlags().StringVar(&logFormat, "log-format", "text", "log format: text or json")
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		var lvl slog.Level
		if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
			return &ExitError{ExitUsage, fmt.Errorf("--log-level: %q is not a level (debug, info, warn, error)", logLevel)}
		}
		var h slog.Handler
		switch logFormat {
		case "text":
			h = slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: lvl})
		case "json":
			h = slog.NewJSONHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: lvl})
		default:
			return &ExitError{ExitUsage, fmt.Errorf("--log-format: %q is not text or json", logFormat)}
		}
		slog.SetDefault(slog.New(h))
		return nil
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &ExitError{ExitUsage, err} })
	root.AddCommand(serveCmd(), runnerCmd(), statusCmd(), jobsCmd(), gpusCmd(), versionCmd(), agentCmd(), gcCmd(), initCmd(), healthCmd())
	return root
}

func loadConfig(path string) (*config.Config, error) {
	if path == "" {
		return nil, &ExitError{ExitUsage, errors.New("no config file: pass -c fleet.yaml")}
	}
	cfg, err := config.Load(path)
	if err != nil {
		return nil, &ExitError{ExitUsage, err}
	}
	return cfg, nil
}

func versionCmd() *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit and build date, and the drivers built in",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			info := version.Get()
			forges, providers := builtDrivers()
			switch output {
			case "table", "text": // text, as it was first spelled
				fmt.Fprintln(cmd.OutOrStdout(), info)
				fmt.Fprintln(cmd.OutOrStdout(), driversLine())
			case "json":
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				// The drivers this build has (docs/builds.md).
				return enc.Encode(struct {
					version.Info
					Forges    []string `json:"forges"`
					Providers []string `json:"providers"`
				}{info, forges, providers})
			default:
				return &ExitError{ExitUsage, fmt.Errorf("-o: %q is not table or json", output)}
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	return cmd
}

// indent prefixes every line of a multi-line error, for readable output.
func indent(w io.Writer, err error) {
	for _, line := range strings.Split(err.Error(), "\n") {
		fmt.Fprintln(w, "  "+line)
	}
}

// Main runs the root command and returns the exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	root := New()
	root.SetArgs(cmlArrays(args))
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.Execute()
	if err != nil {
		fmt.Fprintln(stderr, "runfleet: error:")
		indent(stderr, err)
	}
	return ExitCode(err)
}
