package docker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/internal/testbed/stall"
	"github.com/runfleet/runfleet/provider"
)

var (
	imageOnce sync.Once
	image     string
	imageErr  error
)

// engine returns a client of the local Docker engine and a FROM scratch
// busybox image. Without an engine the test is skipped, or fails in CI.
func engine(t *testing.T) (*client.Client, string) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs Docker: skipped with -short")
	}
	cli, err := NewClient()
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = cli.Ping(ctx, client.PingOptions{})
	}
	if err == nil {
		imageOnce.Do(func() { image, imageErr = peers.RunnerImage(context.Background(), cli, "") })
		err = imageErr
	}
	peers.Need(t, "Docker", err)
	t.Cleanup(func() { cli.Close() })
	return cli, image
}

// newProvider makes a provider for a manager id unique to the test, and
// removes whatever the test left.
func newProvider(t *testing.T, opt Options) *Provider {
	t.Helper()
	cli, img := engine(t)
	opt.Client = cli
	if opt.Image == "" {
		opt.Image = img
	}
	if opt.Manager == "" {
		opt.Manager = fmt.Sprintf("t%d", time.Now().UnixNano())
	}
	if opt.Pool == "" {
		opt.Pool = "p"
	}
	opt.OOMScoreAdj = 1000
	p, err := New(opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		res, _ := cli.ContainerList(ctx, client.ContainerListOptions{All: true, Filters: make(client.Filters).Add("label", LabelManager+"="+opt.Manager)})
		for _, c := range res.Items {
			_, _ = cli.ContainerRemove(ctx, c.ID, client.ContainerRemoveOptions{Force: true})
		}
		p.Close()
	})
	return p
}

func sleeper(p *Provider, name string, script string) provider.Spec {
	return provider.Spec{
		Name: name, Manager: p.opt.Manager, Pool: p.opt.Pool,
		Command: "/bin/sh", Args: []string{"-c", script},
		Env:   map[string]string{"RUNNER_NAME": name},
		Files: map[string][]byte{".runner": []byte("credential-of-" + name), "sub/runner.yaml": []byte("x: 1")},
	}
}

// Both ways of handing the runner its files: copied into the container,
// or bind-mounted read-only from the manager's host.
func TestCreateInspectListDelete(t *testing.T) {
	t.Run("copy", func(t *testing.T) { testCreateInspectListDelete(t, "") })
	t.Run("mount", func(t *testing.T) { testCreateInspectListDelete(t, t.TempDir()) })
}

