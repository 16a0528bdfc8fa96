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
