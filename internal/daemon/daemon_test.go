package daemon

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/pool"

	// The drivers the configs here name.
	_ "github.com/runfleet/runfleet/forge/gitea"
	_ "github.com/runfleet/runfleet/forge/github"
	_ "github.com/runfleet/runfleet/forge/gitlab"
	_ "github.com/runfleet/runfleet/provider/docker"
	_ "github.com/runfleet/runfleet/provider/kubernetes"
	_ "github.com/runfleet/runfleet/provider/process"
	_ "github.com/runfleet/runfleet/provider/slurm"
)

// fakeSMI is an nvidia-smi that prints the named fixture of the gpu
// package, or fails as on a host without a driver ("").
func fakeSMI(t *testing.T, fixture string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "nvidia-smi")
	script := "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\nexit 9\n"
	if fixture != "" {
		abs, err := filepath.Abs(filepath.Join("..", "..", "gpu", "testdata", fixture))
		if err != nil {
			t.Fatal(err)
		}
		script = "#!/bin/sh\n[ \"$1\" = -L ] && exit 0\ncat " + abs + "\n"
	}
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func gpuConfig(t *testing.T, smi, pool string) (*config.Config, error) {
	t.Helper()
	t.Setenv("T_TOKEN", "x")
	cfg, err := config.Parse([]byte(`
state_dir: ` + t.TempDir() + `
gpu: {nvidia_smi: ` + smi + `}
forges:
  - {name: f, type: gitea, url: "http://127.0.0.1:3000", token: "${T_TOKEN}", repo: a/b}
pools:
  - name: gpu
    labels: [gpu]
` + pool))
	return cfg, err
}

func TestGPUPoolsFitTheHost(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	h100 := fakeSMI(t, "h100x4-v12.xml")
	tests := []struct {
		name, smi, pool string
		size, max       int
		image           string
		err             string
	}{
		{name: "sized by GPUs", smi: h100, pool: "    gpus_per_runner: 1\n    agent: {path: /bin/true}\n", size: 4, max: 4},
		{name: "pairs", smi: h100, pool: "    gpus_per_runner: 2\n    max: 6\n    agent: {path: /bin/true}\n", size: 2, max: 6},
		{name: "all", smi: h100, pool: "    gpus_per_runner: all\n    agent: {path: /bin/true}\n", size: 1, max: 1},
		{name: "explicit size", smi: h100, pool: "    gpus_per_runner: 1\n    size: 2\n    agent: {path: /bin/true}\n", size: 2, max: 2},
		{name: "template", smi: h100, pool: "    gpus_per_runner: 1\n    docker: {image: 'nvidia/cuda:{{.CUDA}}.1-runtime-ubuntu22.04'}\n", size: 4, max: 4, image: "nvidia/cuda:12.4.1-runtime-ubuntu22.04"},
		{name: "image list", smi: h100, pool: "    gpus_per_runner: 1\n    docker: {images: [{image: 'r:cu118', min_cuda: '11.8'}, {image: 'r:cu126', min_cuda: '12.6'}, {image: 'r:cu121', min_cuda: '12.1'}]}\n", size: 4, max: 4, image: "r:cu121"},
		{name: "no image fits", smi: h100, pool: "    gpus_per_runner: 1\n    docker: {images: [{image: 'r:cu126', min_cuda: '12.6'}]}\n", err: "pools[0]: docker.image: no image fits: the driver (550.54.15) supports CUDA up to 12.4; r:cu126 needs CUDA 12.6"},
		{name: "more than the host has", smi: h100, pool: "    gpus_per_runner: 5\n    agent: {path: /bin/true}\n", err: "pools[0]: gpus_per_runner: 5, and this host has 4 GPUs"},
		{name: "no driver", smi: fakeSMI(t, ""), pool: "    gpus_per_runner: 1\n    agent: {path: /bin/true}\n", err: "this host has no GPU ("},
		{name: "no GPU", smi: fakeSMI(t, "nogpu-v12.xml"), pool: "    gpus_per_runner: all\n    agent: {path: /bin/true}\n", err: "gpus_per_runner: all, and this host has no GPU (nvidia-smi reports no GPU attached)"},
		{name: "dynamic on docker", smi: h100, pool: "    size: 0\n    max: 4\n    gpus_per_runner: 1\n    dynamic: {gpus: [1, 2], gpu: [h100], cpu: 8, mem: 64g, image: {cu12: 'r:cu12'}}\n    docker: {image: r:1}\n", size: 0, max: 4},
		{name: "dynamic process without limits", smi: h100, pool: "    gpus_per_runner: 1\n    max: 2\n    dynamic: {gpus: [1, 2], mem: 8g}\n    agent: {path: /bin/true}\n", err: "pools[0]: dynamic.mem: provider process cannot give a runner what a job asks for in mem= (it can: gpus, gpu)"},
		{name: "dynamic gpus without host GPUs", smi: h100, pool: "    size: 1\n    dynamic: {gpus: [1]}\n    agent: {path: /bin/true}\n", err: "pools[0]: dynamic.gpus: needs gpus_per_runner"},
		// A cluster's GPUs: no idle runner holds one unless asked.
		{name: "slurm GPU pool", smi: h100, pool: "    gpus_per_runner: 1\n    max: 4\n    workdir: /tmp\n    agent: {path: /bin/true}\n    slurm: {memory: 1G}\n", size: 0, max: 4},
		{name: "slurm GPU pool without max", smi: h100, pool: "    gpus_per_runner: 1\n    workdir: /tmp\n    slurm: {memory: 1G}\n", err: "pools[0]: max: not given, and provider slurm gives runners GPUs of its own nodes"},
		// A CPU-only pool never runs nvidia-smi: a broken one is no matter.
		{name: "cpu only", smi: "/nonexistent/nvidia-smi", pool: "    size: 2\n    agent: {path: /bin/true}\n", size: 2, max: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := gpuConfig(t, tt.smi, tt.pool)
			var f *Fleet
			if err == nil {
				f, err = New(t.Context(), cfg, log)
			}
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			plan, _ := f.Plan("gpu")
			if plan.Size != tt.size || plan.Max != tt.max {
				t.Errorf("size %d max %d, want %d %d", plan.Size, plan.Max, tt.size, tt.max)
			}
			if img, ok := f.Providers["gpu"].(interface{ Image() string }); tt.image != "" && (!ok || img.Image() != tt.image) {
				t.Errorf("image %v, want %q", img, tt.image)
			}
			if inv, alloc := f.Host.Read(); tt.name == "cpu only" && (inv != nil || alloc != nil) {
				t.Errorf("a CPU-only config read the GPUs: %+v", inv)
			}
		})
	}
}

