package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/record"
	"github.com/runfleet/runfleet/server"
)

func jobsCmd() *cobra.Command {
	var path, output, since, pool string
	var all bool
	var limit int
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "List recent jobs: where and on what they ran, how long they waited and ran, how they ended",
		Long: `jobs reads the manager's history of jobs (history.path, <state_dir>/history.db
by default): one record per runner, with the machine, image and digest, GPUs,
driver and CUDA versions it was given, and the forge's job it ran. While a
manager runs, jobs reads the file between the manager's writes; should the
file stay locked, it asks the manager through its status listener (with
status_token).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" {
				return &ExitError{ExitUsage, fmt.Errorf("-o: %q is not table or json", output)}
			}
			q := history.Query{Pool: pool, All: all, Limit: limit}
			if since != "" {
				t, err := server.Since(since, time.Now())
				if err != nil {
					return &ExitError{ExitUsage, fmt.Errorf("--%w", err)}
				}
				q.Since = t
			}
			cfg, err := loadConfig(path)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			recs, err := readJobs(ctx, cfg, q)
			if err != nil {
				return err
			}
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(recs)
			}
			return jobsTable(cmd.OutOrStdout(), recs)
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "the manager's config file")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "table or json")
	cmd.Flags().StringVar(&since, "since", "24h", `jobs of runners made since: a duration back from now, or a time (RFC 3339); "" for all`)
	cmd.Flags().StringVar(&pool, "pool", "", "only this pool's")
	cmd.Flags().BoolVar(&all, "all", false, "runners that took no job too")
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many, newest first (0: no limit)")
	return cmd
}

// readJobs reads the history from its file, or from the manager that holds
// it.
func readJobs(ctx context.Context, cfg *config.Config, q history.Query) ([]record.Record, error) {
	s, err := history.OpenReadOnly(cfg.History.Path)
	if errors.Is(err, fs.ErrNotExist) {
		return []record.Record{}, nil // no manager has run yet
	}
	var recs []record.Record
	if err == nil {
		recs, err = s.List(q)
		s.Close()
	}
	if !errors.Is(err, history.ErrLocked) {
		return recs, err
	}
	// A write that holds the file for long (a prune of a large history):
	// the manager answers from its side.
	if cfg.StatusListen == "" {
		return nil, fmt.Errorf("%w, and it serves no status listener (status_listen) to ask", err)
	}
	recs, aerr := askManager(ctx, cfg, q)
	if aerr != nil {
		return nil, fmt.Errorf("%w; asking it failed: %w", err, aerr)
	}
	return recs, nil
}

// askManager reads /jobs from the manager's status listener.
func askManager(ctx context.Context, cfg *config.Config, q history.Query) ([]record.Record, error) {
	v := url.Values{}
	if !q.Since.IsZero() {
		v.Set("since", q.Since.UTC().Format(time.RFC3339Nano))
	}
	if q.Pool != "" {
		v.Set("pool", q.Pool)
	}
	if q.All {
		v.Set("all", "true")
	}
	if q.Limit > 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	host := cfg.StatusListen
	if strings.HasPrefix(host, ":") || strings.HasPrefix(host, "0.0.0.0:") || strings.HasPrefix(host, "[::]:") {
		host = "127.0.0.1:" + host[strings.LastIndex(host, ":")+1:]
	}
	u := "http://" + host + "/jobs?" + v.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	if tok := cfg.StatusToken.Reveal(); tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(res.Body, 512))
		return nil, fmt.Errorf("GET /jobs: %s: %s", res.Status, strings.TrimSpace(string(b)))
	}
	var recs []record.Record
	if err := json.NewDecoder(res.Body).Decode(&recs); err != nil {
		return nil, fmt.Errorf("GET /jobs: %w", err)
	}
	return recs, nil
}

// jobsTable writes one line per record.
func jobsTable(w io.Writer, recs []record.Record) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CREATED\tPOOL\tRUNNER\tJOB\tRESULT\tWAITED\tRAN\tMACHINE\tGPUS\tIMAGE")
	for _, r := range recs {
		job, result, waited, ran := "-", "-", "-", "-"
		if j := r.Job; j != nil {
			job = cmp.Or(j.Name, strconv.FormatInt(j.ID, 10))
			result = cmp.Or(j.Conclusion, j.Status)
			if j.Conclusion == "" && !r.Ended.IsZero() {
				result = "ended, unreported" // no webhook told how
			}
			if d := j.Waited(); d > 0 {
				waited = d.Round(time.Second).String()
			}
			if d := j.Ran(); d > 0 {
				ran = d.Round(time.Second).String()
			}
		} else if !r.JobStarted.IsZero() {
			job = "(unknown)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
			r.Created.Local().Format("2006-01-02 15:04:05"), r.Pool, r.Runner, job, result, waited, ran,
			machineText(r.Machine), cmp.Or(strings.Join(r.GPUUUIDs(), ","), "-"), imageText(r.Machine))
	}
	return tw.Flush()
}

func machineText(m record.Machine) string {
	var parts []string
	for _, s := range []string{m.InstanceType, m.Zone, m.Node, m.Host} {
		if s != "" {
			parts = append(parts, s)
		}
	}
	if m.Spot {
		parts = append(parts, "spot")
	}
	return cmp.Or(strings.Join(parts, " "), "-")
}

func imageText(m record.Machine) string {
	d := m.ImageDigest
	if len(d) > 19 {
		d = d[:19] // sha256: and 12 hex digits
	}
	switch {
	case m.Image != "" && d != "":
		return m.Image + "@" + d
	case m.Image != "":
		return m.Image
	}
	return "-"
}
