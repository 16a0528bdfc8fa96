package slurm

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/provider"
)

// partitions is a fakeCluster that also answers `scontrol show
// partition` as parsePartition reads it: unknown names are refused, as
// scontrol refuses them ("Partition x not found").
type partitions struct {
	*fakeCluster
	parts map[string]Partition
	reads int
}

func (c *partitions) Partition(_ context.Context, name string) (Partition, error) {
	c.reads++
	if name == "" {
		name = "gpu"
	}
	p, ok := c.parts[name]
	if !ok {
		return Partition{}, fmt.Errorf("partition %s: Partition %s not found: %w", name, name, provider.ErrRejected)
	}
	return p, nil
}

func shapeTest(t *testing.T) (*Provider, *partitions) {
	t.Helper()
	pc := &partitions{fakeCluster: &fakeCluster{}, parts: map[string]Partition{
		"gpu": {Name: "gpu", MaxTime: 4 * time.Hour}, "short": {Name: "short", MaxTime: 30 * time.Minute}}}
	s, err := DecodeSection([]byte(`{"partition":"gpu","constraint":"ib"}`), 1)
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{Manager: "m", Pool: "p", Section: s, Spool: t.TempDir(), Workdir: "/scratch/w", GPUs: 1,
		Cluster: pc, MaxLifetime: 12 * time.Hour, JobTimeout: time.Hour, IdleTimeout: 5 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return p, pc
}

// A job that chose its partition, node feature and time gets them in its
// runner's sbatch, with a --time for its own length (and the pool's
// idle_timeout to wait for it) within that partition's MaxTime.
func TestShapeChoosesPartitionAndTime(t *testing.T) {
	p, pc := shapeTest(t)
	spec := provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "/bin/true",
		Request: dynamic.Request{Partition: "short", Constraint: "a100", Time: 20 * time.Minute}}
	if _, err := p.Create(context.Background(), spec); err != nil {
		t.Fatal(err)
	}
	call := pc.calls[len(pc.calls)-1]
	// 5m idle + 20m + its 2m margin, rounded up to the minute.
	for _, want := range []string{"--partition=short", "--constraint=a100", "--time=27 ", "--signal=B:USR1@60"} {
		if !strings.Contains(call, want) {
			t.Errorf("sbatch lacks %s: %s", want, strings.SplitN(call, "\n", 2)[0])
		}
	}
	// The pool's own runners are as before: the pool's partition and fit.
	if _, err := p.Create(context.Background(), provider.Spec{Name: "p-2", Manager: "m", Pool: "p", Command: "/bin/true"}); err != nil {
		t.Fatal(err)
	}
	if call := pc.calls[len(pc.calls)-1]; !strings.Contains(call, "--partition=gpu") || !strings.Contains(call, "--time=240 ") || !strings.Contains(call, "--constraint=ib") {
		t.Errorf("pool's runner: %s", strings.SplitN(call, "\n", 2)[0])
	}
	reads := pc.reads
	if _, err := p.Create(context.Background(), provider.Spec{Name: "p-3", Manager: "m", Pool: "p", Command: "/bin/true",
		Request: dynamic.Request{Partition: "short", Time: 10 * time.Minute}}); err != nil {
		t.Fatal(err)
	}
	if pc.reads != reads {
		t.Errorf("the partition read again for each runner: %d reads, then %d", reads, pc.reads)
	}
}

// A chosen partition whose MaxTime the job's time (or, unsaid, the pool's
// job_timeout) does not fit starts nothing, and says so with both figures.
func TestShapeThatCannotFitIsRefused(t *testing.T) {
	p, pc := shapeTest(t)
	_, err := p.Create(context.Background(), provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "/bin/true",
		Request: dynamic.Request{Partition: "short"}})
	if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "1h0m0s") || !strings.Contains(err.Error(), "partition short's MaxTime 30m0s") {
		t.Errorf("a job of job_timeout 1h in a 30m partition: %v", err)
	}
	for _, c := range pc.calls {
		if strings.HasPrefix(c, "sbatch") {
			t.Errorf("submitted: %s", strings.SplitN(c, "\n", 2)[0])
		}
	}
}

