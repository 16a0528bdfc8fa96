package harness

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/provider/docker"
)

// GPUEngine is a private Docker engine that accepts GPU device requests
// on a machine without GPUs. Docker registers its "nvidia" device driver
// when NVIDIA's prestart hook, nvidia-container-runtime-hook, is on the
// daemon's PATH; this engine's PATH holds a stand-in hook that does
// nothing. The engine itself then does what it does on a GPU host: it
// checks the request and sets NVIDIA_VISIBLE_DEVICES in the container to
// the requested device ids, which is what a job sees. The default engine
// is left alone: the private one has its own data root, exec root,
// containerd, socket and bridge.
type GPUEngine struct {
	dir    string
	host   string // DOCKER_HOST
	cli    *client.Client
	cmd    *exec.Cmd
	bridge string
	// dockerd's command line and environment, to start it again.
	args, env []string

	imgOnce sync.Once
	img     string
	imgErr  error
}

var (
	gpuEngineOnce sync.Once
	theGPUEngine  *GPUEngine
	gpuEngineErr  error
)

// NeedGPUEngine starts the private engine on first use. It needs root and
// dockerd; without them the test is skipped, or fails in CI.
func NeedGPUEngine(t testing.TB) *GPUEngine {
	t.Helper()
	Need(t)
	gpuEngineOnce.Do(func() {
		theGPUEngine, gpuEngineErr = StartEngine(EngineOptions{Name: "rfgpu", Net: 231, NvidiaHook: true})
	})
	peers.Need(t, "a private Docker engine (root and dockerd) for the GPU tests", gpuEngineErr)
	return theGPUEngine
}

// EngineOptions sets a private engine apart from the others: its name
// prefixes its directory, bridge and containerd namespace, and Net is the
// second octet of its subnet.
type EngineOptions struct {
	Name string
	Net  int
	// NvidiaHook puts the stand-in NVIDIA hook on the engine's PATH.
	NvidiaHook bool
	// DaemonJSON is its config file; "{}" when empty.
	DaemonJSON string
}

func StartEngine(opt EngineOptions) (*GPUEngine, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("not root")
	}
	dockerd, err := exec.LookPath("dockerd")
	if err != nil {
		return nil, err
	}
	// A short path: the socket's must fit in 108 bytes.
	dir, err := os.MkdirTemp("", opt.Name)
	if err != nil {
		return nil, err
	}
	e := &GPUEngine{dir: dir, host: "unix://" + filepath.Join(dir, "docker.sock"), bridge: fmt.Sprintf("%s%d", opt.Name, os.Getpid()%100000)}
	fail := func(err error) (*GPUEngine, error) {
		e.Stop()
		return nil, err
	}
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return fail(err)
	}
	if opt.NvidiaHook {
		hook := "#!/bin/sh\n# Stand-in for NVIDIA's prestart hook: there is no GPU to set up.\ncat >/dev/null\nexit 0\n"
		if err := os.WriteFile(filepath.Join(bin, "nvidia-container-runtime-hook"), []byte(hook), 0o755); err != nil {
			return fail(err)
		}
	}
	if opt.DaemonJSON == "" {
		opt.DaemonJSON = "{}"
	}
	if err := os.WriteFile(filepath.Join(dir, "daemon.json"), []byte(opt.DaemonJSON), 0o644); err != nil {
		return fail(err)
	}
	// Its own bridge: an engine started with --bridge none would delete
	// the default engine's docker0.
	subnet := fmt.Sprintf("10.%d.%d.1/24", opt.Net, os.Getpid()%250)
	// A fixed address: a bridge made by hand otherwise takes its lowest
	// port's, which changes as containers come and go and leaves their
	// neighbours' ARP entries stale.
	for _, args := range [][]string{
		{"link", "add", e.bridge, "address", "02:42:0a:e7:00:01", "type", "bridge"},
		{"addr", "add", subnet, "dev", e.bridge},
		{"link", "set", e.bridge, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fail(fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out))
		}
	}
	e.args = []string{
		"--config-file", filepath.Join(dir, "daemon.json"),
		"--host", e.host,
		"--data-root", filepath.Join(dir, "data"),
		"--exec-root", filepath.Join(dir, "exec"),
		"--pidfile", filepath.Join(dir, "docker.pid"),
		"--bridge", e.bridge,
		"--iptables=false", "--ip6tables=false",
		"--containerd-namespace", opt.Name, "--containerd-plugins-namespace", opt.Name + "-plugins",
	}
	e.env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
	if e.cli, err = client.New(client.WithHost(e.host)); err != nil {
		return fail(err)
	}
	if err := e.run(dockerd); err != nil {
		return fail(err)
	}
	return e, nil
}

