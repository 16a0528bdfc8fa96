package docker

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/record"
)

// recordJob prints what the engine set for the job and the runner's
// record.
const recordJob = `echo "visible=$NVIDIA_VISIBLE_DEVICES uuids=$RUNFLEET_GPU_UUIDS digest=$RUNFLEET_IMAGE_DIGEST"
echo "record at $RUNFLEET_RECORD record_id=$RUNFLEET_RECORD_ID"
` + harness.RecordJob

// TestJobReadsItsRecord: on the real Gitea with Docker and the GPU engine,
// a job reads its runner's record (the file RUNFLEET_RECORD names, and the
// variables beside it); the record's GPU UUID is the device the engine
// gave the container and its image digest the engine's; the manager keeps
// the record, with the forge's job, in its history: `runfleet jobs -o
// json` lists it while the manager runs (asking it) and after a restart
// and a stop (reading the file), and the status page links it.
func TestJobReadsItsRecord(t *testing.T) {
	eng := harness.NeedGPUEngine(t)
	img := eng.GiteaRunnerImage(t)
	data := t.TempDir()
	top, hooks, status := harness.Listeners(t)
	f := harness.NewFleet(t, "gpurec", harness.FleetOptions{
		Size: 1, Max: 2, Engine: eng,
		Top:   top + "gpu:\n  nvidia_smi: " + harness.FakeNvidiaSMI(t) + "\n",
		Forge: "    webhook_secret: " + harness.HookSecret + "\n",
		Docker: "      image: " + img + "\n      pull: never\n      network: host\n      memory: 512m\n      cpus: 1\n" +
			"      volumes: [\"" + data + ":/data\"]\n",
		Extra: "    gpus_per_runner: 1\n    hardware_labels: true\n",
	})
	f.Hooks = hooks
	f.AddWebhook()
	f.Start()
	harness.Eventually(t, time.Minute, "an idle runner", func() bool { return f.IdleOnline() >= 1 })
	f.Push(harness.Matrix("gpurec", 1, recordJob))
	jobs := f.WaitJobs(1, 3*time.Minute)
	if jobs[0].Conclusion != "success" {
		t.Fatalf("job %s", jobs[0].Conclusion)
	}
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, jobs[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	out := string(logs)
	visible := regexp.MustCompile(`visible=(GPU-\S+) uuids=(\S+) digest=(sha256:\S+)`).FindStringSubmatch(out)
	if visible == nil {
		t.Fatalf("the job printed no GPU or digest:\n%s", out)
	}
	rec := harness.NeedRecordIn(t, out)
	t.Logf("the job saw NVIDIA_VISIBLE_DEVICES=%s RUNFLEET_GPU_UUIDS=%s RUNFLEET_IMAGE_DIGEST=%s", visible[1], visible[2], visible[3])
	digest := eng.ImageID(t, img)
	switch {
	case len(rec.GPUs) != 1 || rec.GPUs[0].UUID != visible[1] || visible[2] != visible[1]:
		t.Errorf("record GPUs %+v, RUNFLEET_GPU_UUIDS %s; the engine gave the container %s", rec.GPUs, visible[2], visible[1])
	case !slices.Contains(harness.H100UUIDs, visible[1]):
		t.Errorf("the container got %s, not one of the host's GPUs", visible[1])
	}
	if rec.Machine.ImageDigest != digest || visible[3] != digest || rec.Machine.Image != img {
		t.Errorf("record image %s@%s, RUNFLEET_IMAGE_DIGEST %s; the engine's: %s@%s", rec.Machine.Image, rec.Machine.ImageDigest, visible[3], img, digest)
	}
	if rec.GPUs[0].Model != "NVIDIA H100 80GB HBM3" || rec.Driver == "" || rec.CUDA != "12.4" || rec.Machine.Memory != "512m" || rec.Machine.CPUs != "1" ||
		len(rec.Machine.Datasets) != 1 || !rec.Machine.Datasets[0].ReadOnly || rec.Machine.Host == "" ||
		rec.Pool != "gpurec" || rec.Provider != "docker" || rec.ForgeType != "gitea" || !slices.Contains(rec.Labels, "gpus-1") {
		t.Errorf("record lacks what the runner was given: %+v", rec)
	}
	// The engine's host, as the engine tells it.
	if s := rec.System; s == nil || !strings.HasPrefix(s.Runtime, "Docker Engine ") || s.Kernel == "" || s.OS == "" || s.CPUs < 1 || s.MemoryMiB == 0 {
		t.Errorf("the record's system: %+v", rec.System)
	} else {
		t.Logf("the job's record: %s on %s, kernel %s, %d CPUs, %d MiB, runtimes %v", s.Runtime, s.OS, s.Kernel, s.CPUs, s.MemoryMiB, s.Runtimes)
	}
	t.Logf("the job's record: runner %s, GPU %s (%s), driver %s, CUDA %s, image %s@%s, host %s, limits %s CPUs %s memory",
		rec.Runner, rec.GPUs[0].UUID, rec.GPUs[0].Model, rec.Driver, rec.CUDA, rec.Machine.Image, rec.Machine.ImageDigest, rec.Machine.Host, rec.Machine.CPUs, rec.Machine.Memory)

	// The manager's history, while it runs: asked through its status
	// listener.
	var kept record.Record
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("runfleet jobs --all -o json:\n%s", f.RunJobs("--all", "-o", "json"))
		}
	})
	harness.Eventually(t, time.Minute, "the history to hold the job, completed", func() bool {
		rs := jobsOf(t, f)
		if len(rs) != 1 || rs[0].Job == nil || rs[0].Job.Conclusion == "" || rs[0].Ended.IsZero() {
			return false
		}
		kept = rs[0]
		return true
	})
	checkKept(t, kept, rec, jobs[0].ID, visible[1], digest)
	// The job's record names itself, and where its code came from, as
	// Gitea says.
	if kept.System == nil || rec.System == nil || kept.System.Runtime != rec.System.Runtime {
		t.Errorf("the history's system %+v, the job's %+v", kept.System, rec.System)
	}
	if kept.ID != rec.ID || !strings.Contains(out, "record_id="+kept.ID) {
		t.Errorf("the job's record is %q (RUNFLEET_RECORD_ID in its log: %v), the history's %q", rec.ID, strings.Contains(out, "record_id="+kept.ID), kept.ID)
	}
	if j, g := kept.Job, jobs[0]; j.Commit != g.HeadSha || j.Ref != g.HeadBranch || j.Repository != harness.Gitea.User+"/"+f.Repo || j.Actor == "" {
		t.Errorf("the history's job's source: %s@%s (%s) by %q, Gitea's: %s@%s (%s)", j.Repository, j.Commit, j.Ref, j.Actor, f.Repo, g.HeadSha, g.HeadBranch)
	}
	if found := f.RunJobs("--since", "", "--commit", jobs[0].HeadSha[:7], "-o", "json"); !strings.Contains(found, kept.ID) {
		t.Errorf("runfleet jobs --commit %s does not find the record:\n%s", jobs[0].HeadSha[:7], found)
	}
	code, page := harness.Get(t, status+"/")
	if code != 200 || !strings.Contains(page, `href="jobs/`+kept.ID+`"`) {
		t.Errorf("the status page (%d) does not link the job's record %s", code, kept.ID)
	}
	code, one := harness.Get(t, status+"/jobs/"+kept.ID)
	if code != 200 || !strings.Contains(one, visible[1]) {
		t.Errorf("GET /jobs/%s: %d %s", kept.ID, code, one)
	}

	// Killed and restarted: the history is the file's.
	f.Kill9()
	f.Start()
	harness.Eventually(t, time.Minute, "an idle runner after the restart", func() bool { return f.IdleOnline() >= 1 })
	after := jobsOf(t, f)
	if len(after) != 1 {
		t.Fatalf("after a restart, runfleet jobs lists %d records, want 1", len(after))
	}
	checkKept(t, after[0], rec, jobs[0].ID, visible[1], digest)
	f.StopLeavesNothing()
	stopped := jobsOf(t, f)
	if len(stopped) != 1 || stopped[0].ID != kept.ID {
		t.Fatalf("with no manager running, runfleet jobs lists %+v", stopped)
	}
	table := f.RunJobs()
	t.Logf("runfleet jobs:\n%s", table)
	if !strings.Contains(table, visible[1]) || !strings.Contains(table, "success") {
		t.Errorf("the table lacks the job's GPU or result")
	}
	// No secret in the history.
	b, err := os.ReadFile(filepath.Join(f.State, "history.db"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), harness.Gitea.Token) {
		t.Error("the history holds the forge's token")
	}
}

