package slurm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/provider"
)

func TestParseQueueSlurm2205(t *testing.T) {
	b, err := os.ReadFile("testdata/squeue-22.05.json") // squeue --json of Debian's 22.05.8
	if err != nil {
		t.Fatal(err)
	}
	jobs, err := ParseQueue(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 3 {
		t.Fatalf("%d jobs, want 3", len(jobs))
	}
	got := fmt.Sprintln(jobs[0].State, jobs[0].GPUs, jobs[1].GPUs, jobs[2].State, jobs[2].Reason, jobs[2].GPUs)
	if got != "RUNNING [vm:0] [vm:1] PENDING Resources []\n" {
		t.Errorf("read %q", got)
	}
	m, pool, ok := owner(jobs[0].Comment)
	if !ok || m != "m" || pool != "p" || jobs[0].Name != "t-1" || jobs[0].Submit.IsZero() || jobs[0].Start.IsZero() {
		// A pending job's start_time is Slurm's estimate: not read as a start.
		t.Errorf("job 0: %+v (owner %q %q %v)", jobs[0], m, pool, ok)
	}
}

// One document per data_parser generation that squeue --json has
// printed, each of the shape its release gives the fields read here:
// the job_info parser of src/plugins/data_parser/<version>/parsers.c in
// SchedMD/slurm at each release's tag (job_state a string through
// v0.0.39 and a flag list from v0.0.40; submit_time and start_time plain
// numbers through v0.0.39 and TIMESTAMP_NO_VAL objects after; the other
// numbers objects from v0.0.39), and the meta and neighbouring fields as
// the captures of 21.08.5 and 23.02.4 in rivosinc/prometheus-slurm-exporter
// (fixtures/) show them. They are written from those sources, with this
// package's values, not copied captures; 22.05 above is a real one.
func TestParseQueueEachGeneration(t *testing.T) {
	for _, rel := range []string{"21.08", "23.02", "23.11", "24.05", "24.11", "25.05", "25.11"} {
		t.Run(rel, func(t *testing.T) {
			b, err := os.ReadFile("testdata/squeue-" + rel + ".json")
			if err != nil {
				t.Fatal(err)
			}
			jobs, err := ParseQueue(b)
			if err != nil {
				t.Fatal(err)
			}
			if len(jobs) != 3 {
				t.Fatalf("%d jobs, want 3", len(jobs))
			}
			run, pend, other := jobs[0], jobs[1], jobs[2]
			if run.ID != "9120" || run.State != "RUNNING" || !slices.Equal(run.GPUs, []string{"gpu07:0", "gpu07:2"}) ||
				run.Start.Unix() != 1764650030 || run.Submit.Unix() != 1764650000 || run.User != "ci" || run.Nodes != "gpu07" {
				t.Errorf("running job read as %+v", run)
			}
			if m, pool, ok := owner(run.Comment); !ok || m != "m" || pool != "gpu" || run.Name != "gpu-1" {
				t.Errorf("running job's owner read as %q %q %v", m, pool, ok)
			}
			if pend.ID != "9121" || pend.State != "PENDING" || pend.Reason != "Resources" || len(pend.GPUs) != 0 {
				t.Errorf("pending job read as %+v", pend)
			}
			if _, _, ok := owner(other.Comment); ok || other.State != "COMPLETED" || other.ID != "9050" {
				t.Errorf("another job (an array task) read as %+v", other)
			}
		})
	}
}

// Slurm 23.11 and later (OpenAPI v0.0.40+): states as lists of flags,
// times as objects, ids as numbers.
func TestParseQueueNewShapes(t *testing.T) {
	doc := `{"jobs":[{"job_id":41,"name":"p-1","comment":"runfleet manager=m pool=p runner=p-1","user_name":"ci",
	"job_state":["RUNNING","COMPLETING"],"state_reason":"None","nodes":"gpu07",
	"submit_time":{"set":true,"infinite":false,"number":1700000000},"start_time":{"set":true,"infinite":false,"number":1700000060},
	"gres_detail":["gpu:a100:3(IDX:0,2-3)"]},
	{"job_id":42,"name":"p-2","job_state":["PENDING"],"state_reason":"QOSMaxGRESPerUser","start_time":{"set":false,"infinite":false,"number":0}}],
	"errors":[],"warnings":[]}`
	jobs, err := ParseQueue([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if jobs[0].ID != "41" || jobs[0].State != "RUNNING" || !slices.Equal(jobs[0].GPUs, []string{"gpu07:0", "gpu07:2", "gpu07:3"}) ||
		jobs[0].Start.Unix() != 1700000060 || !jobs[1].Start.IsZero() || jobs[1].Reason != "QOSMaxGRESPerUser" {
		t.Errorf("read %+v", jobs)
	}
	if _, err := ParseQueue([]byte(`{"errors":[{"error":"Unable to contact slurm controller","description":"connect failure"}]}`)); err == nil ||
		!strings.Contains(err.Error(), "Unable to contact") {
		t.Errorf("an answer of errors only: %v", err)
	}
	// What squeue 22.05 prints, exiting 0, when slurmctld does not answer
	// within MessageTimeout.
	frozen := `{"meta":{"plugin":{"type":"openapi\/v0.0.38"}},"errors":[{"description":"Failed while looking for jobs","error_number":-1,"error":"Unspecified error","source":"slurm_load_jobs"}],"jobs":[]}`
	if _, err := ParseQueue([]byte(frozen)); err == nil || !strings.Contains(err.Error(), "Failed while looking for jobs") {
		t.Errorf("an empty list beside an error read as an empty queue: %v", err)
	}
	if _, err := ParseQueue([]byte(`{"meta":{}}`)); err == nil {
		t.Error("an answer without a job list read as an empty queue")
	}
	if _, err := ParseQueue([]byte(`squeue: error: Invalid user`)); err == nil {
		t.Error("a non-JSON answer read without error")
	}
}

func TestSectionErrorsNameTheirField(t *testing.T) {
	raw := []byte(`{"partition":"gpu part","memory":"12q","gpu_option":"tres","time_limit":"30s",
		"sbatch_options":["--time=5","--job-name=x","reservation=ml","-pdebug","--exclusive"],"spool_dir":"rel","gpu_type":"a100"}`)
	_, err := DecodeSection(raw, 0)
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"partition:", "memory:", "gpu_option:", "time_limit:", "sbatch_options[0]: --time", "sbatch_options[1]: --job-name",
		"sbatch_options[2]:", "sbatch_options[3]: -p", "spool_dir:", "gpu_type:"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "sbatch_options[4]") {
		t.Errorf("--exclusive refused: %v", err)
	}
	if _, err := DecodeSection(nil, -1); err == nil || !strings.Contains(err.Error(), "gpus_per_runner") {
		t.Errorf("gpus_per_runner all: %v", err)
	}
	if _, err := DecodeSection([]byte(`{"partition":"gpu","bogus":1}`), 1); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Errorf("unknown key: %v", err)
	}
}

func TestSubmitArgs(t *testing.T) {
	s, err := DecodeSection([]byte(`{"partition":"gpu","account":"ml","qos":"ci","cpus":4,"memory":"16G","gpu_type":"a100","constraint":"ib","sbatch_options":["--exclusive"]}`), 2)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(s.submitArgs(2, 130*time.Minute), " ")
	want := "--time=130 --partition=gpu --account=ml --qos=ci --cpus-per-task=4 --mem=16G --constraint=ib --gres=gpu:a100:2 --exclusive"
	if got != want {
		t.Errorf("args\n got %s\nwant %s", got, want)
	}
	s.GPUOption = "gpus"
	if got := strings.Join(s.submitArgs(1, 45*time.Second+time.Minute), " "); !strings.Contains(got, "--gpus=a100:1") || !strings.HasPrefix(got, "--time=2 ") {
		t.Errorf("args %s", got)
	}
}

// A runner's --time is its idle life and one job with its margin, within
// the partition's MaxTime, which shortens the idle life; a pool whose one
// job cannot fit is refused with both figures.
func TestFitTimes(t *testing.T) {
	none := Section{}
	for _, c := range []struct {
		name        string
		s           Section
		life, job   time.Duration
		part        Partition
		limit, idle time.Duration
		err         string
	}{
		{"a GitHub pool without MaxTime", none, 12 * time.Hour, 6 * time.Hour, Partition{}, 18*time.Hour + 10*time.Minute, 12 * time.Hour, ""},
		{"GitLab's hour", none, 2 * time.Hour, time.Hour, Partition{Name: "gpu", MaxTime: 24 * time.Hour}, 3*time.Hour + 6*time.Minute, 2 * time.Hour, ""},
		{"MaxTime shortens the idle life", none, 12 * time.Hour, 3 * time.Hour, Partition{Name: "gpu", MaxTime: 4 * time.Hour}, 4 * time.Hour, 50 * time.Minute, ""},
		{"a short job's margin is a minute", none, 90 * time.Second, time.Minute, Partition{}, 4 * time.Minute, 2 * time.Minute, ""},
		{"no job_timeout, no forge limit", none, time.Hour, 0, Partition{}, 7*time.Hour + 10*time.Minute, time.Hour, ""},
		{"a job over MaxTime", none, 12 * time.Hour, 3 * time.Hour, Partition{Name: "short", MaxTime: 30 * time.Minute}, 0, 0,
			"needs --time of at least 3h11m0s (1m0s to wait, a job of 3h0m0s and 10m0s to end in), over partition short's MaxTime 30m0s"},
		{"time_limit over MaxTime", Section{TimeLimit: config.D(5 * time.Hour)}, 0, time.Hour, Partition{Name: "gpu", MaxTime: 4 * time.Hour}, 0, 0,
			"slurm.time_limit: 5h0m0s is over partition gpu's MaxTime 4h0m0s"},
		{"time_limit too short for a job", Section{TimeLimit: config.D(time.Hour)}, 0, time.Hour, Partition{}, 0, 0,
			"at least 1h7m0s"},
		{"time_limit given", Section{TimeLimit: config.D(2 * time.Hour)}, 12 * time.Hour, time.Hour, Partition{}, 2 * time.Hour, 54 * time.Minute, ""},
	} {
		got, err := fit(c.s, c.life, c.job, boundOf(c.part, QOS{}, QOS{}))
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s: %v, want %q", c.name, err, c.err)
		case c.err == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.err == "" && (got.limit != c.limit || got.idle != c.idle):
			t.Errorf("%s: --time %s, idle %s; want %s, %s", c.name, got.limit, got.idle, c.limit, c.idle)
		}
	}
}

