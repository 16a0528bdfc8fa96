package cli

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/record"
)

// jobsConfig writes a config whose history is path.
func jobsConfig(t testing.TB, path string) string {
	t.Helper()
	cfg := fmt.Sprintf(`history:
  path: %s
forges:
  - name: local
    type: gitea
    url: http://127.0.0.1:1
    token: t
    repo: a/b
pools:
  - name: gpu
    labels: [gpu]
`, path)
	p := filepath.Join(t.TempDir(), "fleet.yaml")
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// fillHistory writes n records over span before now, as a manager would.
func fillHistory(t testing.TB, path string, n int, now time.Time, span time.Duration) {
	t.Helper()
	s, err := history.Open(path, history.Options{})
	if err != nil {
		t.Fatal(err)
	}
	step := span / time.Duration(n)
	for i := range n {
		created := now.Add(-span + time.Duration(i)*step)
		r := record.Record{
			Runner: fmt.Sprintf("gpu-%d", i%64+1), Registration: int64(i + 1), Manager: "m", Forge: "local", ForgeType: "gitea",
			Pool: "gpu", Provider: "docker", Labels: []string{"gpu", "gpus-1"}, Created: created,
			Machine: record.Machine{Host: "gpu-host-1", Image: "ghcr.io/acme/runner:2.4", ImageDigest: "sha256:7d9a3cc0c1f0aa6c0e1b7a7b6c83c0e4c1a3f8f5d7d0e0d9b1a8c7e6f5d4c3b2"},
			GPUs:    []record.GPU{{ID: "GPU-0b1e2d3c-4a5b-6c7d-8e9f-a0b1c2d3e4f5", UUID: "GPU-0b1e2d3c-4a5b-6c7d-8e9f-a0b1c2d3e4f5", Model: "NVIDIA H100 80GB HBM3", MemoryMiB: 81559}},
			Driver:  "550.54.15", CUDA: "12.4",
			Online: created.Add(2 * time.Second), JobStarted: created.Add(20 * time.Second), Ended: created.Add(5 * time.Minute),
		}
		r.Job = &record.Job{ID: int64(i + 1), RunID: int64(i/4 + 1), Name: "train", URL: "https://forge.example/acme/models/actions/runs/1/jobs/0",
			Status: "completed", Conclusion: "success", Queued: created, Started: r.JobStarted, Completed: r.Ended}
		s.Add(r)
		if i%10_000 == 9_999 {
			s.Flush()
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestJobsReadsTheHistory(t *testing.T) {
	path := filepath.Join(t.TempDir(), "history.db")
	now := time.Now()
	fillHistory(t, path, 100, now, 100*time.Hour)
	cfg := jobsConfig(t, path)
	var out bytes.Buffer
	root := New()
	root.SetOut(&out)
	root.SetArgs([]string{"jobs", "-c", cfg, "--since", "10h", "-o", "json"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	var rs []record.Record
	if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
		t.Fatal(err)
	}
	if len(rs) != 9 || rs[0].Registration != 100 { // made 1h, 2h, ... 9h ago
		t.Fatalf("--since 10h: %d records, the first %d", len(rs), rs[0].Registration)
	}
	out.Reset()
	root = New()
	root.SetOut(&out)
	root.SetArgs([]string{"jobs", "-c", cfg, "--since", "yesterday"})
	if err := root.Execute(); err == nil {
		t.Fatal("--since yesterday was taken")
	}
}

// TestJobsCostCSV: -o csv gives each record's hours, GPU-hours and cost;
// --by pool sums them; a bad key or output is refused with what is taken.
func TestJobsCostCSV(t *testing.T) {
	path := filepath.Join(t.TempDir(), "history.db")
	now := time.Now()
	fillHistory(t, path, 12, now, 12*time.Hour) // each 5 minutes long, 1 GPU
	s, err := history.Open(path, history.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		s.Update("local", int64(i+1), func(r *record.Record) bool {
			r.Price = &record.Price{PerHour: 3, Currency: "USD", Source: "price_per_hour"}
			return true
		})
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	cfg := jobsConfig(t, path)
	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		root := New()
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetArgs(append([]string{"jobs", "-c", cfg}, args...))
		err := root.Execute()
		return out.String(), err
	}
	out, err := run("--since", "7d", "-o", "csv")
	if err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(rows) != 13 {
		t.Fatalf("%d rows (%v):\n%s", len(rows), err, out)
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	for _, r := range rows[1:] {
		// 5 minutes at 3 USD an hour: 0.25 USD, 1/12 GPU-hour.
		if r[col["cost"]] != "0.2500" || r[col["gpu_hours"]] != "0.0833" || r[col["currency"]] != "USD" || r[col["pool"]] != "gpu" {
			t.Errorf("row %v", r)
		}
	}
	out, err = run("--since", "7d", "--by", "pool", "-o", "csv")
	if err != nil || !strings.Contains(out, "gpu,12,12,1.0000,1.0000,3.0000,USD,0") {
		t.Errorf("--by pool (%v):\n%s", err, out)
	}
	out, err = run("--since", "1d", "--by", "pool")
	if err != nil || !strings.Contains(out, "3.0000 USD") {
		t.Errorf("--by pool as a table (%v):\n%s", err, out)
	}
	if _, err := run("--by", "colour"); err == nil || !strings.Contains(err.Error(), "pool, repository, label") {
		t.Errorf("--by colour: %v", err)
	}
	if _, err := run("-o", "xml"); err == nil || !strings.Contains(err.Error(), "table, json or csv") {
		t.Errorf("-o xml: %v", err)
	}
}

// TestJobsFindRecords: a record is found by its id, its job, run, commit,
// GPU and result.
func TestJobsFindRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), "history.db")
	fillHistory(t, path, 8, time.Now(), 8*time.Hour) // runs of 4 jobs
	s, err := history.Open(path, history.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s.Update("local", 3, func(r *record.Record) bool {
		r.Job.Commit, r.Job.Conclusion, r.GPUs[0].UUID = "9fceb02d0ae598e95dc970b74767f19372d61af8", "failure", "GPU-other"
		return true
	})
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	ro, _ := history.OpenReadOnly(path)
	third, err := ro.Find("local", 3)
	if err != nil {
		t.Fatal(err)
	}
	cfg := jobsConfig(t, path)
	for _, tc := range []struct {
		args []string
		regs []int64
	}{
		{[]string{"--id", third.ID}, []int64{3}},
		{[]string{"--job", "3"}, []int64{3}},
		{[]string{"--run", "2"}, []int64{8, 7, 6, 5}},
		{[]string{"--commit", "9fceb02"}, []int64{3}},
		{[]string{"--gpu", "GPU-other"}, []int64{3}},
		{[]string{"--result", "FAILURE"}, []int64{3}},
		{[]string{"--result", "success", "--run", "1", "--limit", "2"}, []int64{4, 2}},
		{[]string{"--commit", "deadbeef"}, nil},
	} {
		var out bytes.Buffer
		root := New()
		root.SetOut(&out)
		root.SetArgs(append([]string{"jobs", "-c", cfg, "--since", "", "-o", "json"}, tc.args...))
		if err := root.Execute(); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		var rs []record.Record
		if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
			t.Fatal(err)
		}
		var regs []int64
		for _, r := range rs {
			regs = append(regs, r.Registration)
		}
		if fmt.Sprint(regs) != fmt.Sprint(tc.regs) {
			t.Errorf("%v: registrations %v, want %v", tc.args, regs, tc.regs)
		}
	}
}

// BenchmarkJobsSince1h is `runfleet jobs --since 1h` over a history of
// 100,000 records spread over 30 days, from its config to its table, with
// no manager running (the file is read). It reports the file's size.
func BenchmarkJobsSince1h(b *testing.B) {
	path := filepath.Join(b.TempDir(), "history.db")
	fillHistory(b, path, 100_000, time.Now(), 30*24*time.Hour)
	cfg := jobsConfig(b, path)
	var out bytes.Buffer
	for b.Loop() {
		out.Reset()
		root := New()
		root.SetOut(&out)
		root.SetArgs([]string{"jobs", "-c", cfg, "--since", "1h"})
		if err := root.Execute(); err != nil {
			b.Fatal(err)
		}
	}
	fi, _ := os.Stat(path)
	b.ReportMetric(float64(bytes.Count(out.Bytes(), []byte("\n"))-1), "jobs-listed")
	b.ReportMetric(float64(fi.Size())/(1<<20), "MiB-on-disk")
}

func TestVersionJSON(t *testing.T) {
	var out bytes.Buffer
	root := New()
	root.SetOut(&out)
	root.SetArgs([]string{"version", "-o", "json"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	var v struct{ Version, Go string }
	if err := json.Unmarshal(out.Bytes(), &v); err != nil || v.Version == "" || v.Go == "" {
		t.Fatalf("runfleet version -o json: %v\n%s", err, out.String())
	}
}
