package record

import (
	"encoding/json"
	"testing"
	"time"
)

func TestWithFilesAddsTheRecordAndLeavesTheInputs(t *testing.T) {
	r := Record{Runner: "gpu-1", Pool: "gpu", Provider: "docker", ManagerVersion: "v1.2.0", CUDA: "12.4",
		GPUs:    []GPU{{ID: "GPU-a", UUID: "GPU-a"}, {ID: "0:1", MIGProfile: "1g.10gb"}},
		Machine: Machine{Image: "runner:1", ImageDigest: "sha256:abc"}, Created: time.Unix(1, 0).UTC()}
	files := map[string][]byte{".runner": []byte("secret")}
	env := map[string]string{"PATH": "/bin"}
	f2, e2 := r.WithFiles(files, env, "/work/")
	if len(files) != 1 || len(env) != 1 {
		t.Fatalf("the inputs changed: %v %v", files, env)
	}
	var back Record
	if err := json.Unmarshal(f2[File], &back); err != nil || back.Runner != "gpu-1" || back.Schema != Schema {
		t.Fatalf("the file: %v %+v", err, back)
	}
	want := map[string]string{
		"PATH": "/bin", "RUNFLEET_RECORD": "/work/" + File, "RUNFLEET_RUNNER": "gpu-1", "RUNFLEET_POOL": "gpu",
		"RUNFLEET_PROVIDER": "docker", "RUNFLEET_MANAGER_VERSION": "v1.2.0", "RUNFLEET_GPU_UUIDS": "GPU-a,0:1",
		"RUNFLEET_CUDA_VERSION": "12.4", "RUNFLEET_IMAGE": "runner:1", "RUNFLEET_IMAGE_DIGEST": "sha256:abc",
	}
	for k, v := range want {
		if e2[k] != v {
			t.Errorf("%s = %q, want %q", k, e2[k], v)
		}
	}
	if _, ok := e2["RUNFLEET_NODE"]; ok {
		t.Error("RUNFLEET_NODE set though the node is unknown")
	}
	if string(f2[".runner"]) != "secret" {
		t.Error("the runner's own files were lost")
	}
}

func TestBytes(t *testing.T) {
	for n, want := range map[int64]string{512 << 20: "512m", 16 << 30: "16g", 1536 << 10: "1536k", 1000: "1000", 3 << 40: "3t"} {
		if got := Bytes(n); got != want {
			t.Errorf("Bytes(%d) = %s, want %s", n, got, want)
		}
	}
}

func TestMergeTakesWhatIsNew(t *testing.T) {
	m := Machine{Image: "a", Zone: "z1"}
	if !m.Merge(Machine{Node: "n1", Zone: "z1"}) || m.Node != "n1" || m.Image != "a" {
		t.Fatalf("merge: %+v", m)
	}
	if m.Merge(Machine{Node: "n1"}) {
		t.Fatal("merging what is known changed something")
	}
}

func TestJobTimes(t *testing.T) {
	t0 := time.Unix(100, 0)
	j := &Job{Queued: t0, Started: t0.Add(5 * time.Second), Completed: t0.Add(65 * time.Second)}
	if j.Waited() != 5*time.Second || j.Ran() != time.Minute {
		t.Fatalf("waited %s ran %s", j.Waited(), j.Ran())
	}
	var none *Job
	if none.Waited() != 0 || (&Job{Started: t0}).Ran() != 0 {
		t.Fatal("unknown times are not zero")
	}
}

// A machine's price: its type's where the pool lists it, the pool's one
// price otherwise, none without either; its cost is the price for the time
// the machine was held.
func TestPricesFor(t *testing.T) {
	one := 0.5
	p := &Prices{PerHour: &one, ByType: map[string]float64{"g5.xlarge": 1.006}, Currency: "EUR"}
	if got := p.For(Machine{InstanceType: "g5.xlarge"}); got == nil || got.PerHour != 1.006 || got.Source != "prices" || got.Currency != "EUR" {
		t.Errorf("g5.xlarge: %+v", got)
	}
	if got := p.For(Machine{}); got == nil || got.PerHour != 0.5 || got.Source != "price_per_hour" {
		t.Errorf("no type: %+v", got)
	}
	if got := (&Prices{ByType: map[string]float64{"a": 1}}).For(Machine{InstanceType: "b"}); got != nil {
		t.Errorf("an unlisted type without a pool price: %+v", got)
	}
	var none *Prices
	if none.For(Machine{}) != nil {
		t.Error("a pool without prices priced a machine")
	}
	t0 := time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)
	r := Record{Created: t0, Ended: t0.Add(90 * time.Minute), Price: &Price{PerHour: 2}, GPUs: []GPU{{ID: "a"}, {ID: "b"}}}
	if c, g := r.Cost(t0.Add(5*time.Hour)), r.GPUSeconds(t0); c != 3 || g != 2*5400 {
		t.Errorf("cost %v, GPU seconds %v", c, g)
	}
	r.Ended = time.Time{}
	if c := r.Cost(t0.Add(30 * time.Minute)); c != 1 {
		t.Errorf("a machine still held, half an hour in: cost %v, want 1", c)
	}
}