// What `scontrol show partition -o` prints (Debian's 22.05.8), and the
// time formats of Slurm's secs2time_str.
func TestParsePartition(t *testing.T) {
	out := "PartitionName=gpu AllowGroups=ALL Default=YES QoS=N/A DefaultTime=NONE GraceTime=0 MaxTime=04:00:00 PreemptMode=OFF State=UP\n" +
		"PartitionName=scavenger AllowGroups=ALL Default=NO QoS=scav GraceTime=30 MaxTime=1-12:00:00 PreemptMode=CANCEL State=UP\n" +
		"PartitionName=any Default=NO MaxTime=UNLIMITED State=UP\n"
	for name, want := range map[string]Partition{
		"":          {Name: "gpu", MaxTime: 4 * time.Hour},
		"scavenger": {Name: "scavenger", MaxTime: 36 * time.Hour, GraceTime: 30 * time.Second, QOS: "scav"},
		"any":       {Name: "any"},
	} {
		got, err := parsePartition([]byte(out), name)
		if err != nil || got != want {
			t.Errorf("partition %q: %+v %v, want %+v", name, got, err, want)
		}
	}
	for v, want := range map[string]time.Duration{"30:00": 30 * time.Minute, "2-00:00:00": 48 * time.Hour, "00:01:30": 90 * time.Second, "45": 45 * time.Minute} {
		if got, err := slurmDuration(v); err != nil || got != want {
			t.Errorf("%s: %s %v, want %s", v, got, err, want)
		}
	}
	if _, err := slurmDuration("1:x"); err == nil {
		t.Error("1:x read as a time")
	}
	if _, err := parsePartition([]byte("PartitionName=a Default=NO MaxTime=UNLIMITED\n"), ""); !errors.Is(err, provider.ErrRejected) {
		t.Errorf("no default partition: %v", err)
	}
}