// At start: a dynamic section naming a partition the cluster lacks, or
// letting a job ask for more time than a partition takes, is refused.
func TestCheckShapes(t *testing.T) {
	p, _ := shapeTest(t)
	lim := func(raw string) dynamic.Limits {
		l, err := dynamic.Decode([]byte(raw))
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	if err := p.CheckShapes(context.Background(), lim(`{"partition":["gpu","short"],"time":"20m"}`)); err != nil {
		t.Errorf("a section that fits: %v", err)
	}
	for raw, want := range map[string]string{
		`{"partition":["gpu","debug"],"time":"20m"}`: "dynamic.partition: partition debug: Partition debug not found",
		`{"partition":["gpu","short"],"time":"2h"}`:  "partition short's MaxTime 30m0s",
		`{"partition":["short"]}`:                    "a job of 1h0m0s", // job_timeout, when time is not the job's to say
		`{"time":"5h"}`:                              "dynamic.time: ",
	} {
		if err := p.CheckShapes(context.Background(), lim(raw)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("CheckShapes(%s) = %v, want %q", raw, err, want)
		}
	}
}

// qoses is a partitions cluster that also answers `sacctmgr show qos` as
// parseQOS reads it: an unknown QOS is refused (no line), and err stands
// for slurmdbd not answering.
type qoses struct {
	*partitions
	qos   map[string]QOS
	err   error
	reads []string
}

func (c *qoses) QOS(_ context.Context, name string) (QOS, error) {
	c.reads = append(c.reads, name)
	if c.err != nil {
		return QOS{}, c.err
	}
	q, ok := c.qos[name]
	if !ok {
		return QOS{}, fmt.Errorf("sacctmgr show qos: no QOS %s: %w", name, provider.ErrRejected)
	}
	return q, nil
}

func qosTest(t *testing.T, section string, c *qoses) (*Provider, error) {
	t.Helper()
	s, err := DecodeSection([]byte(section), 1)
	if err != nil {
		t.Fatal(err)
	}
	return New(Options{Manager: "m", Pool: "p", Section: s, Spool: t.TempDir(), Workdir: "/scratch/w", GPUs: 1,
		Cluster: c, MaxLifetime: 12 * time.Hour, JobTimeout: time.Hour, IdleTimeout: 5 * time.Minute})
}

// The pool's QOS's MaxWall bounds its runners' --time as the partition's
// MaxTime does, and so does the partition's own QOS; a QOS the cluster
// lacks is refused at start, naming the field; where slurmdbd does not
// answer, the partition's bound stands and sbatch will say.
func TestQOSBoundsTheRunnersTime(t *testing.T) {
	cluster := func() *qoses {
		return &qoses{partitions: &partitions{fakeCluster: &fakeCluster{}, parts: map[string]Partition{
			"gpu": {Name: "gpu", MaxTime: 4 * time.Hour}, "debug": {Name: "debug", MaxTime: 4 * time.Hour, QOS: "debugq"}}},
			qos: map[string]QOS{"ci": {Name: "ci", MaxWall: 2 * time.Hour}, "debugq": {Name: "debugq", MaxWall: 90 * time.Minute}, "normal": {Name: "normal"}}}
	}
	for section, want := range map[string]time.Duration{
		`{"partition":"gpu","qos":"ci"}`:     2 * time.Hour,
		`{"partition":"gpu","qos":"normal"}`: 4 * time.Hour,
		`{"partition":"gpu"}`:                4 * time.Hour,
		`{"partition":"debug","qos":"ci"}`:   90 * time.Minute, // the partition QOS stands over the job's
	} {
		c := cluster()
		p, err := qosTest(t, section, c)
		if err != nil {
			t.Errorf("%s: %v", section, err)
			continue
		}
		if p.times.limit != want {
			t.Errorf("%s: --time %s, want %s (QOS read: %v)", section, p.times.limit, want, c.reads)
		}
		if section == `{"partition":"gpu"}` && len(c.reads) != 0 {
			t.Errorf("%s: sacctmgr asked about %v, with no QOS to read", section, c.reads)
		}
	}
	if _, err := qosTest(t, `{"partition":"gpu","qos":"nope"}`, cluster()); err == nil || !strings.Contains(err.Error(), "slurm.qos: sacctmgr show qos: no QOS nope") {
		t.Errorf("an unknown QOS: %v", err)
	}
	c := cluster()
	c.err = errors.New("sacctmgr: error: Problem talking to the database: Connection refused")
	if p, err := qosTest(t, `{"partition":"gpu","qos":"ci"}`, c); err != nil {
		t.Errorf("slurmdbd down: %v", err)
	} else if p.times.limit != 4*time.Hour {
		t.Errorf("slurmdbd down: --time %s, want the partition's 4h", p.times.limit)
	}
	// A job's own partition is bounded by that partition's QOS too.
	p, err := qosTest(t, `{"partition":"gpu","qos":"ci"}`, cluster())
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Create(context.Background(), provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "/bin/true",
		Request: dynamic.Request{Partition: "debug", Time: 2 * time.Hour}})
	if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "QOS debugq's MaxWall 1h30m0s") {
		t.Errorf("a 2h job in partition debug (QOS MaxWall 1h30m): %v", err)
	}
}
