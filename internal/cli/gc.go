package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/daemon"
	"github.com/runfleet/runfleet/provider"
)

// Leftover is one thing a manager left: a machine, a registration, or
// what a machine left (provider.Sweeper).
type Leftover struct {
	Pool  string `json:"pool"`
	Kind  string `json:"kind"` // machine, registration, or the resource's kind
	Name  string `json:"name"`
	ID    string `json:"id"`
	State string `json:"state"`
	Busy  bool   `json:"busy"` // a registration running a job, or the machine under it
}

// GCReport is `runfleet gc -o json`.
type GCReport struct {
	Manager   string     `json:"manager"`
	Leftovers []Leftover `json:"leftovers"`
	// Complete is false when a forge or a provider could not be read:
	// there may be more than Leftovers.
	Complete bool     `json:"complete"`
	Errors   []string `json:"errors,omitempty"`
}

func gcCmd() *cobra.Command {
	var path, manager, output string
	var yes bool
	cmd := &cobra.Command{
		Use:   "gc -c fleet.yaml [--manager ID] [--yes]",
		Short: "List, and with --yes remove, what a manager left: machines and registrations",
		Long: `gc finds everything a manager id left on every configured provider and forge:
instances, pods, containers and processes carrying its id, registrations
named like its pools' runners, and what machines leave behind (an Azure
VM's auto-shutdown schedule left by an earlier version, an EBS volume or a Compute Engine disk kept
after its instance). It lists them; with --yes it removes them,
registrations first, then machines, then what machines left. A runner that
is running a job is left, with its machine. Run it when that manager is stopped (after a crash, or
when a manager id is retired): a running manager's runners would be removed
under it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" {
				return &ExitError{ExitUsage, fmt.Errorf("-o: %q is not table or json", output)}
			}
			cfg, err := loadConfig(path)
			if err != nil {
				return err
			}
			if manager != "" {
				cfg.ID = manager
			}
			fleet, err := daemon.Inspect(cmd.Context(), cfg, slog.New(slog.DiscardHandler))
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			defer fleet.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Minute)
			defer cancel()
			left, err := leftovers(ctx, fleet)
			out := cmd.OutOrStdout()
			if output == "json" {
				rep := GCReport{Manager: cfg.ID, Leftovers: left, Complete: err == nil}
				if rep.Leftovers == nil {
					rep.Leftovers = []Leftover{}
				}
				if err != nil {
					rep.Errors = strings.Split(err.Error(), "\n")
				}
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				if e := enc.Encode(rep); e != nil {
					return e
				}
			} else {
				printLeftovers(out, cfg.ID, left, err == nil)
			}
			if err != nil {
				// Nothing is removed on a partial listing: what could
				// not be read may be what a removal must come first for
				// (a registration before its machine).
				return fmt.Errorf("could not list everything manager %s left, so nothing was removed: %w", cfg.ID, err)
			}
			if !yes {
				if len(left) > 0 {
					fmt.Fprintln(out, "dry run: nothing removed; run again with --yes to remove these")
				}
				return nil
			}
			return removeLeftovers(ctx, out, fleet, left)
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "config file (YAML)")
	cmd.Flags().StringVar(&manager, "manager", "", "the manager id whose leftovers to find (the config's id by default)")
	cmd.Flags().BoolVar(&yes, "yes", false, "remove what is found (without it, gc only lists)")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format of the listing: table or json")
	return cmd
}

// leftovers lists each pool's machines of the manager and the
// registrations named like its runners (<pool>-<n>).
func leftovers(ctx context.Context, fleet *daemon.Fleet) ([]Leftover, error) {
	var out []Leftover
	var errs []error
	for _, p := range fleet.Pools {
		name := p.Name()
		runner := regexp.MustCompile("^" + regexp.QuoteMeta(name) + `-\d+$`)
		busy := map[string]bool{}
		regs, err := fleet.Forges[name].Runners(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("pool %s: registrations: %w", name, err))
		}
		for _, r := range regs {
			if !runner.MatchString(r.Name) {
				continue
			}
			b := r.Status == forge.StatusBusy
			busy[r.Name] = b
			out = append(out, Leftover{Pool: name, Kind: "registration", Name: r.Name, ID: strconv.FormatInt(r.ID, 10), State: string(r.Status), Busy: b})
		}
		insts, err := fleet.Providers[name].List(ctx, fleet.Config.ID)
		if err != nil {
			errs = append(errs, fmt.Errorf("pool %s: machines: %w", name, err))
		}
		for _, in := range insts {
			if in.Name == "" || in.Pool != "" && in.Pool != name {
				continue
			}
			out = append(out, Leftover{Pool: name, Kind: "machine", Name: in.Name, ID: in.ID, State: string(in.State), Busy: busy[in.Name]})
		}
		if sw, ok := fleet.Providers[name].(provider.Sweeper); ok {
			res, err := sw.Leftovers(ctx, fleet.Config.ID)
			if err != nil {
				errs = append(errs, fmt.Errorf("pool %s: what machines left: %w", name, err))
			}
			for _, r := range res {
				out = append(out, Leftover{Pool: name, Kind: r.Kind, Name: r.Name, ID: r.ID, State: cmp.Or(r.State, "its machine is gone")})
			}
		}
	}
	return out, errors.Join(errs...)
}

// removalOrder is the order gc removes leftovers in: registrations before
// their machines (a forge refuses to let go of a busy one), and what a
// machine left after the machines.
func removalOrder(kind string) int {
	switch kind {
	case "registration":
		return 0
	case "machine":
		return 1
	}
	return 2
}

// printLeftovers prints what was found; it says that nothing is left
// only when everything could be read.
func printLeftovers(w io.Writer, manager string, left []Leftover, complete bool) {
	switch {
	case len(left) == 0 && complete:
		fmt.Fprintf(w, "manager %s left nothing\n", manager)
		return
	case len(left) == 0:
		return
	case !complete:
		fmt.Fprintf(w, "found so far (the listing is incomplete):\n")
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tKIND\tNAME\tID\tSTATE")
	for _, l := range left {
		state := l.State
		if l.Busy {
			state += " (running a job: left)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", l.Pool, l.Kind, l.Name, l.ID, state)
	}
	tw.Flush()
}

// removeLeftovers removes registrations, then machines; a busy runner is
// left. It goes on past a failure and reports them all.
func removeLeftovers(ctx context.Context, w io.Writer, fleet *daemon.Fleet, left []Leftover) error {
	var errs []error
	order := slices.Clone(left)
	slices.SortStableFunc(order, func(a, b Leftover) int { return removalOrder(a.Kind) - removalOrder(b.Kind) })
	removed := 0
	for _, l := range order {
		if l.Busy {
			continue
		}
		var err error
		switch l.Kind {
		case "registration":
			id, _ := strconv.ParseInt(l.ID, 10, 64)
			err = fleet.Forges[l.Pool].RemoveRunner(ctx, id)
			if errors.Is(err, forge.ErrNotFound) {
				err = nil
			}
		case "machine":
			err = fleet.Providers[l.Pool].Delete(ctx, l.Name)
		default:
			sw, _ := fleet.Providers[l.Pool].(provider.Sweeper)
			err = sw.Sweep(ctx, provider.Resource{Kind: l.Kind, Name: l.Name, ID: l.ID, State: l.State})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %s (%s): %w", l.Kind, l.Name, l.ID, err))
			continue
		}
		removed++
		fmt.Fprintf(w, "removed %s %s (%s)\n", l.Kind, l.Name, l.ID)
	}
	fmt.Fprintf(w, "removed %d of %d\n", removed, len(left))
	return errors.Join(errs...)
}
