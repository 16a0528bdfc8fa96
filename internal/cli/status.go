package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/daemon"
	"github.com/runfleet/runfleet/pool"
)

// RunnerStatus is one runner in `runfleet status`.
type RunnerStatus struct {
	Pool     string    `json:"pool"`
	Name     string    `json:"name"`
	State    string    `json:"state"`
	RunnerID int64     `json:"runner_id,omitempty"`
	Machine  string    `json:"machine,omitempty"`
	Created  time.Time `json:"created,omitzero"`
	AgeSec   float64   `json:"age_seconds"`
	GPUs     []string  `json:"gpus,omitempty"`
	Job      *JobRef   `json:"job,omitempty"`
	// Reason is why the runner's machine is not running, in the
	// provider's words.
	Reason string `json:"reason,omitempty"`
	// Shape is what its job asked for, in a dynamic pool.
	Shape string `json:"shape,omitempty"`
}

// JobRef names the job a runner is running.
type JobRef struct {
	ID    int64  `json:"id"`
	RunID int64  `json:"run_id"`
	Name  string `json:"name"`
}

// PoolStatus is one pool in `runfleet status`.
type PoolStatus struct {
	Name  string `json:"name"`
	Size  int    `json:"size"`
	Max   int    `json:"max"`
	Error string `json:"error,omitempty"`
	// Backoff is why the pool holds off starting runners, as its manager
	// last recorded it: runners that failed one after another.
	Backoff *pool.Backoff `json:"backoff,omitempty"`
	// Refused lists the queued jobs that ask a dynamic pool for what it
	// does not allow, and why no runner starts for them.
	Refused []string       `json:"refused,omitempty"`
	Runners []RunnerStatus `json:"runners"`
}

