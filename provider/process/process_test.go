package process

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/runfleet/runfleet/provider"
)

func newProvider(t *testing.T, dir string) *Provider {
	t.Helper()
	p, err := New(Options{StateDir: filepath.Join(dir, "state"), WorkRoot: filepath.Join(dir, "work"), StopTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func sh(name, script string) provider.Spec {
	return provider.Spec{
		Name: name, Manager: "m", Pool: "p", Command: "/bin/sh", Args: []string{"-c", script},
		Env:   map[string]string{"PATH": "/usr/bin:/bin", "POOL_VAR": "x"},
		Files: map[string][]byte{".runner": []byte("own-credential"), "sub/cfg.yaml": []byte("a: 1")},
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRunsInFreshDirWithOnlyGivenEnv(t *testing.T) {
	t.Setenv("MANAGER_SECRET", "must-not-leak")
	p := newProvider(t, t.TempDir())
	ctx := context.Background()
	in, err := p.Create(ctx, sh("p-1", `env > env.txt; pwd > pwd.txt; ls -la > ls.txt; sleep 30`))
	if err != nil {
		t.Fatal(err)
	}
	if in.State != provider.StateRunning {
		t.Fatalf("state %s", in.State)
	}
	rec, _ := p.readRecord("p-1")
	waitFor(t, "env.txt", func() bool {
		b, _ := os.ReadFile(filepath.Join(rec.Workdir, "env.txt"))
		return len(b) > 0
	})
	env, _ := os.ReadFile(filepath.Join(rec.Workdir, "env.txt"))
	if strings.Contains(string(env), "MANAGER_SECRET") {
		t.Errorf("manager environment leaked into the runner:\n%s", env)
	}
	for _, want := range []string{"POOL_VAR=x", "HOME=" + rec.Workdir, "TMPDIR=" + filepath.Join(rec.Workdir, "tmp")} {
		if !strings.Contains(string(env), want) {
			t.Errorf("runner env lacks %s:\n%s", want, env)
		}
	}
	for _, f := range []string{".runner", "sub/cfg.yaml"} {
		st, err := os.Stat(filepath.Join(rec.Workdir, f))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", f, st.Mode().Perm())
		}
	}
	// Its own process group.
	if pgid, _ := unix.Getpgid(rec.PID); pgid != rec.PID {
		t.Errorf("pgid %d, want %d", pgid, rec.PID)
	}
	// Idempotent by name.
	again, err := p.Create(ctx, sh("p-1", "exit 0"))
	if err != nil || again.ID != in.ID {
		t.Fatalf("second Create = %v, %v; want the running instance %s", again, err, in.ID)
	}
	if err := p.Delete(ctx, "p-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(rec.Workdir); !os.IsNotExist(err) {
		t.Errorf("workdir left: %v", err)
	}
	if alive(rec) {
		t.Errorf("process still alive after Delete")
	}
	if l, _ := p.List(ctx, "m"); len(l) != 0 {
		t.Errorf("List after Delete = %v", l)
	}
}

func TestExitIsReportedAndJobLeftoversKilled(t *testing.T) {
	p := newProvider(t, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	exited := make(chan string, 4)
	p.Watch(ctx, func(name string) { exited <- name })
	// The "job" leaves a background process behind in the group.
	if _, err := p.Create(ctx, sh("p-1", `sleep 300 & echo $! > bg.pid; sleep 0.2`)); err != nil {
		t.Fatal(err)
	}
	rec, _ := p.readRecord("p-1")
	select {
	case name := <-exited:
		if name != "p-1" {
			t.Fatalf("exit reported for %q", name)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("exit not reported")
	}
	b, _ := os.ReadFile(filepath.Join(rec.Workdir, "bg.pid"))
	var bg int
	if _, err := fmtSscan(strings.TrimSpace(string(b)), &bg); err != nil {
		t.Fatalf("bg.pid: %q", b)
	}
	waitFor(t, "leftover job process killed", func() bool { return !alive(record{PID: bg}) })
	l, _ := p.List(ctx, "m")
	if len(l) != 1 || l[0].State != provider.StateExited {
		t.Fatalf("List = %+v, want p-1 exited", l)
	}
	if err := p.Delete(ctx, "p-1"); err != nil {
		t.Fatal(err)
	}
}

// A new provider over the same state (a restarted manager) adopts a live
// runner, reports its exit and can stop it.
func TestAdoptsAfterRestart(t *testing.T) {
	dir := t.TempDir()
	first := newProvider(t, dir)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, n := range []string{"p-1", "p-2"} {
		if _, err := first.Create(ctx, sh(n, "sleep 300")); err != nil {
			t.Fatal(err)
		}
	}
	second := newProvider(t, dir)
	exited := make(chan string, 4)
	second.Watch(ctx, func(name string) { exited <- name })
	l, err := second.List(ctx, "m")
	if err != nil {
		t.Fatal(err)
	}
	if len(l) != 2 || l[0].State != provider.StateRunning || l[1].State != provider.StateRunning {
		t.Fatalf("adopted = %+v", l)
	}
	if other, _ := second.List(ctx, "another-manager"); len(other) != 0 {
		t.Fatalf("another manager sees %v", other)
	}
	rec, _ := second.readRecord("p-1")
	unix.Kill(rec.PID, unix.SIGKILL)
	select {
	case name := <-exited:
		if name != "p-1" {
			t.Fatalf("exit reported for %q", name)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("exit of an adopted runner not reported")
	}
	for _, n := range []string{"p-1", "p-2"} {
		if err := second.Delete(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	if l, _ := second.List(ctx, "m"); len(l) != 0 {
		t.Fatalf("left: %v", l)
	}
}

// A recorded pid now used by an unrelated process is not the runner.
func TestRecycledPIDIsNotAlive(t *testing.T) {
	p := newProvider(t, t.TempDir())
	self := os.Getpid()
	st, err := startTicks(self)
	if err != nil {
		t.Fatal(err)
	}
	work := filepath.Join(p.opt.WorkRoot, "p-9.abc")
	os.MkdirAll(work, 0o700)
	if err := p.writeRecord(record{Name: "p-9", Manager: "m", Pool: "p", PID: self, Start: st + 1, Workdir: work}); err != nil {
		t.Fatal(err)
	}
	l, _ := p.List(context.Background(), "m")
	if len(l) != 1 || l[0].State != provider.StateExited {
		t.Fatalf("List = %+v, want exited", l)
	}
	if err := p.Delete(context.Background(), "p-9"); err != nil {
		t.Fatal(err)
	}
	// The test process, whose pid the record named, is unharmed.
	if _, err := os.Stat(work); !os.IsNotExist(err) {
		t.Fatalf("workdir not removed")
	}
}

func TestRemoveWorkdirRefusesOutsideRoot(t *testing.T) {
	root := t.TempDir()
	for _, dir := range []string{"/", root, filepath.Join(root, ".."), filepath.Join(root, "a", "b"), "/etc"} {
		if err := removeWorkdir(dir, root); err == nil {
			t.Errorf("removeWorkdir(%q) was allowed", dir)
		}
	}
}

func fmtSscan(s string, v *int) (int, error) { return fmt.Sscan(s, v) }

// A runner's GPUs reach its agent (and so its jobs) by UUID, and come
// back from List after a restart, from the record.
func TestGPUsInEnvironmentAndRecord(t *testing.T) {
	dir := t.TempDir()
	p := newProvider(t, dir)
	ctx := context.Background()
	spec := sh("p-1", `env > env.txt; sleep 30`)
	spec.GPUs = []string{"GPU-aaaa", "MIG-bbbb"}
	if _, err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, "p-1")
	rec, _ := p.readRecord("p-1")
	var env string
	waitFor(t, "env.txt", func() bool {
		b, _ := os.ReadFile(filepath.Join(rec.Workdir, "env.txt"))
		env = string(b)
		return strings.Contains(env, "PATH=")
	})
	for _, want := range []string{"CUDA_VISIBLE_DEVICES=GPU-aaaa,MIG-bbbb\n", "NVIDIA_VISIBLE_DEVICES=GPU-aaaa,MIG-bbbb\n", "CUDA_DEVICE_ORDER=PCI_BUS_ID\n"} {
		if !strings.Contains(env, want) {
			t.Errorf("agent environment lacks %q:\n%s", want, env)
		}
	}
	list, err := newProvider(t, dir).List(ctx, "m") // a restarted manager
	if err != nil || len(list) != 1 || fmt.Sprint(list[0].GPUs) != "[GPU-aaaa MIG-bbbb]" {
		t.Fatalf("List: %+v, %v", list, err)
	}
}

// A reconcile pass lists runners while others are being created: neither
// may fail, and a runner being created is not reported as exited.
func TestListDuringCreate(t *testing.T) {
	p := newProvider(t, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	listErr := make(chan error, 1)
	go func() {
		defer close(listErr)
		for ctx.Err() == nil {
			ins, err := p.List(ctx, "m")
			if err != nil {
				listErr <- err
				return
			}
			for _, in := range ins {
				if in.State != provider.StateRunning {
					listErr <- fmt.Errorf("%s listed %s while alive", in.Name, in.State)
					return
				}
			}
		}
	}()
	for i := range 40 {
		name := fmt.Sprintf("p-%d", i)
		if _, err := p.Create(ctx, sh(name, "sleep 30")); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
	}
	cancel()
	if err := <-listErr; err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		if err := p.Delete(context.Background(), fmt.Sprintf("p-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	left, _ := filepath.Glob(filepath.Join(p.recordDir(), "*"))
	if len(left) != 0 {
		t.Fatalf("records left: %v", left)
	}
}

// A record that goes between the listing of the directory and its reading
// (its runner just ended) is no warning; a record that cannot be read is.
func TestVanishedRecordIsNoWarning(t *testing.T) {
	var logs strings.Builder
	dir := t.TempDir()
	p, err := New(Options{StateDir: filepath.Join(dir, "state"), WorkRoot: filepath.Join(dir, "work"), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	// A dangling link reads as a file removed after the listing.
	if err := os.Symlink(filepath.Join(dir, "gone.json"), p.recordPath("p-1")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.List(context.Background(), "m"); err != nil {
		t.Fatal(err)
	}
	if logs.Len() != 0 {
		t.Fatalf("a vanished record was logged: %s", logs.String())
	}
	if err := os.WriteFile(p.recordPath("p-2"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := p.List(context.Background(), "m"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "unreadable runner record") {
		t.Fatalf("a corrupt record was not logged: %q", logs.String())
	}
}

// A manager killed at any moment of a Create or Delete must leave nothing
// that no record names: a working directory is made only after the record
// that names it is written, and removed before it. A watcher checks that
// every directory under the work root is named by a record while runners
// come and go.
func TestEveryWorkdirIsNamedByARecord(t *testing.T) {
	p := newProvider(t, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	unnamed := make(chan string, 1)
	go func() {
		defer close(unnamed)
		for ctx.Err() == nil {
			dirs, _ := os.ReadDir(p.opt.WorkRoot)
			named := map[string]bool{}
			recs, _ := os.ReadDir(p.recordDir())
			for _, e := range recs {
				if name, ok := strings.CutSuffix(e.Name(), ".json"); ok {
					if rec, err := p.readRecord(name); err == nil {
						named[rec.Workdir] = true
					}
				}
			}
			for _, d := range dirs {
				path := filepath.Join(p.opt.WorkRoot, d.Name())
				if named[path] {
					continue
				}
				// Still there after the records were read: no record
				// names it (a Delete removes the directory first).
				if _, err := os.Stat(path); err == nil {
					unnamed <- d.Name()
					return
				}
			}
		}
	}()
	for i := range 200 {
		name := fmt.Sprintf("p-%d", i%4)
		if _, err := p.Create(ctx, sh(name, "exit 0")); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		if err := p.Delete(ctx, name); err != nil {
			t.Fatalf("delete %s: %v", name, err)
		}
	}
	cancel()
	if d, ok := <-unnamed; ok {
		t.Fatalf("working directory %s existed with no record naming it: a crash then would leak it", d)
	}
}
