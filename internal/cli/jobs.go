package cli

import (
	"cmp"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/record"
	"github.com/runfleet/runfleet/server"
	"github.com/runfleet/runfleet/tally"
)

func jobsCmd() *cobra.Command {
	var path, output, since, pool, by string
	var all bool
	var limit int
	var find finder
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "List recent jobs: where and on what they ran, how long they waited and ran, how they ended",
		Long: `jobs reads the manager's history of jobs (history.path, <state_dir>/history.db
by default): one record per runner, with the machine, image and digest, GPUs,
driver and CUDA versions it was given, and the forge's job it ran. While a
manager runs, jobs reads the file between the manager's writes; should the
file stay locked, it asks the manager through its status listener (with
status_token).

Each record carries its machine's price per hour where the pool names one
(price_per_hour, prices) and what it cost. --by sums the records by pool,
repository, label, forge, provider, machine type or result: runners, jobs, machine
hours, GPU-hours and cost. -o csv writes either for a spreadsheet.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" && output != "csv" {
				return &ExitError{ExitUsage, fmt.Errorf("-o: %q is not table, json or csv", output)}
			}
			if by != "" && !slices.Contains(tally.Keys, by) {
				return &ExitError{ExitUsage, fmt.Errorf("--by: %q is not one of %s", by, strings.Join(tally.Keys, ", "))}
			}
			q := history.Query{Pool: pool, All: all || by != "", Limit: limit}
			if find.any() {
				q.Limit = 0 // counted after the filter
			}
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
			if find.any() {
				recs = find.filter(recs, limit)
			}
			if by != "" {
				sums, err := tally.SumBy(recs, by, time.Now())
				if err != nil {
					return &ExitError{ExitUsage, err}
				}
				return writeSums(cmd.OutOrStdout(), output, by, sums)
			}
			switch output {
			case "json":
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(recs)
			case "csv":
				return jobsCSV(cmd.OutOrStdout(), recs, time.Now())
			}
			return jobsTable(cmd.OutOrStdout(), recs)
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "the manager's config file")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "table, json or csv")
	cmd.Flags().StringVar(&by, "by", "", "sum runners, jobs, hours, GPU-hours and cost by: "+strings.Join(tally.Keys, ", ")+" (runners without a job counted)")
	cmd.Flags().StringVar(&since, "since", "24h", `jobs of runners made since: a duration back from now, or a time (RFC 3339); "" for all`)
	cmd.Flags().StringVar(&pool, "pool", "", "only this pool's")
	cmd.Flags().BoolVar(&all, "all", false, "runners that took no job too")
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many, newest first (0: no limit)")
	cmd.Flags().StringVar(&find.id, "id", "", "the record with this id (RUNFLEET_RECORD_ID)")
	cmd.Flags().Int64Var(&find.job, "job", 0, "the records of the forge's job with this id")
	cmd.Flags().Int64Var(&find.run, "run", 0, "the records of this run's (pipeline's) jobs")
	cmd.Flags().StringVar(&find.commit, "commit", "", "the records of jobs of this commit (a prefix of its hash)")
	cmd.Flags().StringVar(&find.gpu, "gpu", "", "the records of runners given this GPU (its UUID or id)")
	cmd.Flags().StringVar(&find.result, "result", "", "the records of jobs that ended so: success, failure, cancelled, ...")
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
	var recs []record.Record
	if err := managerGet(ctx, cfg, "/jobs?"+v.Encode(), &recs); err != nil {
		return nil, err
	}
	return recs, nil
}

// managerGet reads JSON from the manager's status listener into v.
func managerGet(ctx context.Context, cfg *config.Config, path string, v any) error {
	host := cfg.StatusListen
	if strings.HasPrefix(host, ":") || strings.HasPrefix(host, "0.0.0.0:") || strings.HasPrefix(host, "[::]:") {
		host = "127.0.0.1:" + host[strings.LastIndex(host, ":")+1:]
	}
	what, _, _ := strings.Cut(path, "?")
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+host+path, nil)
	if err != nil {
		return err
	}
	if tok := cfg.StatusToken.Reveal(); tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(res.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", what, res.Status, strings.TrimSpace(string(b)))
	}
	if err := json.NewDecoder(res.Body).Decode(v); err != nil {
		return fmt.Errorf("GET %s: %w", what, err)
	}
	return nil
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

// jobsCSV writes one row per record, with what its machine held and cost.
func jobsCSV(w io.Writer, recs []record.Record, now time.Time) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"id", "created", "ended", "pool", "forge", "provider", "runner", "job_id", "job", "result", "waited_s", "ran_s", "machine", "spot", "gpus", "gpu_hours", "hours", "price_per_hour", "currency", "cost"})
	for _, r := range recs {
		jobID, job, result, waited, ran := "", "", "", "", ""
		if j := r.Job; j != nil {
			jobID, job, result = strconv.FormatInt(j.ID, 10), j.Name, cmp.Or(j.Conclusion, j.Status)
			if d := j.Waited(); d > 0 {
				waited = strconv.FormatFloat(d.Seconds(), 'f', 0, 64)
			}
			if d := j.Ran(); d > 0 {
				ran = strconv.FormatFloat(d.Seconds(), 'f', 0, 64)
			}
		}
		price, currency, cost := "", "", ""
		if p := r.Price; p != nil {
			price, currency, cost = money(p.PerHour), p.Currency, money(r.Cost(now))
		}
		ended := ""
		if !r.Ended.IsZero() {
			ended = r.Ended.UTC().Format(time.RFC3339)
		}
		_ = cw.Write([]string{r.ID, r.Created.UTC().Format(time.RFC3339), ended, r.Pool, r.Forge, r.Provider, r.Runner, jobID, job, result, waited, ran,
			cmp.Or(r.Machine.InstanceType, r.Machine.Node, r.Machine.Host), strconv.FormatBool(r.Machine.Spot), strings.Join(r.GPUUUIDs(), " "),
			hours(r.GPUSeconds(now) / 3600), hours(r.Held(now).Hours()), price, currency, cost})
	}
	cw.Flush()
	return cw.Error()
}

// writeSums writes the sums of --by as a table, JSON or CSV.
func writeSums(w io.Writer, output, by string, sums []tally.Sum) error {
	switch output {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(sums)
	case "csv":
		cw := csv.NewWriter(w)
		_ = cw.Write([]string{by, "runners", "jobs", "hours", "gpu_hours", "cost", "currency", "unpriced_runners"})
		for _, s := range sums {
			_ = cw.Write([]string{s.Key, strconv.Itoa(s.Runners), strconv.Itoa(s.Jobs), hours(s.Hours), hours(s.GPUHours), money(s.Cost), s.Currency, strconv.Itoa(s.Unpriced)})
		}
		cw.Flush()
		return cw.Error()
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "%s\tRUNNERS\tJOBS\tHOURS\tGPU-HOURS\tCOST\n", strings.ToUpper(by))
	for _, s := range sums {
		cost := "-"
		if s.Runners > s.Unpriced {
			cost = money(s.Cost) + " " + s.Currency
			if s.Unpriced > 0 {
				cost += fmt.Sprintf(" (%d runners unpriced)", s.Unpriced)
			}
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\n", s.Key, s.Runners, s.Jobs, hours(s.Hours), hours(s.GPUHours), cost)
	}
	return tw.Flush()
}

func hours(h float64) string { return strconv.FormatFloat(h, 'f', 4, 64) }

func money(v float64) string { return strconv.FormatFloat(v, 'f', 4, 64) }

// finder picks records by what a person remembers of a job: its record's
// id, the job, its run, its commit, a GPU it had, how it ended.
type finder struct {
	id, commit, gpu, result string
	job, run                int64
}

func (f finder) any() bool {
	return f.id != "" || f.commit != "" || f.gpu != "" || f.result != "" || f.job != 0 || f.run != 0
}

// filter keeps the records that match every criterion given, at most
// limit of them (0: all).
func (f finder) filter(recs []record.Record, limit int) []record.Record {
	out := []record.Record{}
	for _, r := range recs {
		j := r.Job
		if j == nil {
			j = &record.Job{}
		}
		switch {
		case f.id != "" && r.ID != f.id,
			f.job != 0 && j.ID != f.job,
			f.run != 0 && j.RunID != f.run,
			f.commit != "" && (j.Commit == "" || !strings.HasPrefix(j.Commit, f.commit)),
			f.result != "" && !strings.EqualFold(cmp.Or(j.Conclusion, j.Status), f.result),
			f.gpu != "" && !slices.ContainsFunc(r.GPUs, func(g record.GPU) bool { return g.UUID == f.gpu || g.ID == f.gpu }):
			continue
		}
		out = append(out, r)
		if limit > 0 && len(out) == limit {
			break
		}
	}
	return out
}
