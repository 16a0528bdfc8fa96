package github

import (
	"encoding/csv"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/record"
	"github.com/runfleet/runfleet/tally"
)

// pageJobs is how many jobs the burst runs: a few hundred, as a week of
// a small team's CI, quick enough for CI (about a job a second here).
const pageJobs = 240

// TestStatusPagePictures runs a burst of jobs through a GPU pool on the
// simulated GitHub, with host processes on a host whose four H100s are
// at work (nvidia-smi's report), and a price per hour. It loads the
// status page in headless Chromium: while the burst runs (a busy pool,
// its GPUs held, runners by state, the jobs' timeline), while GitHub
// answers 401 (the state in words), and after. The runners drawn by state
// are those the history's records give, minute by minute; `runfleet jobs
// --since 7d -o csv` gives each record's GPU-hours and cost, and `--by
// pool` their sums, matching the records. The screenshots are kept where
// RUNFLEET_SCREENSHOTS says (a directory), for a person to look at.
func TestStatusPagePictures(t *testing.T) {
	bin := harness.Chromium(t)
	const name = "ghpage"
	top, hooks, status := harness.Listeners(t)
	f := harness.NewGitHubFleet(t, name, harness.GitHubOptions{
		Size: 2, Max: 4,
		// Webhooks name the runner that took each job, for its record.
		Sim:   ghsim.Options{WebhookURL: hooks + "/webhook/gh", WebhookSecret: harness.HookSecret, Redeliver: true},
		Top:   top + "gpu:\n  nvidia_smi: " + harness.BusyNvidiaSMI(t) + "\n",
		Forge: "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 2s\n",
		Pool:  "    gpus_per_runner: 1\n    price_per_hour: 2.5\n    idle_timeout: 5s\n",
	})
	sim := f.GH
	shots := os.Getenv("RUNFLEET_SCREENSHOTS")
	if shots == "" {
		shots = t.TempDir()
	}
	// Chromium writes a screenshot into a directory that exists only.
	if err := os.MkdirAll(shots, 0o755); err != nil {
		t.Fatal(err)
	}
	shot := func(file string) {
		path := filepath.Join(shots, file)
		harness.Headless(t, bin, "--screenshot="+path, "--window-size=1280,1500", "--hide-scrollbars", status+"/")
		if st, err := os.Stat(path); err != nil || st.Size() < 20000 {
			t.Fatalf("screenshot %s: %v", path, err)
		}
		t.Logf("screenshot: %s", path)
	}
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitHub(sim) == 2 })

	// The burst, then eight jobs long enough to be seen at work.
	const long = 8
	specs := make([]ghsim.JobSpec, pageJobs)
	for i := range specs {
		specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("train (%d)", i+1), Labels: []string{"self-hosted", name}, Script: "echo step"}
		if i >= pageJobs-long {
			specs[i].Script = "sleep 10"
		}
	}
	sim.Queue("acme/"+name, specs[:pageJobs-long]...)
	harness.Eventually(t, 6*time.Minute, fmt.Sprintf("%d jobs done", pageJobs-long), func() bool { done, _ := harness.Completed(sim); return done == pageJobs-long })
	sim.Queue("acme/"+name, specs[pageJobs-long:]...)

	// A busy pool: runners at work, each on a GPU of its own, the GPUs'
	// use from nvidia-smi's report.
	var dom string
	harness.Eventually(t, time.Minute, "the page to show 4 busy runners, their GPUs and jobs", func() bool {
		dom = harness.Headless(t, bin, "--dump-dom", status+"/")
		return strings.Count(dom, `class="state busy"`) == 4 && strings.Count(dom, "87% · 40.3 GiB of 80 GiB") == 4 && strings.Count(dom, `class="job running"`) >= 3
	})
	for _, want := range []string{"runners, last hour", "queue wait (queued to started), by hour", "jobs: waiting, then running, by result", "cost today <b>", " USD</b>", "GPU-hours today"} {
		if !strings.Contains(dom, want) {
			t.Errorf("the busy page lacks %q", want)
		}
	}
	shot("busy-pool.png")
	harness.Eventually(t, 2*time.Minute, fmt.Sprintf("%d jobs done", pageJobs), func() bool { done, _ := harness.Completed(sim); return done == pageJobs })
	if _, ok := harness.Completed(sim); ok != pageJobs {
		t.Errorf("%d of %d jobs passed", ok, pageJobs)
	}

	// An outage: GitHub refuses the token, as it does a revoked one, to
	// every call. The page says so, in words, with what to do and when
	// runfleet tries again.
	sim.Fail("/repos/acme/"+name+"/actions/", 401, 1_000_000)
	harness.Eventually(t, time.Minute, "the page to say GitHub answers 401", func() bool {
		dom = harness.Headless(t, bin, "--dump-dom", status+"/")
		return strings.Contains(dom, "answered 401 since") && strings.Contains(dom, "Check the token") && strings.Contains(dom, "GitHub (forge gh), reading its queue")
	})
	if !strings.Contains(dom, "Next try") {
		t.Error("the page does not say when runfleet tries again")
	}
	shot("outage.png")
	sim.Heal()
	harness.Eventually(t, time.Minute, "the page to say nothing is wrong", func() bool {
		_, page := harness.Get(t, status+"/")
		return strings.Contains(page, "working: nothing is wrong") && !strings.Contains(page, "answered 401")
	})

	// The runners drawn by state, minute by minute, are the history's.
	var mismatch string
	harness.Eventually(t, 30*time.Second, "the hour's runners drawn as the history gives them", func() bool {
		_, page := harness.Get(t, status+"/")
		hour := harness.Charts(t, page, name)["runners, last hour"]
		if len(hour) != 1 {
			mismatch = "no hour chart"
			return false
		}
		var entries []tally.Entry
		for _, r := range f.JobRecords() {
			entries = append(entries, tally.EntryOf(r))
		}
		want := tally.StateSeries(entries, name, hour[0].From, time.Minute, 60, time.Now())
		mismatch = ""
		for i, w := range want {
			for s, n := range map[string]float64{"busy": w.Busy, "idle": w.Idle, "starting": w.Starting} {
				if got := hour[0].Series[s]; i >= len(got) || got[i] != strconv.FormatFloat(n, 'f', -1, 64) {
					mismatch = fmt.Sprintf("%s in the minute from %s: drawn %v, the history gives %v", s, w.At.Format("15:04:05"), got, n)
				}
			}
		}
		return mismatch == ""
	})
	if mismatch != "" {
		t.Error(mismatch)
	}
	shot("after.png")
	f.StopLeavesNothing()

	// Cost: each record's, and by pool, as the records give them.
	recs := f.JobRecords()
	// Host processes: each record keeps this host's system.
	for _, r := range recs {
		if s := r.System; s == nil || s.Kernel == "" || s.CPUs < 1 || s.MemoryMiB == 0 {
			t.Fatalf("record %s keeps no system of its host: %+v", r.ID, r.System)
		}
	}
	checkCostCSV(t, f.RunJobs("--since", "7d", "-o", "csv"), recs)
	checkPoolSums(t, f.RunJobs("--since", "7d", "--by", "pool", "-o", "csv"), recs, name)
	t.Logf("runfleet jobs --since 7d --by pool:\n%s", f.RunJobs("--since", "7d", "--by", "pool"))
}

