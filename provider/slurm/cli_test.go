package slurm

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// fakeBin writes squeue and scontrol scripts that log their arguments and
// print what the test gives them, for the CLI's choice of how to read.
func fakeBin(t *testing.T, squeueJSON, squeueFormat, scontrol string) (bin string, calls func() []string) {
	t.Helper()
	bin = t.TempDir()
	log := filepath.Join(bin, "calls")
	write := func(name, body string) {
		script := "#!/bin/sh\necho \"" + name + " $*\" >> " + log + "\n" + body
		if err := os.WriteFile(filepath.Join(bin, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, out := range map[string]string{"squeue.json": squeueJSON, "squeue.format": squeueFormat, "scontrol.out": scontrol} {
		if err := os.WriteFile(filepath.Join(bin, name), []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("squeue", `case "$*" in *--json*) cat `+bin+`/squeue.json;; *) cat `+bin+`/squeue.format;; esac`+"\n")
	write("scontrol", "cat "+bin+"/scontrol.out\n")
	return bin, func() []string {
		b, _ := os.ReadFile(log)
		return strings.Split(strings.TrimSpace(string(b)), "\n")
	}
}

// squeue --json filtered by user where Slurm honours the filter; where it
// does not (22.05: the whole cluster's jobs came back), squeue's format
// from then on, with the GPUs of a running job read once from scontrol.
func TestQueueReadsOnlyTheUsersJobs(t *testing.T) {
	ours := `{"jobs":[{"job_id":5,"name":"p-1","comment":"runfleet manager=m pool=p runner=p-1","user_name":"ci","job_state":"RUNNING"}],"errors":[]}`
	bin, calls := fakeBin(t, ours, "", "")
	c := &CLI{Bin: bin, User: "ci"}
	jobs, err := c.Queue(context.Background())
	if err != nil || len(jobs) != 1 || jobs[0].ID != "5" {
		t.Fatalf("filtered --json: %+v %v", jobs, err)
	}
	if got := calls(); len(got) != 1 || got[0] != "squeue --json --user=ci --states=all" {
		t.Errorf("calls %q", got)
	}

	everyone := `{"jobs":[{"job_id":5,"name":"p-1","user_name":"ci","job_state":"RUNNING"},{"job_id":6,"name":"x","user_name":"alice","job_state":"PENDING"}],"errors":[]}`
	row := func(f ...string) string { return strings.Join(f, fieldSep) + "\n" }
	format := row("5", "p-1", "runfleet manager=m pool=p runner=p-1", "ci", "RUNNING", "None", "gpu07", "2026-12-02T01:00:00", "2026-12-02T01:00:05", "gres:gpu:2") +
		row("7", "p-2", "runfleet manager=m pool=p runner=p-2", "ci", "PENDING", "Resources", "", "2026-12-02T01:00:01", "N/A", "gres:gpu:2")
	show := "JobId=5 JobName=p-1\n   JOB_GRES=gpu:2\n     Nodes=gpu07 CPU_IDs=0-1 Mem=100 GRES=gpu:2(IDX:0-1)\n   MinCPUsNode=1\n"
	bin, calls = fakeBin(t, everyone, format, show)
	c = &CLI{Bin: bin, User: "ci"}
	for range 2 {
		jobs, err = c.Queue(context.Background())
		if err != nil || len(jobs) != 2 || !slices.Equal(jobs[0].GPUs, []string{"gpu07:0", "gpu07:1"}) || jobs[1].Reason != "Resources" ||
			jobs[0].Start.Unix() != 1796173205 || !jobs[1].Start.IsZero() || jobs[0].Comment != "runfleet manager=m pool=p runner=p-1" {
			t.Fatalf("by format: %+v %v", jobs, err)
		}
	}
	want := []string{"squeue --json --user=ci --states=all", "squeue --noheader --user=ci --states=all --format=" + strings.Join(formatFields, fieldSep),
		"scontrol -d show job 5", "squeue --noheader --user=ci --states=all --format=" + strings.Join(formatFields, fieldSep)}
	if got := calls(); !slices.Equal(got, want) {
		t.Errorf("calls\n got %q\nwant %q", got, want)
	}
	if c.Calls() != 4 || c.Bytes() == 0 {
		t.Errorf("counted %d calls, %d bytes", c.Calls(), c.Bytes())
	}
}
