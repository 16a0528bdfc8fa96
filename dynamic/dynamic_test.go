package dynamic

import (
	"strings"
	"testing"
	"time"
)

func limits(t *testing.T) Limits {
	t.Helper()
	l, err := Decode([]byte(`{"gpus":[1,2],"gpu":["h100"],"cpu":8,"mem":"64g","image":{"cuda12.4":"nvidia/cuda:12.4.1"},"spot":true}`))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestResolve(t *testing.T) {
	l := limits(t)
	shape := Shape([]string{"self-hosted", "image=cuda12.4", "gpus=2", "gpu=H100", "mem=16g", "cpu=4", "spot=false"})
	if shape != "gpus=2,gpu=H100,cpu=4,mem=16g,image=cuda12.4,spot=false" {
		t.Fatalf("shape %q", shape)
	}
	r, err := l.Resolve(shape)
	if err != nil {
		t.Fatal(err)
	}
	if r.GPUs != 2 || r.GPU != "h100" || r.CPUs != 4 || r.Memory != 16<<30 || r.Image != "nvidia/cuda:12.4.1" || r.Spot == nil || *r.Spot {
		t.Fatalf("request %+v", r)
	}
	if r, err := l.Resolve(""); err != nil || !r.IsZero() {
		t.Fatalf("no request: %+v %v", r, err)
	}
}

// A batch scheduler's options: the pool's spelling of a name is kept
// (Slurm's names have case; labels may not).
func TestResolveSchedulerOptions(t *testing.T) {
	l, err := Decode([]byte(`{"partition":["gpu","Short"],"constraint":["ib"],"time":"4h"}`))
	if err != nil {
		t.Fatal(err)
	}
	r, err := l.Resolve(Shape([]string{"slurm", "time=90m", "partition=short", "constraint=IB"}))
	if err != nil {
		t.Fatal(err)
	}
	if r.Partition != "Short" || r.Constraint != "ib" || r.Time != 90*time.Minute || l.MaxTime() != 4*time.Hour {
		t.Fatalf("request %+v", r)
	}
	for shape, want := range map[string]string{
		"partition=debug": "partition=debug: the pool allows partition=gpu|Short",
		"constraint=a100": "constraint=a100: the pool allows constraint=ib",
		"time=5h":         "time=5h: the pool allows time up to 4h",
		"time=soon":       "time=soon: the pool allows time up to 4h",
		"time=-1h":        "the pool allows time up to 4h",
	} {
		if _, err := l.Resolve(shape); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Resolve(%s) = %v, want %q", shape, err, want)
		}
	}
	for raw, want := range map[string]string{
		`{"partition":["a b"]}`:      `partition[0]: "a b" is not a name`,
		`{"constraint":["a100&ib"]}`: `constraint[0]: "a100&ib" is not a name`,
		`{"time":"forever"}`:         `time: "forever" is not a duration`,
		`{"time":"10s"}`:             `time: "10s" is not a duration from 1m`,
	} {
		if _, err := Decode([]byte(raw)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Decode(%s) = %v, want %q", raw, err, want)
		}
	}
}

func TestRefusalsSayWhy(t *testing.T) {
	l := limits(t)
	for shape, want := range map[string]string{
		"gpus=4":        "gpus=4: the pool allows gpus=1|2",
		"gpu=a100":      "gpu=a100: the pool allows gpu=h100",
		"cpu=16":        "cpu=16: the pool allows cpu up to 8",
		"mem=128g":      "mem=128g: the pool allows mem up to 64g",
		"image=rocm":    "image=rocm: the pool's images are cuda12.4",
		"spot=maybe":    "spot=maybe: spot is true or false",
		"gpus=1,gpus=2": "gpus is asked for twice",
		// Values no machine has, which would reach a backend as a
		// negative or unbounded limit.
		"cpu=nan":  "cpu=nan: the pool allows cpu up to 8",
		"cpu=NaN":  "the pool allows cpu up to 8",
		"cpu=inf":  "cpu=inf: the pool allows cpu up to 8",
		"cpu=-2":   "cpu=-2: the pool allows cpu up to 8",
		"cpu=0":    "cpu=0: the pool allows cpu up to 8",
		"mem=nang": "mem=nang: the pool allows mem up to 64g",
		"mem=infg": "the pool allows mem up to 64g",
		"mem=-1g":  "the pool allows mem up to 64g",
		"gpus=-1":  "gpus=-1: the pool allows gpus=1|2",
		"gpus=1e9": "the pool allows gpus=1|2",
		"time=1h":  "time=1h: this pool lets jobs choose only",
	} {
		if _, err := l.Resolve(shape); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Resolve(%s) = %v, want %q", shape, err, want)
		}
	}
	only, _ := Decode([]byte(`{"gpus":[1]}`))
	if _, err := only.Resolve("mem=1g"); err == nil || !strings.Contains(err.Error(), "lets jobs choose only gpus") {
		t.Errorf("a key the pool does not allow: %v", err)
	}
}

func TestCheckNamesTheField(t *testing.T) {
	for raw, want := range map[string]string{
		`{"gpus":[0]}`:           "gpus[0]: 0 is not a number of GPUs",
		`{"mem":"lots"}`:         `mem: "lots" is not a size`,
		`{"image":{"a=b":"x"}}`:  "image.a=b:",
		`{"gpu":["h100","a:b"]}`: `gpu[1]: "a:b"`,
		`{"cpu":-1}`:             "cpu: -1 is not a number of CPUs from 0 to 4096",
		`{"cpu":100000}`:         "cpu: 100000 is not a number of CPUs from 0 to 4096",
		`{"mem":"nan"}`:          `mem: "nan" is not a size`,
		`{"mem":"1000t"}`:        `mem: "1000t" is not a size from 1 byte to 64t`,
		`{"gpus":[65]}`:          "gpus[0]: 65 is not a number of GPUs from 1 to 64",
	} {
		if _, err := Decode([]byte(raw)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Decode(%s) = %v, want %q", raw, err, want)
		}
	}
}

func TestSplit(t *testing.T) {
	plain, asks := Split([]string{"gpu", "gpus=2", "team=ml", "gpu=h100"})
	if strings.Join(plain, " ") != "gpu team=ml" || strings.Join(asks, " ") != "gpus=2 gpu=h100" {
		t.Fatalf("plain %v asks %v", plain, asks)
	}
}