func testCreateInspectListDelete(t *testing.T, filesDir string) {
	data := t.TempDir()
	p := newProvider(t, Options{
		NanoCPUs: 500_000_000, Memory: 64 << 20, ShmSize: 32 << 20,
		Mounts:     []Mount{{Source: data, Target: "/data", ReadOnly: true}},
		ExtraHosts: []string{"forge.test:10.1.2.3"},
		LogDir:     t.TempDir(),
		FilesDir:   filesDir,
	})
	ctx := context.Background()
	spec := sleeper(p, "p-1", `cat .runner; echo; cat sub/runner.yaml; echo; ls -ln .runner; touch /data/x 2>/dev/null && echo data-writable || echo data-readonly; sleep 60`)
	inst, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if inst.State != provider.StateRunning || inst.Name != "p-1" || inst.ID == "" {
		t.Fatalf("instance = %+v", inst)
	}

	// Create again: the same container, not a second one.
	again, err := p.Create(ctx, spec)
	if err != nil || again.ID != inst.ID {
		t.Fatalf("second Create = %v, %v; want the same container %s", again.ID, err, inst.ID)
	}

	res, err := p.cli.ContainerInspect(ctx, inst.ID, client.ContainerInspectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := res.Container
	hc := c.HostConfig
	if !hc.AutoRemove || hc.OomScoreAdj != 1000 || hc.NanoCPUs != 500_000_000 || hc.Memory != 64<<20 || hc.ShmSize != 32<<20 {
		t.Errorf("host config: AutoRemove=%v OomScoreAdj=%d NanoCPUs=%d Memory=%d ShmSize=%d", hc.AutoRemove, hc.OomScoreAdj, hc.NanoCPUs, hc.Memory, hc.ShmSize)
	}
	want := map[string]string{LabelManager: p.opt.Manager, LabelPool: "p", LabelRunner: "p-1", LabelSlot: "1"}
	for k, v := range want {
		if c.Config.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, c.Config.Labels[k], v)
		}
	}
	wantMounts := 1
	if filesDir != "" {
		wantMounts = 2
	}
	if len(hc.Mounts) != wantMounts || !hc.Mounts[0].ReadOnly || hc.Mounts[0].Target != "/data" {
		t.Errorf("mounts = %+v, want /data read-only", hc.Mounts)
	}
	if filesDir != "" && (hc.Mounts[1].Target != "/runner" || !strings.HasPrefix(hc.Mounts[1].Source, filesDir)) {
		t.Errorf("files mount = %+v, want a directory of %s at /runner", hc.Mounts[1], filesDir)
	}
	if !slices.Contains(hc.ExtraHosts, "forge.test:10.1.2.3") || !slices.Contains(hc.ExtraHosts, "host.docker.internal:host-gateway") {
		t.Errorf("extra hosts = %v", hc.ExtraHosts)
	}
	if len(hc.DeviceRequests) != 0 {
		t.Errorf("device requests without GPUs asked: %+v", hc.DeviceRequests)
	}
	for _, e := range c.Config.Env {
		if strings.HasPrefix(e, "PATH=") && strings.Contains(e, os.Getenv("HOME")) {
			t.Errorf("manager's PATH leaked into container: %s", e)
		}
	}
	for _, m := range hc.Mounts {
		if strings.Contains(m.Source, "docker.sock") {
			t.Errorf("docker socket mounted without being asked: %+v", m)
		}
	}

	// The files were copied in before start; the output reaches the log.
	var log string
	eventually(t, 10*time.Second, "container output in the log dir", func() bool {
		files, _ := filepath.Glob(filepath.Join(p.opt.LogDir, "p-1-*.log"))
		if len(files) != 1 {
			return false
		}
		b, _ := os.ReadFile(files[0])
		log = string(b)
		return strings.Contains(log, "data-")
	})
	for _, w := range []string{"credential-of-p-1", "x: 1", "-rw-------", "data-readonly"} {
		if !strings.Contains(log, w) {
			t.Errorf("container output lacks %q:\n%s", w, log)
		}
	}

	list, err := p.List(ctx, p.opt.Manager)
	if err != nil || len(list) != 1 || list[0].Name != "p-1" || list[0].State != provider.StateRunning {
		t.Fatalf("List = %+v, %v", list, err)
	}
	if other, _ := p.List(ctx, "another-manager"); len(other) != 0 {
		t.Errorf("another manager sees %d containers", len(other))
	}

	if err := p.Delete(ctx, "p-1"); err != nil {
		t.Fatal(err)
	}
	// The pool reads the output through the provider, also once the
	// container is gone.
	r, err := p.Output(ctx, list[0], 1<<20)
	if err != nil {
		t.Fatalf("output of a removed container: %v", err)
	}
	if b, _ := io.ReadAll(r); !strings.Contains(string(b), "credential-of-p-1") {
		t.Errorf("output read through the provider lacks the agent's lines:\n%s", b)
	}
	r.Close()
	if tr := p.Traits(); tr.Local || !tr.HostGPUs {
		t.Errorf("traits of a local engine's containers: %+v", tr)
	}
	if _, err := p.cli.ContainerInspect(ctx, inst.ID, client.ContainerInspectOptions{}); !cerrdefs.IsNotFound(err) {
		t.Errorf("container still there after Delete: %v", err)
	}
	if filesDir != "" {
		if left, _ := os.ReadDir(filesDir); len(left) != 0 {
			t.Errorf("files left after Delete: %v", left)
		}
	}
	if err := p.Delete(ctx, "p-1"); err != nil {
		t.Errorf("Delete of a missing container: %v", err)
	}
	// The name is free again at once.
	if _, err := p.Create(ctx, spec); err != nil {
		t.Errorf("Create after Delete: %v", err)
	}
}