// The bound of a job's --time: the partition's MaxTime and the MaxWall
// of the partition's QOS, which stands over the job QOS's unless that one
// is OverPartQOS and sets one; a job QOS with PartitionTimeLimit may pass
// the partition's MaxTime (resource_limits.html; sacctmgr(1), QOS flags).
func TestBoundOf(t *testing.T) {
	gpu := Partition{Name: "gpu", MaxTime: 4 * time.Hour}
	ci := QOS{Name: "ci", MaxWall: 2 * time.Hour}
	long := QOS{Name: "long", MaxWall: 8 * time.Hour}
	for _, c := range []struct {
		name            string
		part            Partition
		partQOS, jobQOS QOS
		want            bound
	}{
		{"none", Partition{}, QOS{}, QOS{}, bound{}},
		{"the partition's MaxTime", gpu, QOS{}, QOS{Name: "normal"}, bound{4 * time.Hour, "partition gpu's MaxTime"}},
		{"a shorter QOS MaxWall", gpu, QOS{}, ci, bound{2 * time.Hour, "QOS ci's MaxWall"}},
		{"a longer QOS MaxWall", gpu, QOS{}, long, bound{4 * time.Hour, "partition gpu's MaxTime"}},
		{"the default partition", Partition{MaxTime: time.Hour}, QOS{}, QOS{}, bound{time.Hour, "the default partition's MaxTime"}},
		{"the partition QOS stands over the job's", gpu, ci, QOS{Name: "x", MaxWall: time.Hour}, bound{2 * time.Hour, "QOS ci's MaxWall"}},
		{"the job's QOS, OverPartQOS", gpu, ci, QOS{Name: "x", MaxWall: time.Hour, OverPartQOS: true}, bound{time.Hour, "QOS x's MaxWall"}},
		{"OverPartQOS without a MaxWall", gpu, ci, QOS{Name: "x", OverPartQOS: true}, bound{2 * time.Hour, "QOS ci's MaxWall"}},
		{"PartitionTimeLimit", gpu, QOS{}, QOS{Name: "x", MaxWall: 8 * time.Hour, PartitionTimeLimit: true}, bound{8 * time.Hour, "QOS x's MaxWall"}},
		{"PartitionTimeLimit without a MaxWall", gpu, QOS{}, QOS{Name: "x", PartitionTimeLimit: true}, bound{}},
	} {
		if got := boundOf(c.part, c.partQOS, c.jobQOS); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
	if _, err := fit(Section{}, 12*time.Hour, 3*time.Hour, boundOf(gpu, QOS{}, ci)); err == nil ||
		!strings.Contains(err.Error(), "needs --time of at least 3h11m0s") || !strings.Contains(err.Error(), "over QOS ci's MaxWall 2h0m0s") {
		t.Errorf("a job over the QOS's MaxWall: %v", err)
	}
}

// What `sacctmgr -n -P show qos name=x format=Name,MaxWall,Flags` prints
// (Debian's 22.05.8; MaxWall as mins2time_str writes it, empty for none);
// a QOS sacctmgr does not know prints no line.
func TestParseQOS(t *testing.T) {
	for out, want := range map[string]QOS{
		"ci|02:00:00|\n": {Name: "ci", MaxWall: 2 * time.Hour},
		"long|2-00:00:00|DenyOnLimit,OverPartQOS\n": {Name: "long", MaxWall: 48 * time.Hour, OverPartQOS: true},
		"normal||PartitionTimeLimit\n":              {Name: "normal", PartitionTimeLimit: true},
	} {
		got, err := parseQOS([]byte(out), want.Name)
		if err != nil || got != want {
			t.Errorf("%q: %+v %v, want %+v", out, got, err, want)
		}
	}
	if _, err := parseQOS(nil, "nope"); !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "no QOS nope") {
		t.Errorf("an unknown QOS: %v", err)
	}
	if _, err := parseQOS([]byte("ci|soon|\n"), "ci"); err == nil {
		t.Error("MaxWall soon read as a time")
	}
}