func checkKept(t *testing.T, kept, rec record.Record, jobID int64, gpu, digest string) {
	t.Helper()
	if kept.Runner != rec.Runner || len(kept.GPUs) != 1 || kept.GPUs[0].UUID != gpu || kept.Machine.ImageDigest != digest ||
		kept.Machine.ID == "" || kept.JobStarted.IsZero() || kept.Ended.IsZero() {
		t.Errorf("the history's record differs from the job's: %+v", kept)
	}
	if j := kept.Job; j == nil || j.ID != jobID || j.Conclusion != "success" || j.URL == "" || j.RunID == 0 {
		t.Errorf("the history's job: %+v, want job %d, success, with its URL", kept.Job, jobID)
	} else {
		t.Logf("history: %s ran job %d (run %d, %s) on %s with %s, waited %s, ran %s, %s", kept.Runner, j.ID, j.RunID, j.URL,
			kept.Machine.Host, kept.GPUs[0].UUID, j.Waited().Round(time.Millisecond), j.Ran().Round(time.Millisecond), j.Conclusion)
	}
}

// jobsOf is `runfleet jobs -o json`: the records of the last 24 hours'
// runners that took a job.
func jobsOf(t *testing.T, f *harness.Fleet) []record.Record {
	t.Helper()
	var rs []record.Record
	if err := json.Unmarshal([]byte(f.RunJobs("-o", "json")), &rs); err != nil {
		t.Fatal(err)
	}
	return rs
}