// Exits are reported as they happen, and AutoRemove leaves nothing.
func TestWatchReportsExit(t *testing.T) {
	p := newProvider(t, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	names := make(chan string, 16)
	p.Watch(ctx, func(n string) { names <- n })
	time.Sleep(200 * time.Millisecond)

	if _, err := p.Create(ctx, sleeper(p, "p-2", "sleep 0.3; exit 3")); err != nil {
		t.Fatal(err)
	}
	seen := 0
	timeout := time.After(15 * time.Second)
	for seen < 2 { // start, then die or destroy
		select {
		case n := <-names:
			if n == "p-2" {
				seen++
			}
		case <-timeout:
			t.Fatalf("saw %d events for p-2, want at least 2", seen)
		}
	}
	eventually(t, 10*time.Second, "the exited container to be removed", func() bool {
		l, err := p.List(ctx, p.opt.Manager)
		return err == nil && len(l) == 0
	})
}

// A container of another manager is never touched, even one labelled
// for the same pool and runner.
func TestForeignContainerLeftAlone(t *testing.T) {
	p := newProvider(t, Options{})
	ctx := context.Background()
	res, err := p.cli.ContainerCreate(ctx, client.ContainerCreateOptions{
		Config: &container.Config{Image: p.opt.Image, Cmd: []string{"sleep", "30"},
			Labels: map[string]string{LabelManager: p.opt.Manager + "-other", LabelPool: "p", LabelRunner: "p-3"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.cli.ContainerRemove(ctx, res.ID, client.ContainerRemoveOptions{Force: true})
	if _, err := p.cli.ContainerStart(ctx, res.ID, client.ContainerStartOptions{}); err != nil {
		t.Fatal(err)
	}

	inst, err := p.Create(ctx, sleeper(p, "p-3", "sleep 30"))
	if err != nil || inst.ID == res.ID {
		t.Errorf("Create = %v, %v; want a container of its own", inst.ID, err)
	}
	if err := p.Delete(ctx, "p-3"); err != nil {
		t.Error(err)
	}
	if l, _ := p.List(ctx, p.opt.Manager); len(l) != 0 {
		t.Errorf("List shows %+v", l)
	}
	if _, err := p.cli.ContainerInspect(ctx, res.ID, client.ContainerInspectOptions{}); err != nil {
		t.Errorf("foreign container was removed: %v", err)
	}
}

// A container left created but never started (a crash between the two)
// is reported as created, not exited: the engine may still carry out a
// start sent before the crash. Create replaces it.
func TestCreatedButNotStartedIsReplaced(t *testing.T) {
	p := newProvider(t, Options{})
	ctx := context.Background()
	id, _, err := p.create(ctx, sleeper(p, "p-4", "sleep 30"))
	if err != nil {
		t.Fatal(err)
	}
	l, err := p.List(ctx, p.opt.Manager)
	if err != nil || len(l) != 1 || l[0].State != provider.StateCreated {
		t.Fatalf("List = %+v, %v; want one created", l, err)
	}
	inst, err := p.Create(ctx, sleeper(p, "p-4", "sleep 30"))
	if err != nil || inst.ID == id {
		t.Fatalf("Create = %v, %v; want a new container", inst.ID, err)
	}
}

// A start whose caller gave up (a drain cancelled it) is carried out by
// the engine all the same: a container that runs after a failed start
// counts as started and is kept, since its agent may have taken a job; one
// that did not start is not.
func TestStartedAnywayIsKept(t *testing.T) {
	p := newProvider(t, Options{})
	ctx := context.Background()
	id, _, err := p.create(ctx, sleeper(p, "p-5", "sleep 30"))
	if err != nil {
		t.Fatal(err)
	}
	if p.startedAnyway(ctx, id) {
		t.Fatalf("a container never started counts as started")
	}
	// The engine carries out the start; the caller's context has ended.
	if _, err := p.cli.ContainerStart(ctx, id, client.ContainerStartOptions{}); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if !p.startedAnyway(cancelled, id) {
		t.Fatalf("a running container whose start was reported failed does not count as started")
	}
	if err := p.start(cancelled, id, "p-5"); err != nil {
		t.Fatalf("start with its answer lost = %v, want nil: the container runs", err)
	}
}

// GPU requests reach the container's HostConfig exactly: all GPUs as
// Count -1, given devices as DeviceIDs, never both. The containers are
// created but not started, since this host may have no GPU.
func TestGPUDeviceRequests(t *testing.T) {
	for _, tc := range []struct {
		name string
		gpus GPUs
		own  []string // the runner's own, from the pool's allocator
		want container.DeviceRequest
	}{
		{"all", GPUs{All: true}, nil, container.DeviceRequest{Driver: "nvidia", Count: -1, Capabilities: [][]string{{"gpu"}}}},
		{"ids", GPUs{IDs: []string{"0", "GPU-8d5e5d0a-3c1b-4f6e-9a57-111111111111"}}, nil, container.DeviceRequest{Driver: "nvidia", DeviceIDs: []string{"0", "GPU-8d5e5d0a-3c1b-4f6e-9a57-111111111111"}, Capabilities: [][]string{{"gpu"}}}},
		{"own", GPUs{}, []string{"GPU-1", "MIG-2"}, container.DeviceRequest{Driver: "nvidia", DeviceIDs: []string{"GPU-1", "MIG-2"}, Capabilities: [][]string{{"gpu"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newProvider(t, Options{GPUs: tc.gpus})
			ctx := context.Background()
			spec := sleeper(p, "p-1", "true")
			spec.GPUs = tc.own
			id, _, err := p.create(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			res, err := p.cli.ContainerInspect(ctx, id, client.ContainerInspectOptions{})
			if err != nil {
				t.Fatal(err)
			}
			got := res.Container.HostConfig.DeviceRequests
			if len(got) != 1 || fmt.Sprintf("%+v", got[0]) != fmt.Sprintf("%+v", tc.want) {
				t.Errorf("device requests = %+v, want [%+v]", got, tc.want)
			}
			// The label is how a restarted manager learns which GPUs
			// the runner holds.
			if l := res.Container.Config.Labels[LabelGPUs]; l != strings.Join(tc.own, ",") {
				t.Errorf("label %s = %q, want %q", LabelGPUs, l, strings.Join(tc.own, ","))
			}
		})
	}
}

// The Docker socket is mounted only when asked for.
func TestDockerSocketOnlyWhenAsked(t *testing.T) {
	var logs bytes.Buffer
	p := newProvider(t, Options{MountDockerSocket: true, Logger: slogTo(&logs)})
	_, hc := p.containerConfig(sleeper(p, "p-1", "true"))
	if len(hc.Mounts) != 1 || hc.Mounts[0].Source != "/var/run/docker.sock" {
		t.Errorf("mounts = %+v", hc.Mounts)
	}
	if !strings.Contains(logs.String(), "Docker socket") {
		t.Errorf("no warning logged: %q", logs.String())
	}
}

// When the event stream breaks, Watch reconnects, asks for what it
// missed, and reports "" so the pool re-reads everything. The engine here
// is a stand-in that drops the first stream.
func TestWatchReconnects(t *testing.T) {
	var (
		mu     sync.Mutex
		calls  int
		sinces []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Api-Version", "1.41")
		if strings.HasSuffix(r.URL.Path, "/_ping") {
			w.Write([]byte("OK"))
			return
		}
		if !strings.HasSuffix(r.URL.Path, "/events") {
			http.NotFound(w, r)
			return
		}
		mu.Lock()
		calls++
		n := calls
		sinces = append(sinces, r.URL.Query().Get("since"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		if n == 1 {
			return // the engine went away
		}
		fmt.Fprintf(w, `{"Type":"container","Action":"die","Actor":{"ID":"abc","Attributes":{"%s":"p-7","exitCode":"0"}},"time":%d,"timeNano":%d}`+"\n", LabelRunner, time.Now().Unix(), time.Now().UnixNano())
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	p := onFakeEngine(t, srv)
	ctx, cancel := context.WithCancel(context.Background())
	names := make(chan string, 8)
	p.Watch(ctx, func(n string) { names <- n })
	var got []string
	timeout := time.After(10 * time.Second)
	for len(got) < 2 {
		select {
		case n := <-names:
			got = append(got, n)
		case <-timeout:
			t.Fatalf("events after reconnect: %q", got)
		}
	}
	cancel()
	p.Close()
	if got[0] != "" || got[1] != "p-7" {
		t.Errorf("events = %q, want a resync (\"\") then p-7", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 2 || sinces[0] == "" || sinces[1] == "" {
		t.Errorf("event stream requests = %d with since %q", calls, sinces)
	}
}

func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func slogTo(w *bytes.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }

// A restarted manager copies an adopted container's output on from where
// the first one stopped: every line once, including those printed while
// no manager ran.
func TestAdoptedOutputCopiedOnce(t *testing.T) {
	logDir := t.TempDir()
	a := newProvider(t, Options{LogDir: logDir})
	ctx := context.Background()
	if _, err := a.Create(ctx, sleeper(a, "p-1", `for i in $(seq 1 30); do echo "line $i"; echo "burst $i"; sleep 0.1; done; sleep 30`)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	a.cancel() // the manager dies: its copy stops mid-stream
	a.wg.Wait()
	time.Sleep(time.Second)
	b, err := New(Options{Client: a.cli, Manager: a.opt.Manager, Pool: a.opt.Pool, LogDir: logDir, Image: a.opt.Image})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	b.Watch(wctx, func(string) {})
	if l, err := b.List(ctx, a.opt.Manager); err != nil || len(l) != 1 {
		t.Fatalf("List = %v, %v", l, err)
	}
	var out string
	eventually(t, 10*time.Second, "all 30 lines", func() bool {
		files, _ := filepath.Glob(filepath.Join(logDir, "p-1-*.log"))
		if len(files) != 1 {
			return false
		}
		data, _ := os.ReadFile(files[0])
		out = string(data)
		return strings.Contains(out, "burst 30\n")
	})
	for i := 1; i <= 30; i++ {
		for _, w := range []string{"line", "burst"} {
			if n := strings.Count(out, fmt.Sprintf("%s %d\n", w, i)); n != 1 {
				t.Errorf("%q copied %d times", fmt.Sprintf("%s %d", w, i), n)
			}
		}
	}
}

// Containers removed while the manager was away (AutoRemove) leave their
// files directories behind: a listing that no Create overlaps removes
// them, however young, so that a drain leaves nothing; one that a Create
// overlaps spares the young ones, which may be that Create's.
func TestStaleFilesRemovedByQuietListing(t *testing.T) {
	files := t.TempDir()
	p := newProvider(t, Options{FilesDir: files})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p.Watch(ctx, func(string) {})
	for i := range 3 {
		dir := filepath.Join(files, fmt.Sprintf("%s-p-%d-gone%d", p.opt.Manager, i, i))
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, ".runner"), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	p.creating.Add(1) // a Create under way
	if _, err := p.List(ctx, p.opt.Manager); err != nil {
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(files); len(left) != 3 {
		t.Fatalf("%d directories left while a Create ran, want the 3 young ones spared", len(left))
	}
	p.creating.Add(-1)
	if _, err := p.List(ctx, p.opt.Manager); err != nil {
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(files); len(left) != 0 {
		t.Fatalf("%d stale files directories left after a quiet listing", len(left))
	}
}

// An engine that accepts connections and never answers must not hang the
// pool: every request has a deadline, and the error says what timed out.
func TestHangingEngineTimesOut(t *testing.T) {
	cli, err := client.New(client.WithHost("tcp://"+stall.Listen(t)), client.WithAPIVersion("1.41"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{Client: cli, Manager: "m", Pool: "p", Image: "img", Pull: "never", CallTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := context.Background()
	calls := map[string]func() error{
		"list": func() error { _, err := p.List(ctx, "m"); return err },
		"create": func() error {
			_, err := p.Create(ctx, provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "true"})
			return err
		},
		"delete": func() error { return p.Delete(ctx, "p-1") },
	}
	for name, call := range calls {
		start := time.Now()
		err := call()
		took := time.Since(start)
		if err == nil || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s against a hanging engine: %v, want a deadline error", name, err)
		}
		if took > 5*time.Second {
			t.Errorf("%s took %s against a hanging engine", name, took)
		}
	}
}

// Two pools of one manager, one named as the other's prefix: each prunes
// only its own containers' files, never those of the other's running
// containers, and each leaves no directory once closed.
func TestPoolsPruneOnlyTheirOwnFiles(t *testing.T) {
	_, img := engine(t)
	state := t.TempDir()
	manager := fmt.Sprintf("t%d", time.Now().UnixNano())
	open := func(pool string) *Provider {
		section, _ := json.Marshal(map[string]any{"image": img})
		pr, err := driver{}.Open(t.Context(), provider.PoolConfig{Manager: manager, Pool: pool, StateDir: state, Section: section})
		if err != nil {
			t.Fatal(err)
		}
		p := pr.(*Provider)
		t.Cleanup(func() {
			if cs, err := p.containers(context.Background(), manager, ""); err == nil {
				for _, c := range cs {
					_ = p.removeContainer(context.Background(), c.ID, containerNameOf(c))
				}
			}
		})
		return p
	}
	a, ab := open("a"), open("a-b")
	actx, acancel := context.WithCancel(context.Background())
	defer acancel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a.Watch(actx, func(string) {})
	ab.Watch(ctx, func(string) {})
	if _, err := ab.Create(ctx, sleeper(ab, "a-b-1", "sleep 60")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.List(ctx, manager); err != nil { // quiet: prunes what it takes for gone
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(ab.opt.FilesDir); len(left) != 1 {
		t.Fatalf("pool a-b's running container has %d files directories after pool a's listing, want 1", len(left))
	}
	acancel()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ab.Delete(ctx, "a-b-1"); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := ab.Close(); err != nil {
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(filepath.Join(state, "docker")); len(left) != 0 {
		t.Fatalf("%d entries left in the files directory after both pools closed", len(left))
	}
}

// An agent that exits is removed by the engine (AutoRemove), which List
// counts as gone at once; Close waits for the engine to finish and takes
// the container's files, so that a drain that ends just then leaves
// neither.
func TestCloseWaitsForAutoRemoval(t *testing.T) {
	files := t.TempDir()
	p := newProvider(t, Options{FilesDir: filepath.Join(files, "p")})
	ctx, cancel := context.WithCancel(context.Background())
	p.Watch(ctx, func(string) {})
	if _, err := p.Create(ctx, sleeper(p, "p-1", "sleep 0.2")); err != nil {
		t.Fatal(err)
	}
	// Until the pool would no longer see it: being removed, or gone.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		insts, err := p.List(ctx, p.opt.Manager)
		if err != nil {
			t.Fatal(err)
		}
		if len(insts) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the exited container still listed: %+v", insts)
		}
	}
	cancel()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if cs, _ := p.containers(context.Background(), p.opt.Manager, ""); len(cs) != 0 {
		t.Errorf("%d containers left after Close", len(cs))
	}
	if left, _ := os.ReadDir(files); len(left) != 0 {
		t.Errorf("%d entries left in the files directory after Close", len(left))
	}
}

// The engine can fail a removal with the container's files half gone
// ("unable to remove filesystem for <id>: ... directory not empty": moby's
// daemon/delete.go marks the container dead, SetRemovalError), as seen
// after a live-restore restart; the removal is asked again a moment later
// and takes. Nothing else is retried: a container that is not there is
// removed already.
func TestRemovalRetriedAfterEngineFailure(t *testing.T) {
	var deletes atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Api-Version", "1.41")
		switch {
		case strings.HasSuffix(r.URL.Path, "/_ping"):
			w.Write([]byte("OK"))
		case r.Method == http.MethodDelete && strings.Contains(r.URL.Path, "/containers/"):
			w.Header().Set("Content-Type", "application/json")
			if deletes.Add(1) == 1 {
				w.WriteHeader(http.StatusInternalServerError)
				fmt.Fprint(w, `{"message":"unable to remove filesystem for d532dfbf490f: unlinkat /var/lib/docker/containers/d532dfbf490f: directory not empty"}`)
				return
			}
			w.WriteHeader(http.StatusNoContent)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	p := onFakeEngine(t, srv)
	defer p.Close()
	if err := p.removeContainer(context.Background(), "d532dfbf490f", "m-p-1-x"); err != nil || deletes.Load() != 2 {
		t.Fatalf("remove: %v after %d requests, want it removed at the second", err, deletes.Load())
	}
}

// onFakeEngine is pool p's provider of manager m on a fake engine.
func onFakeEngine(t *testing.T, srv *httptest.Server) *Provider {
	t.Helper()
	cli, err := client.New(client.WithHost("tcp://"+strings.TrimPrefix(srv.URL, "http://")), client.WithAPIVersion("1.41"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{Client: cli, Manager: "m", Pool: "p"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// An engine on this host with NVIDIA's runtime: the record's system names
// the container toolkit's version, as nvidia-ctk on this host says it;
// an engine elsewhere, whose toolkit is not this host's, names none.
func TestEngineSystemNamesTheToolkit(t *testing.T) {
	dir := t.TempDir()
	script := "#!/bin/sh\necho 'NVIDIA Container Toolkit CLI version 1.17.4'\n"
	if err := os.WriteFile(filepath.Join(dir, "nvidia-ctk"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	for _, host := range []string{provider.Hostname(), "gpu-box-elsewhere"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Api-Version", "1.41")
			switch {
			case strings.HasSuffix(r.URL.Path, "/_ping"):
				w.Write([]byte("OK"))
			case strings.HasSuffix(r.URL.Path, "/info"):
				w.Header().Set("Content-Type", "application/json")
				fmt.Fprintf(w, `{"Name":%q,"ServerVersion":"28.2.2","OperatingSystem":"Ubuntu 24.04.1 LTS","KernelVersion":"6.8.0-45-generic","NCPU":64,"MemTotal":270000000000,"Runtimes":{"runc":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"}}}`, host)
			default:
				http.NotFound(w, r)
			}
		}))
		p := onFakeEngine(t, srv)
		p.liveRestore(t.Context())
		p.mu.Lock()
		sys := p.engineSystem
		p.mu.Unlock()
		want := ""
		if host == provider.Hostname() {
			want = "1.17.4"
		}
		if sys == nil || sys.NvidiaToolkit != want || sys.Runtime != "Docker Engine 28.2.2" || !slices.Contains(sys.Runtimes, "nvidia") {
			t.Errorf("engine on %s: system %+v, want the toolkit %q", host, sys, want)
		}
		p.Close()
		srv.Close()
	}
}