// fakeCluster is Slurm's queue in memory, for what the real one (in the
// end-to-end tests) cannot be made to do on cue.
type fakeCluster struct {
	mu     sync.Mutex
	jobs   []Job
	next   int
	calls  []string
	submit error
}

func (f *fakeCluster) Submit(_ context.Context, script []byte, args []string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "sbatch "+strings.Join(args, " ")+"\n"+string(script))
	if f.submit != nil {
		return "", f.submit
	}
	f.next++
	j := Job{ID: fmt.Sprint(f.next), State: "PENDING", Reason: "Priority", Submit: time.Now()}
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--job-name="); ok {
			j.Name = v
		}
		if v, ok := strings.CutPrefix(a, "--comment="); ok {
			j.Comment = v
		}
	}
	f.jobs = append(f.jobs, j)
	return j.ID, nil
}

func (f *fakeCluster) Queue(context.Context) ([]Job, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "squeue")
	return slices.Clone(f.jobs), nil
}

func (f *fakeCluster) Cancel(_ context.Context, ids []string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "scancel "+strings.Join(ids, " "))
	for i := range f.jobs {
		if slices.Contains(ids, f.jobs[i].ID) && !finished(f.jobs[i].State) {
			f.jobs[i].State = "CANCELLED"
		}
	}
	return nil
}