// built makes the fleet of a parsed config, failing the test on an error
// of either; the fleet is closed after the test.
func built(t *testing.T) func(*config.Config, error) *Fleet {
	return func(cfg *config.Config, err error) *Fleet {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		f, err := New(t.Context(), cfg, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(f.Close)
		return f
	}
}

// A pool sized by its GPUs keeps that size over a reload that changes
// something else, and the size is the plan's: the parsed config keeps
// what the user wrote, so a reload of the same file changes nothing.
func TestReloadKeepsTheGPUsSize(t *testing.T) {
	t.Setenv("T_TOKEN", "x")
	state, smi := t.TempDir(), fakeSMI(t, "h100x4-v12.xml")
	parse := func(idle string) *config.Config {
		t.Helper()
		cfg, err := config.Parse([]byte(`
state_dir: ` + state + `
gpu: {nvidia_smi: ` + smi + `}
forges:
  - {name: f, type: gitea, url: "http://127.0.0.1:3000", token: "${T_TOKEN}", repo: a/b}
pools:
  - {name: gpu, labels: [gpu], gpus_per_runner: 1, idle_timeout: ` + idle + `, agent: {path: /bin/true}}
`))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	cfg := parse("5m")
	f := built(t)(cfg, nil)
	if cfg.Pools[0].Size != 0 || !cfg.Pools[0].SizeFromGPUs {
		t.Errorf("the parsed config was written to: size %d", cfg.Pools[0].Size)
	}
	for _, idle := range []string{"5m", "7m"} {
		if err := f.Reload(t.Context(), parse(idle)); err != nil {
			t.Fatal(err)
		}
		if plan, _ := f.Plan("gpu"); plan.Size != 4 || plan.Max != 4 || plan.Runners.PerRunner != 1 {
			t.Errorf("after a reload: size %d max %d, %d GPUs a runner; want 4 4 1", plan.Size, plan.Max, plan.Runners.PerRunner)
		}
	}
}

// A Kubernetes pool's runners get GPUs of the cluster's nodes (each pod
// asks for gpus_per_runner of gpu_resource), never this host's, which
// are not read: the pool starts as docs/providers/kubernetes.md shows it.
func TestKubernetesGPUPoolStarts(t *testing.T) {
	const kubeconfig = `{apiVersion: v1, kind: Config, current-context: c, clusters: [{name: k, cluster: {server: "https://127.0.0.1:1"}}], contexts: [{name: c, context: {cluster: k, user: u}}], users: [{name: u, user: {token: t}}]}`
	f := built(t)(gpuConfig(t, "/nonexistent/nvidia-smi", "    size: 2\n    max: 4\n    gpus_per_runner: 1\n    kubernetes: {image: r:1, kubeconfig_data: '"+kubeconfig+"'}\n"))
	if plan, _ := f.Plan("gpu"); plan.Size != 2 || plan.Max != 4 || plan.Runners.GPUs != nil {
		t.Errorf("plan %+v: want size 2, max 4, none of this host's GPUs", plan)
	}
	if inv, _ := f.Host.Read(); inv != nil {
		t.Error("the host's GPUs were read for a Kubernetes pool")
	}
}

// A Slurm pool's runners get GPUs of the cluster's nodes, not this
// host's: when another pool has read this host's GPUs, a job asking for
// them still goes to that pool, not to the Slurm pool listed first, whose
// runners would never register with their labels.
func TestClusterPoolIsNotMatchedOnTheHostsGPUs(t *testing.T) {
	t.Setenv("T_TOKEN", "x")
	cfg, err := config.Parse([]byte(`
state_dir: ` + t.TempDir() + `
gpu: {nvidia_smi: ` + fakeSMI(t, "h100x4-v12.xml") + `}
forges:
  - {name: f, type: gitea, url: "http://127.0.0.1:3000", token: "${T_TOKEN}", repo: a/b}
pools:
  - {name: cluster, labels: [gpu], gpus_per_runner: 1, max: 4, workdir: /tmp, agent: {path: /bin/true}, slurm: {memory: 1G}}
  - {name: host, labels: [gpu], gpus_per_runner: 1, agent: {path: /bin/true}}
`))
	f := built(t)(cfg, err)
	for _, tt := range []struct {
		labels []string
		pool   string
	}{
		{[]string{"gpu"}, "cluster"},
		{[]string{"gpu", "gpu-h100"}, "host"},
		{[]string{"gpu", "gpus-1", "cuda-12.4"}, "host"},
	} {
		if got := f.Demand.Match(demand.Job{Forge: "f", ID: 1, Labels: tt.labels}); got != tt.pool {
			t.Errorf("a job asking for %v is matched to pool %q, want %q", tt.labels, got, tt.pool)
		}
	}
}

// A pool's recorded backoff is carried over to a manager that runs the
// same runners, and not to one whose pool of the same name registers
// elsewhere (`runfleet runner --name x` against another repository) or
// runs another agent: their failures say nothing of it.
func TestBackoffBelongsToItsRunners(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	state := t.TempDir()
	t.Setenv("T_TOKEN", "x")
	fleet := func(repo, agent string) *Fleet {
		t.Helper()
		cfg, err := config.Parse([]byte(`
state_dir: ` + state + `
forges:
  - {name: f, type: gitea, url: "http://127.0.0.1:3000", token: "${T_TOKEN}", repo: ` + repo + `}
pools:
  - {name: p, labels: [x], size: 1, agent: {path: ` + agent + `}}
`))
		if err != nil {
			t.Fatal(err)
		}
		f, err := New(t.Context(), cfg, log)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	b := pool.Backoff{Failures: 4, Until: time.Now().Add(time.Minute).UTC().Round(0), Reason: "agent exited before it registered"}
	fleet("a/b", "/bin/true").backoffFile("p").Save(b)
	if got := fleet("a/b", "/bin/true").SavedBackoff("p"); got.Failures != 4 || got.Reason != b.Reason || !got.Until.Equal(b.Until) {
		t.Errorf("same runners: %+v, want %+v", got, b)
	}
	if got := fleet("a/c", "/bin/true").SavedBackoff("p"); got.Failures != 0 {
		t.Errorf("another repository: %+v carried over", got)
	}
	if got := fleet("a/b", "/bin/false").SavedBackoff("p"); got.Failures != 0 {
		t.Errorf("another agent: %+v carried over", got)
	}
}
