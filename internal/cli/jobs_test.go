package cli

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
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