func statusCmd() *cobra.Command {
	var path, output string
	var watchEvery time.Duration
	watching := false
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show pools and their runners: idle, busy or starting, age, current job",
		Long: `status reads the truth from where it lives — the provider's machines and
the forge's registrations and jobs — so it works whether or not the manager
is running, and changes nothing.

With --watch it redraws in place until interrupted: what the running
manager's status listener shows (pools, what is wrong and what runfleet does
next, runners, GPUs with their use, the queue), or, while no manager
answers, what it reads itself (every 15 s at most, to spare the forge's
budget of calls).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" {
				return &ExitError{ExitUsage, fmt.Errorf("-o: %q is not table or json", output)}
			}
			cfg, err := loadConfig(path)
			if err != nil {
				return err
			}
			fleet, err := daemon.Inspect(cmd.Context(), cfg, slog.New(slog.DiscardHandler))
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			defer fleet.Close()
			if watching {
				if watchEvery < time.Second {
					return &ExitError{ExitUsage, fmt.Errorf("--interval: %s is under a second", watchEvery)}
				}
				// Interrupted is how a watch ends: exit 0.
				ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
				defer stop()
				return watch(ctx, cmd.OutOrStdout(), cfg, watchEvery, func(ctx context.Context) []PoolStatus { return collect(ctx, fleet) })
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			pools := collect(ctx, fleet)
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(map[string]any{"manager": cfg.ID, "pools": pools}); err != nil {
					return err
				}
			} else {
				printTable(cmd.OutOrStdout(), pools)
			}
			// The same exit for either output: a pool that could not be
			// read is a failure a script must see.
			var errs []error
			for _, p := range pools {
				if p.Error != "" {
					errs = append(errs, errors.New(p.Error))
				}
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "config file (YAML)")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	cmd.Flags().BoolVarP(&watching, "watch", "w", false, "redraw in place until interrupted")
	cmd.Flags().DurationVar(&watchEvery, "interval", 2*time.Second, "with --watch, how often to redraw")
	return cmd
}

func collect(ctx context.Context, fleet *daemon.Fleet) []PoolStatus {
	now := time.Now()
	jobsByForge := map[forge.Forge]map[int64]forge.Job{}
	var out []PoolStatus
	for i, p := range fleet.Pools {
		pc := fleet.Config.Pools[i]
		plan, _ := fleet.Plan(p.Name())
		ps := PoolStatus{Name: p.Name(), Size: plan.Size, Max: plan.Max, Runners: []RunnerStatus{}}
		b := fleet.SavedBackoff(p.Name())
		if b.Failures > 0 {
			ps.Backoff = &b
		}
		ps.Refused = refused(ctx, pc, fleet.Forges[p.Name()])
		for _, shape := range slices.Sorted(maps.Keys(b.Shapes)) {
			ps.Refused = append(ps.Refused, fmt.Sprintf("jobs asking %s get no runner: %s", shape, b.Shapes[shape]))
		}
		runners, err := p.Observe(ctx)
		if err != nil {
			ps.Error = err.Error()
			out = append(out, ps)
			continue
		}
		f := fleet.Forges[p.Name()]
		jobs, ok := jobsByForge[f]
		if !ok {
			jobs = map[int64]forge.Job{}
			if l, ok := f.(forge.JobLister); ok {
				if list, err := l.Jobs(ctx, forge.JobInProgress); err == nil {
					for _, j := range list {
						jobs[j.RunnerID] = j
					}
				}
			}
			jobsByForge[f] = jobs
		}
		for _, r := range runners {
			rs := RunnerStatus{Pool: r.Pool, Name: r.Name, State: string(r.State), RunnerID: r.RunnerID, Machine: r.Machine, Created: r.Created, GPUs: r.GPUs, Reason: r.Reason, Shape: r.Shape}
			if !r.Created.IsZero() {
				rs.AgeSec = now.Sub(r.Created).Round(time.Second).Seconds()
			}
			if j, ok := jobs[r.RunnerID]; ok && r.RunnerID != 0 {
				rs.Job = &JobRef{ID: j.ID, RunID: j.RunID, Name: j.Name}
			}
			ps.Runners = append(ps.Runners, rs)
		}
		out = append(out, ps)
	}
	return out
}

func printTable(w io.Writer, pools []PoolStatus) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	gpus := slices.ContainsFunc(pools, func(p PoolStatus) bool {
		return slices.ContainsFunc(p.Runners, func(r RunnerStatus) bool { return len(r.GPUs) > 0 })
	})
	fmt.Fprint(tw, "POOL\tRUNNER\tSTATE\tAGE\t")
	if gpus {
		fmt.Fprint(tw, "GPUS\t")
	}
	fmt.Fprintln(tw, "JOB")
	for _, p := range pools {
		if p.Error != "" {
			fmt.Fprintf(tw, "%s\t-\terror\t-\t%s\n", p.Name, p.Error)
			continue
		}
		if len(p.Runners) == 0 {
			fmt.Fprintf(tw, "%s\t-\t(no runners)\t-\t-\n", p.Name)
		}
		for _, r := range p.Runners {
			age := "-"
			if !r.Created.IsZero() {
				age = (time.Duration(r.AgeSec) * time.Second).String()
			}
			job := "-"
			if r.Job != nil {
				job = fmt.Sprintf("%s (run %d, job %d)", r.Job.Name, r.Job.RunID, r.Job.ID)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t", p.Name, r.Name, r.State, age)
			if gpus {
				g := strings.Join(r.GPUs, ",")
				if g == "" {
					g = "-"
				}
				fmt.Fprintf(tw, "%s\t", g)
			}
			if r.Reason != "" {
				job += "  (" + r.Reason + ")"
			}
			fmt.Fprintln(tw, job)
		}
	}
	tw.Flush()
	for _, p := range pools {
		if p.Backoff != nil {
			// After the table: the reason carries the agent's last lines.
			fmt.Fprintf(w, "\npool %s: %s\n", p.Name, p.Backoff)
		}
		for _, r := range p.Refused {
			fmt.Fprintf(w, "\npool %s: %s\n", p.Name, r)
		}
	}
}

// refused lists a dynamic pool's queued jobs that ask for what it does not
// allow, with the reason, read from the forge's queue.
func refused(ctx context.Context, pc config.Pool, f forge.Forge) []string {
	l, ok := f.(forge.JobLister)
	if pc.Dynamic == nil || !ok {
		return nil
	}
	queued, err := l.Jobs(ctx, forge.JobQueued)
	if err != nil {
		return nil
	}
	var out []string
	for _, j := range queued {
		plain, _ := dynamic.Split(j.Labels)
		if !demand.Covers(pc.Labels, plain) {
			continue
		}
		if _, err := pc.Dynamic.Resolve(dynamic.Shape(j.Labels)); err != nil {
			out = append(out, fmt.Sprintf("job %d (%s) gets no runner: %v", j.ID, strings.Join(j.Labels, ", "), err))
		}
	}
	return out
}