// checkCostCSV holds each row of `runfleet jobs -o csv` to its record:
// the machine's hours, GPU-hours and cost at 2.5 USD an hour.
func checkCostCSV(t *testing.T, out string, recs []record.Record) {
	t.Helper()
	rows, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(rows) < 2 {
		t.Fatalf("runfleet jobs -o csv: %v\n%s", err, out)
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	byID := map[string]record.Record{}
	for _, r := range recs {
		byID[r.ID] = r
	}
	jobs := 0
	for _, row := range rows[1:] {
		r, ok := byID[row[col["id"]]]
		if !ok {
			t.Errorf("row %v names no record", row)
			continue
		}
		if r.Job != nil {
			jobs++
		}
		if r.Ended.IsZero() {
			t.Errorf("record %s has not ended after the drain", r.ID)
		}
		held := r.Ended.Sub(r.Created).Hours()
		for c, want := range map[string]float64{"hours": held, "gpu_hours": held * float64(len(r.GPUs)), "cost": 2.5 * held, "price_per_hour": 2.5} {
			if got, _ := strconv.ParseFloat(row[col[c]], 64); math.Abs(got-want) > 1e-4 {
				t.Errorf("record %s: %s %v, want %v", r.ID, c, got, want)
			}
		}
		if len(r.GPUs) != 1 || row[col["currency"]] != "USD" {
			t.Errorf("record %s: %d GPUs, currency %q: want 1 and USD", r.ID, len(r.GPUs), row[col["currency"]])
		}
	}
	if jobs < pageJobs {
		t.Errorf("the CSV has %d rows with a job, want the %d jobs'", jobs, pageJobs)
	}
}

// checkPoolSums holds `--by pool -o csv` to the records' sums.
func checkPoolSums(t *testing.T, out string, recs []record.Record, pool string) {
	t.Helper()
	rows, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(rows) != 2 || rows[1][0] != pool {
		t.Fatalf("runfleet jobs --by pool -o csv: %v\n%s", err, out)
	}
	var hours, cost float64
	for _, r := range recs {
		h := r.Ended.Sub(r.Created).Hours()
		hours += h
		cost += 2.5 * h
	}
	got := map[string]string{}
	for i, h := range rows[0] {
		got[h] = rows[1][i]
	}
	for c, want := range map[string]float64{"hours": hours, "gpu_hours": hours, "cost": cost, "runners": float64(len(recs))} {
		if v, _ := strconv.ParseFloat(got[c], 64); math.Abs(v-want) > 1e-3 {
			t.Errorf("by pool: %s %v, want %v from the records", c, v, want)
		}
	}
	t.Logf("by pool: %d runners, %s jobs, %.3f machine hours, %.3f GPU-hours, %.4f USD", len(recs), got["jobs"], hours, hours, cost)
}