func (f *fakeCluster) set(id, state string, gpus ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.jobs {
		if f.jobs[i].ID == id {
			f.jobs[i].State, f.jobs[i].GPUs, f.jobs[i].Start = state, gpus, time.Now()
		}
	}
}

func newTest(t *testing.T, fc *fakeCluster, sec string) *Provider {
	t.Helper()
	s, err := DecodeSection([]byte(sec), 1)
	if err != nil {
		t.Fatal(err)
	}
	s.PollInterval = config.D(time.Nanosecond) // every read a new one
	p, err := New(Options{Manager: "m", Pool: "p", Section: s, Spool: t.TempDir(), Workdir: "/scratch/w", GPUs: 1, Cluster: fc})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestCreateKeepsTheCredentialOutOfSlurm(t *testing.T) {
	fc := &fakeCluster{}
	p := newTest(t, fc, `{"partition":"gpu","queue_wait":true}`)
	const secret = "registration-token-XYZ"
	spec := provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "/opt/act_runner", Args: []string{"daemon", "--once"},
		Env: map[string]string{"PATH": "/usr/bin", "RUNNER_TOKEN": secret}, Files: map[string][]byte{".runner": []byte(`{"token":"` + secret + `"}`)}}
	in, err := p.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if in.ID != "1" || in.State != provider.StateCreated || !in.Queued {
		t.Errorf("created %+v", in)
	}
	if strings.Contains(strings.Join(fc.calls, "\n"), secret) {
		t.Errorf("the credential reached sbatch:\n%s", fc.calls)
	}
	for _, want := range []string{"--gres=gpu:1", "--export=NONE", "--no-requeue", "--job-name=p-1", "--comment=runfleet manager=m pool=p runner=p-1"} {
		if !strings.Contains(fc.calls[len(fc.calls)-1], want) {
			t.Errorf("sbatch lacks %s: %s", want, fc.calls[len(fc.calls)-1])
		}
	}
	dir := filepath.Join(p.filesDir(), "p-1")
	for _, f := range []string{dir, filepath.Join(dir, "env"), filepath.Join(dir, "files", ".runner")} {
		st, err := os.Stat(f)
		if err != nil || st.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s: %v, mode %v: readable by others", f, err, st.Mode())
		}
	}
	// Created again: the same job.
	if again, err := p.Create(context.Background(), spec); err != nil || again.ID != "1" {
		t.Errorf("second create: %+v %v", again, err)
	}
	// Pending past any bootstrap timeout, with Slurm's reason.
	list, _ := p.List(context.Background(), "m")
	if len(list) != 1 || list[0].State != provider.StateCreated || list[0].Reason != "pending: Priority" || !list[0].Queued {
		t.Errorf("listed %+v", list)
	}
	fc.set("1", "RUNNING", "n1:1")
	list, _ = p.List(context.Background(), "m")
	if list[0].State != provider.StateRunning || !slices.Equal(list[0].GPUs, []string{"n1:1"}) || list[0].Started.IsZero() {
		t.Errorf("running: %+v", list)
	}
	if err := p.Delete(context.Background(), "p-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("files left after delete: %v", err)
	}
	if list, _ := p.List(context.Background(), "m"); len(list) != 0 {
		t.Errorf("listed after delete: %+v", list)
	}
}