// run starts dockerd and waits until it answers.
func (e *GPUEngine) run(dockerd string) error {
	logf, err := os.OpenFile(filepath.Join(e.dir, "dockerd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	e.cmd = exec.Command(dockerd, e.args...)
	e.cmd.Env = e.env
	e.cmd.Stdout, e.cmd.Stderr = logf, logf
	if err := e.cmd.Start(); err != nil {
		return err
	}
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := e.cli.Ping(ctx, client.PingOptions{})
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(e.dir, "dockerd.log"))
			return fmt.Errorf("private dockerd did not answer: %v\n%s", err, TailString(string(b), 3000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Restart stops dockerd (SIGTERM, as a service manager does) and starts
// it again; with live-restore its containers run on meanwhile.
func (e *GPUEngine) Restart(down time.Duration) error {
	if err := e.terminate(); err != nil {
		return err
	}
	time.Sleep(down)
	return e.run(e.cmd.Path)
}

func (e *GPUEngine) terminate() error {
	_ = e.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = e.cmd.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-time.After(30 * time.Second):
		_ = e.cmd.Process.Kill()
		<-done
		return errors.New("dockerd did not stop within 30s of SIGTERM")
	}
}

// image builds the stand-in runner image on this engine.
func (e *GPUEngine) image(t testing.TB, bin string) string {
	t.Helper()
	e.imgOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		e.img, e.imgErr = peers.AgentImage(ctx, e.cli, "runfleet-test/github-runner", "github-runner", bin)
	})
	if e.imgErr != nil {
		t.Fatal(e.imgErr)
	}
	return e.img
}

// GiteaRunnerImage builds the gitea-runner image on this engine.
func (e *GPUEngine) GiteaRunnerImage(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	img, err := peers.RunnerImage(ctx, e.cli, runnerBin)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// ImageID is the engine's id of an image: the digest of its content.
func (e *GPUEngine) ImageID(t testing.TB, ref string) string {
	t.Helper()
	res, err := e.cli.ImageInspect(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	return res.ID
}

// Stop ends the engine and removes everything it made.
func (e *GPUEngine) Stop() {
	if e.cli != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if res, err := e.cli.ContainerList(ctx, client.ContainerListOptions{All: true}); err == nil {
			for _, c := range res.Items {
				_, _ = e.cli.ContainerRemove(ctx, c.ID, client.ContainerRemoveOptions{Force: true})
			}
		}
		cancel()
		_ = e.cli.Close()
	}
	if e.cmd != nil && e.cmd.Process != nil && e.cmd.ProcessState == nil {
		_ = e.terminate()
	}
	// What the engine mounted under its directories (its network
	// namespace, overlay layers), deepest first.
	if f, err := os.Open("/proc/self/mounts"); err == nil {
		var mounts []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if fields := strings.Fields(sc.Text()); len(fields) > 1 && strings.HasPrefix(fields[1], e.dir+"/") {
				mounts = append(mounts, fields[1])
			}
		}
		f.Close()
		slices.Reverse(mounts)
		for _, m := range mounts {
			_ = syscall.Unmount(m, syscall.MNT_DETACH)
		}
	}
	_ = exec.Command("ip", "link", "del", e.bridge).Run()
	_ = os.RemoveAll(e.dir)
}

// stopGPUEngine is called by Main once the tests are done.
func stopGPUEngine() {
	if theGPUEngine != nil {
		theGPUEngine.Stop()
	}
}

// The injected inventory: four H100s, written from NVIDIA's nvsmi DTD,
// read by a stand-in nvidia-smi, so that runfleet's own detection runs.
var H100UUIDs = []string{
	"GPU-0b1e2d3c-4a5b-6c7d-8e9f-a0b1c2d3e4f5",
	"GPU-1c2d3e4f-5a6b-4c7d-9e8f-0a1b2c3d4e5f",
	"GPU-5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c8d",
	"GPU-7e4c1a3b-9d2e-4f61-8a0b-3c5d7e9f1a20",
}

// FakeNvidiaSMI writes an nvidia-smi that reports the four H100s of
// gpu/testdata/h100x4-v12.xml (H100UUIDs) and returns its path.
func FakeNvidiaSMI(t testing.TB) string {
	t.Helper()
	fixture := filepath.Join(RepoRoot(), "gpu", "testdata", "h100x4-v12.xml")
	path := filepath.Join(t.TempDir(), "nvidia-smi")
	script := fmt.Sprintf("#!/bin/sh\ncase \"$1\" in -L) exit 0;; esac\ncat %s\n", fixture)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// BusyNvidiaSMI is FakeNvidiaSMI on four H100s at work: each reports
// 87% utilisation and 41,234 MiB of its memory in use, as nvidia-smi
// writes them (utilization>gpu_util, fb_memory_usage>used).
func BusyNvidiaSMI(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(RepoRoot(), "gpu", "testdata", "h100x4-v12.xml"))
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.ReplaceAll(string(b), "<gpu_util>0 %</gpu_util>", "<gpu_util>87 %</gpu_util>")
	doc = strings.ReplaceAll(doc, "<reserved>551 MiB</reserved>\n\t\t\t<used>0 MiB</used>", "<reserved>551 MiB</reserved>\n\t\t\t<used>41234 MiB</used>")
	dir := t.TempDir()
	fixture := filepath.Join(dir, "report.xml")
	if err := os.WriteFile(fixture, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "nvidia-smi")
	script := fmt.Sprintf("#!/bin/sh\ncase \"$1\" in -L) exit 0;; esac\ncat %s\n", fixture)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// GpusOf returns, for each running container of the fleet, the device
// ids of its one nvidia device request, failing on anything else.
func (f *Fleet) GpusOf() map[string][]string {
	f.T.Helper()
	out := map[string][]string{}
	for _, c := range f.Containers() {
		if c.State != container.StateRunning {
			continue
		}
		res, err := f.cli().ContainerInspect(context.Background(), c.ID, client.ContainerInspectOptions{})
		if cerrdefs.IsNotFound(err) {
			// Exited and auto-removed since the listing (its job
			// done): it holds no GPU.
			continue
		}
		if err != nil {
			f.T.Fatalf("inspect %s: %v", c.ID, err)
		}
		hc := res.Container.HostConfig
		if len(hc.DeviceRequests) != 1 {
			f.T.Fatalf("container %s has device requests %+v, want one", c.ID[:12], hc.DeviceRequests)
		}
		req := hc.DeviceRequests[0]
		if req.Driver != "nvidia" || req.Count != 0 || !slices.Equal(req.Capabilities[0], []string{"gpu"}) {
			f.T.Fatalf("container %s: device request %+v", c.ID[:12], req)
		}
		if l := c.Labels[docker.LabelGPUs]; l != strings.Join(req.DeviceIDs, ",") {
			f.T.Fatalf("container %s: label %q, device ids %v", c.ID[:12], l, req.DeviceIDs)
		}
		out[c.ID] = req.DeviceIDs
	}
	return out
}

// Disjoint checks that no device is in two containers' requests, and
// returns every device requested.
func Disjoint(t testing.TB, held map[string][]string) []string {
	t.Helper()
	seen := map[string]string{}
	for id, devs := range held {
		for _, d := range devs {
			if o, ok := seen[d]; ok {
				t.Fatalf("%s is in the device requests of containers %s and %s", d, o[:12], id[:12])
			}
			seen[d] = id
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// SplitsFourGPUs checks that the containers' device requests split the four
// injected GPUs into runners disjoint sets of per each.
func SplitsFourGPUs(t *testing.T, held map[string][]string, runners, per int) {
	t.Helper()
	all := Disjoint(t, held)
	if len(held) != runners || !slices.Equal(all, H100UUIDs) {
		t.Fatalf("containers hold %v, want %d disjoint sets of %d covering the 4 GPUs", held, runners, per)
	}
	for _, devs := range held {
		if len(devs) != per {
			t.Fatalf("a container has %v, want %d GPUs", devs, per)
		}
	}
}
