package harness

import (
	"encoding/json"
	"math"
	"os/exec"
	"strings"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/record"
)

// RecordJob is a job's script that prints its runner's record between
// markers, written so that the log's echo of the script holds neither.
const RecordJob = `echo "--""-record---"
cat "$RUNFLEET_RECORD"
echo "--""-end---"
`

// RecordIn reads the record a job printed with RecordJob; ok is false when
// the log holds none.
func RecordIn(log string) (r record.Record, ok bool, err error) {
	i := strings.LastIndex(log, "---record---")
	if i < 0 {
		return r, false, nil
	}
	body, _, found := strings.Cut(log[i+len("---record---"):], "---end---")
	if !found {
		return r, false, nil
	}
	// Each line of a forge's log may carry a timestamp before the text.
	var js strings.Builder
	for line := range strings.Lines(body) {
		if _, text, ok := strings.Cut(line, "Z "); ok && strings.HasPrefix(line, "20") {
			line = text
		}
		js.WriteString(line)
	}
	return r, true, json.Unmarshal([]byte(js.String()), &r)
}

// NeedRecordIn is RecordIn that fails the test without a record.
func NeedRecordIn(t testing.TB, log string) record.Record {
	t.Helper()
	r, ok, err := RecordIn(log)
	if !ok || err != nil {
		t.Fatalf("the job printed no record (%v):\n%s", err, log)
	}
	return r
}

// JobRecords runs `runfleet jobs --all --since "" -o json` (every record of
// the history) against the fleet's config.
func (f *Fleet) JobRecords() []record.Record {
	f.T.Helper()
	out := f.RunJobs("--all", "--since", "", "-o", "json")
	var rs []record.Record
	if err := json.Unmarshal([]byte(out), &rs); err != nil {
		f.T.Fatalf("runfleet jobs -o json: %v\n%s", err, out)
	}
	return rs
}

// RunJobs runs `runfleet jobs` with args.
func (f *Fleet) RunJobs(args ...string) string {
	f.T.Helper()
	cmd := exec.Command(FleetBin, append([]string{"jobs", "-c", f.Config}, args...)...)
	cmd.Env = f.env()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		f.T.Fatalf("runfleet jobs %v: %v\n%s%s", args, err, out, stderr.String())
	}
	return string(out)
}

// RecordOfRegistration finds the record of a runner's registration.
func RecordOfRegistration(rs []record.Record, reg int64) (record.Record, bool) {
	for _, r := range rs {
		if r.Registration == reg {
			return r, true
		}
	}
	return record.Record{}, false
}

// EndedRecords waits for the history to hold every job's runner, ended
// (what the manager learns of a runner reaches its history within a
// pass or two of the job's end, however quick the job), and returns each
// job's runner's record, by the job's id.
func (f *Fleet) EndedRecords(jobs []*sdk.ActionWorkflowJob) map[int64]record.Record {
	f.T.Helper()
	out := map[int64]record.Record{}
	Eventually(f.T, time.Minute, "the history to hold every job's runner, ended", func() bool {
		kept := f.JobRecords()
		for _, j := range jobs {
			r, ok := RecordOfRegistration(kept, j.RunnerID)
			if !ok || r.Ended.IsZero() {
				return false
			}
			out[j.ID] = r
		}
		return true
	})
	return out
}

// CheckRecords reads the record each job printed (with RecordJob) and the
// history's record of the job's runner, once that runner ended, and hands
// both to check. (The history names the job where the forge reported it
// with its runner: a webhook.)
func (f *Fleet) CheckRecords(jobs []*sdk.ActionWorkflowJob, check func(printed, kept record.Record)) {
	f.T.Helper()
	kept := f.EndedRecords(jobs)
	for _, j := range jobs {
		logs, _, err := f.Client().GetRepoActionJobLogs(Gitea.User, f.Repo, j.ID)
		if err != nil {
			f.T.Fatal(err)
		}
		printed := NeedRecordIn(f.T, string(logs))
		r := kept[j.ID]
		if printed.Runner != r.Runner || printed.Registration != r.Registration || printed.ID != r.ID {
			f.T.Errorf("job %d printed the record %q of %s (%d), the history gives it %q of %s (%d)", j.ID, printed.ID, printed.Runner, printed.Registration, r.ID, r.Runner, r.Registration)
		}
		// Where the job's code came from, as Gitea says.
		if k := r.Job; k != nil && (k.Commit != j.HeadSha || k.Ref != j.HeadBranch || k.Repository != Gitea.User+"/"+f.Repo) {
			f.T.Errorf("job %d's record says its code is %s@%s (%s), Gitea says %s/%s@%s (%s)", j.ID, k.Repository, k.Commit, k.Ref, Gitea.User, f.Repo, j.HeadSha, j.HeadBranch)
		}
		check(printed, r)
		if j == jobs[0] {
			f.T.Logf("job %d's record as it printed it: runner %s, machine %+v, GPUs %+v; the history's: machine %+v, GPUs %+v",
				j.ID, printed.Runner, printed.Machine, printed.GPUs, r.Machine, r.GPUs)
		}
	}
}

// RunTwoSizes pushes a workflow of two jobs for a dynamic pool named as
// the fleet's repository, one asking gpus=1 and one gpus=4, waits for both to pass,
// and checks that each job's record names the machine type it should
// have had: small for the first, big for the second.
func (f *Fleet) RunTwoSizes(small, big string, prices Prices) {
	f.T.Helper()
	f.Push("name: ci\non: [push]\njobs:\n" +
		"  one:\n    runs-on: [" + f.Repo + ", gpus=1]\n    steps:\n      - run: echo one\n" +
		"  four:\n    runs-on: [" + f.Repo + ", gpus=4]\n    steps:\n      - run: echo four\n")
	jobs := f.WaitJobs(2, 5*time.Minute)
	CheckJobs(f.T, jobs)
	recs := f.EndedRecords(jobs)
	want := map[string]string{"one": small, "four": big}
	for _, j := range jobs {
		r := recs[j.ID]
		if r.Machine.InstanceType != want[j.Name] {
			f.T.Errorf("job %s ran on %s, a %s; want a %s", j.Name, r.Machine.ID, r.Machine.InstanceType, want[j.Name])
		}
		f.T.Logf("job %s ran on %s, a %s", j.Name, r.Machine.ID, r.Machine.InstanceType)
	}
	if prices.ByType == nil {
		return
	}
	// The price comes from the cloud's price list in the background:
	// it may come after the runner ended.
	Eventually(f.T, time.Minute, "each job's record priced from the cloud's price list", func() bool {
		kept := f.JobRecords()
		for _, j := range jobs {
			if r, ok := RecordOfRegistration(kept, j.RunnerID); !ok || r.Price == nil {
				return false
			} else {
				recs[j.ID] = r
			}
		}
		return true
	})
	for _, j := range jobs {
		r := recs[j.ID]
		typ := r.Machine.InstanceType
		if p := r.Price; math.Abs(p.PerHour-prices.ByType[typ]) > 1e-9 || p.Currency != prices.Currency || p.Source != prices.Source {
			f.T.Errorf("job %s's record (a %s) is priced %+v; want %v %s from %q", j.Name, typ, *p, prices.ByType[typ], prices.Currency, prices.Source)
		}
		if c := r.Cost(r.Ended); c <= 0 {
			f.T.Errorf("job %s's record costs %v", j.Name, c)
		}
	}
}

// Prices are what a cloud's price list says its machines cost, for
// RunTwoSizes to check the records against; nil ByType checks nothing.
type Prices struct {
	ByType   map[string]float64
	Currency string
	Source   string
}
