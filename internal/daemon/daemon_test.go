package daemon

import (
	"fmt"
	"testing"

	"github.com/runfleet/runfleet/config"
)

// A pool's docker section reaches the provider as written: limits, the
// OOM score, read-only mounts unless rw, and GPU requests.
func TestDockerOptionsFromConfig(t *testing.T) {
	t.Setenv("T_TOKEN", "x")
	cfg, err := config.Parse([]byte(`
forges:
  - {name: f, type: gitea, url: "http://127.0.0.1:3000", token: "${T_TOKEN}", repo: a/b}
pools:
  - name: gpu
    labels: [gpu]
    size: 1
    docker:
      image: runner:cuda
      cpus: 1.5
      memory: 2g
      shm_size: 1g
      volumes: ["/data/imagenet:/data", "/scratch:/scratch:rw", "cache:/cache"]
      gpus: [0, "GPU-1234"]
`))
	if err != nil {
		t.Fatal(err)
	}
	opt, err := dockerOptions(cfg.Pools[0].Docker)
	if err != nil {
		t.Fatal(err)
	}
	if opt.Image != "runner:cuda" || opt.NanoCPUs != 1_500_000_000 || opt.Memory != 2<<30 || opt.ShmSize != 1<<30 || opt.OOMScoreAdj != 1000 {
		t.Errorf("options = %+v", opt)
	}
	if got := fmt.Sprint(opt.Mounts); got != "[{/data/imagenet /data true} {/scratch /scratch false} {cache /cache true}]" {
		t.Errorf("mounts = %s", got)
	}
	if opt.GPUs.All || fmt.Sprint(opt.GPUs.IDs) != "[0 GPU-1234]" {
		t.Errorf("gpus = %+v", opt.GPUs)
	}
}