func TestRefusedSubmitIsRejected(t *testing.T) {
	fc := &fakeCluster{submit: &CommandError{Command: "sbatch", Message: "sbatch: error: Batch job submission failed: Invalid partition name specified", Err: errors.New("exit status 1")}}
	p := newTest(t, fc, `{}`)
	_, err := p.Create(context.Background(), provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "x"})
	if !errors.Is(err, provider.ErrRejected) {
		t.Errorf("err %v, want a rejection", err)
	}
	fc.submit = &CommandError{Command: "sbatch", Message: "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)", Err: errors.New("exit status 1")}
	_, err = p.Create(context.Background(), provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "x"})
	if err == nil || errors.Is(err, provider.ErrRejected) {
		t.Errorf("err %v, want one worth retrying", err)
	}
	if entries, _ := os.ReadDir(p.recordDir()); len(entries) != 0 {
		t.Errorf("a failed submit left records: %v", entries)
	}
}

// A manager killed between sbatch and its record's update finds the job
// by name; a job whose record is gone is listed for removal.
func TestAdoptsByNameAndComment(t *testing.T) {
	fc := &fakeCluster{}
	p := newTest(t, fc, `{}`)
	if err := p.writeRecord(record{Name: "p-2", Manager: "m", Pool: "p", Created: time.Now()}); err != nil {
		t.Fatal(err)
	}
	fc.jobs = []Job{
		{ID: "7", Name: "p-2", Comment: comment("m", "p", "p-2"), State: "RUNNING"},
		{ID: "8", Name: "p-3", Comment: comment("m", "p", "p-3"), State: "PENDING"},
		{ID: "9", Name: "p-3", Comment: comment("other", "p", "p-3"), State: "RUNNING"},
		{ID: "10", Name: "p-4", Comment: comment("m", "p", "p-4"), State: "COMPLETED"},
	}
	list, err := p.List(context.Background(), "m")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, in := range list {
		got = append(got, in.Name+"="+in.ID+"/"+string(in.State))
	}
	slices.Sort(got)
	if strings.Join(got, " ") != "p-2=7/running p-3=8/created" {
		t.Errorf("listed %v", got)
	}
	if rec, _ := p.readRecord("p-2"); rec.JobID != "7" {
		t.Errorf("record not updated: %+v", rec)
	}
}

func TestNoticeForPreemptedJob(t *testing.T) {
	fc := &fakeCluster{}
	p := newTest(t, fc, `{}`)
	var notices []provider.Notice
	var mu sync.Mutex
	p.poller.WatchPreemption(t.Context(), func(n provider.Notice) { mu.Lock(); notices = append(notices, n); mu.Unlock() })
	defer p.Close()
	for _, n := range []string{"p-1", "p-2"} {
		if _, err := p.Create(context.Background(), provider.Spec{Name: n, Manager: "m", Pool: "p", Command: "x"}); err != nil {
			t.Fatal(err)
		}
	}
	fc.set("1", "RUNNING")
	fc.set("2", "RUNNING")
	_ = p.poll(context.Background())
	fc.set("1", "COMPLETING") // as Slurm shows a cancelled or preempted job while its processes end
	if list, _ := p.List(context.Background(), "m"); len(list) != 2 || list[0].State != provider.StateRunning && list[1].State != provider.StateRunning {
		t.Errorf("a completing job is not running: %+v", list)
	}
	fc.set("1", "PREEMPTED")
	if err := p.Delete(context.Background(), "p-2"); err != nil { // cancelled by the manager: no notice
		t.Fatal(err)
	}
	_ = p.poll(context.Background())
	// The poller's own goroutine may be the one handing the notice on.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		n := len(notices)
		mu.Unlock()
		if n > 0 {
			break
		}
	}
	time.Sleep(50 * time.Millisecond) // a second notice, were there one
	mu.Lock()
	defer mu.Unlock()
	if len(notices) != 1 || notices[0].Name != "p-1" || notices[0].ID != "1" || !strings.Contains(notices[0].Reason, "PREEMPTED") {
		t.Errorf("notices %+v", notices)
	}
}
