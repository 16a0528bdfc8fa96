package docker

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/provider"
)

func section(t *testing.T, doc string) json.RawMessage {
	t.Helper()
	b, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A pool's docker section: its defaults, limits, read-only mounts unless
// rw, and GPU requests, as the provider gets them.
func TestSectionDefaultsAndOptions(t *testing.T) {
	s, err := DecodeSection(section(t, `
image: runfleet/gitea-runner:cuda
memory: 8g
cpus: 2.5
shm_size: 1g
volumes: ["/data/imagenet:/data", "/scratch:/scratch:rw", "cache:/cache:ro"]
gpus: [0, "GPU-1234"]
`), 0)
	if err != nil {
		t.Fatal(err)
	}
	if s.Pull != "missing" || *s.OOMScoreAdj != 1000 || s.Workdir != "/runner" {
		t.Errorf("defaults: pull %q oom %d workdir %q", s.Pull, *s.OOMScoreAdj, s.Workdir)
	}
	if m, _ := s.MemoryBytes(); m != 8<<30 {
		t.Errorf("memory = %d", m)
	}
	if len(s.GPUs.IDs) != 2 || s.GPUs.IDs[0] != "0" || s.GPUs.IDs[1] != "GPU-1234" || s.GPUs.All {
		t.Errorf("gpus = %+v", s.GPUs)
	}
	opt, err := s.Options()
	if err != nil {
		t.Fatal(err)
	}
	if opt.Image != "runfleet/gitea-runner:cuda" || opt.NanoCPUs != 2_500_000_000 || opt.Memory != 8<<30 || opt.ShmSize != 1<<30 || opt.OOMScoreAdj != 1000 {
		t.Errorf("options = %+v", opt)
	}
	// Read-only unless rw is written out.
	if got := fmt.Sprint(opt.Mounts); got != "[{/data/imagenet /data true} {/scratch /scratch false} {cache /cache true}]" {
		t.Errorf("mounts = %s", got)
	}
	if opt.GPUs.All || fmt.Sprint(opt.GPUs.IDs) != "[0 GPU-1234]" {
		t.Errorf("gpus = %+v", opt.GPUs)
	}
	all, err := DecodeSection(section(t, "{image: x, gpus: all, oom_score_adj: 0}"), 0)
	if err != nil || !all.GPUs.All || *all.OOMScoreAdj != 0 {
		t.Errorf("gpus: all / oom_score_adj 0: %+v, %v", all, err)
	}
	imgs, err := DecodeSection(section(t, "images: [{image: 'r:cu118', min_cuda: '11.8'}, {image: 'r:cu124', min_cuda: '12.4'}]"), -1)
	if err != nil || !imgs.NeedsGPUs() || len(imgs.GPUImages()) != 2 || imgs.GPUImages()[1].MinCUDA.String() != "12.4" {
		t.Errorf("images: %+v %v", imgs.GPUImages(), err)
	}
}

// Each problem names its field, relative to the pool, with the value.
func TestSectionErrors(t *testing.T) {
	for doc, want := range map[string]string{
		"":                              "docker: is required",
		"{image: x, sise: 3}":           `docker.sise: unknown field`,
		"5":                             "docker: must be a mapping",
		"{image: x, cpus: lots}":        "docker.cpus: must be a float64",
		"{image: x, memory: 12q}":       `docker.memory: "12q" is not a size`,
		"{image: x, volumes: ['/a:b']}": `docker.volumes[0]: "/a:b": target "b" must be an absolute path`,
		"{image: x, workdir: /}":        `docker.workdir: "/" must be an absolute path below /`,
		"{image: x, extra_hosts: [h]}":  `docker.extra_hosts[0]: "h" is not name:ip`,
	} {
		_, err := DecodeSection(section(t, doc), 0)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: err %v, want %q", doc, err, want)
		}
	}
	if _, err := DecodeSection(section(t, "{image: x, gpus: all}"), 1); err == nil || !strings.Contains(err.Error(), "gpus_per_runner: is set with docker.gpus") {
		t.Errorf("gpus_per_runner with docker.gpus: %v", err)
	}
}

// `runfleet runner --docker IMAGE --docker-volumes ...` asks for this
// provider.
func TestCMLSection(t *testing.T) {
	if _, ok, _ := (driver{}).CMLSection(providerOptions("", nil)); ok {
		t.Error("took options without --docker")
	}
	sec, ok, err := (driver{}).CMLSection(providerOptions("runner:cuda", []string{"/data:/data"}))
	if !ok || err != nil {
		t.Fatalf("ok %v err %v", ok, err)
	}
	s, err := DecodeSection(sec, 0)
	if err != nil || s.Image != "runner:cuda" || fmt.Sprint(s.Volumes) != "[/data:/data]" {
		t.Errorf("section %s: %+v %v", sec, s, err)
	}
}

func providerOptions(image string, volumes []string) provider.CMLOptions {
	return provider.CMLOptions{Docker: image, DockerVolumes: volumes}
}
