// Package peers builds and starts the real programs runfleet works with,
// not stand-ins: Gitea and gitea-runner, and a Kubernetes control plane
// (kube-apiserver, kube-scheduler, etcd, kwok), for the demo and the
// end-to-end tests. Builds come from the Go module proxy at pinned
// versions and are cached outside any checkout, keyed by version, so they
// are slow only once per machine; a lock per cached build lets test
// packages running side by side ask for the same peer at once.
package peers

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Pinned versions (see DESIGN.md: 1.27 needs modules the proxy refuses).
const (
	GiteaVersion  = "1.26.0"
	RunnerVersion = "v1.0.8"
)

// CacheDir is where built peers are kept: $RUNFLEET_CACHE, or runfleet in
// the user's cache directory.
func CacheDir() string {
	if d := os.Getenv("RUNFLEET_CACHE"); d != "" {
		return d
	}
	d, err := os.UserCacheDir()
	if err != nil {
		d = os.TempDir()
	}
	return filepath.Join(d, "runfleet")
}

// GiteaBinary returns the path of a Gitea build, building it on first use
// (about 6 minutes on two cores). Progress goes to w.
func GiteaBinary(ctx context.Context, w io.Writer) (string, error) {
	return cached(ctx, w, "gitea-"+GiteaVersion, "gitea", func(ctx context.Context, out string) error {
		dir, err := ModuleDir(ctx, "code.gitea.io/gitea@v"+GiteaVersion)
		if err != nil {
			return err
		}
		// Gitea's go.mod has replace directives, which `go install`
		// refuses; building inside the module directory honours them.
		return goCmd(ctx, w, dir, []string{"CGO_ENABLED=1"},
			"build", "-v", "-tags", "sqlite sqlite_unlock_notify", "-o", out, ".")
	})
}

// RunnerBinary returns the path of a gitea-runner build, building it on
// first use (about 80 seconds).
func RunnerBinary(ctx context.Context, w io.Writer) (string, error) {
	return cached(ctx, w, "gitea-runner-"+RunnerVersion, "gitea-runner", func(ctx context.Context, out string) error {
		// `go install module@version` needs the version list, which the
		// proxy refuses for this module: build through a wrapper module.
		dir, err := os.MkdirTemp("", "runfleet-runner-build-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		files := map[string]string{
			"go.mod":   "module runfleetpeer\n\ngo 1.26\n",
			"tools.go": "//go:build tools\n\npackage tools\n\nimport _ \"gitea.com/gitea/runner\"\n",
		}
		for name, content := range files {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
				return err
			}
		}
		if err := goCmd(ctx, w, dir, nil, "get", "gitea.com/gitea/runner@"+RunnerVersion); err != nil {
			return err
		}
		return goCmd(ctx, w, dir, []string{"CGO_ENABLED=0"}, "build", "-v", "-o", out, "gitea.com/gitea/runner")
	})
}

// ModuleDir downloads a module and returns its directory in the module
// cache.
func ModuleDir(ctx context.Context, modVersion string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", modVersion)
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	out, err := cmd.Output()
	var info struct{ Dir, Error string }
	_ = json.Unmarshal(out, &info)
	if err != nil || info.Dir == "" {
		return "", fmt.Errorf("download %s: %v %s", modVersion, err, info.Error)
	}
	return info.Dir, nil
}

// cached returns dir/name under the cache, running build to make it when
// absent. A file lock keeps parallel test packages from building twice.
func cached(ctx context.Context, w io.Writer, dir, name string, build func(ctx context.Context, out string) error) (string, error) {
	if w == nil {
		w = io.Discard
	}
	d := filepath.Join(CacheDir(), dir)
	bin := filepath.Join(d, name)
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	unlock, err := lock(filepath.Join(d, ".lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(bin); err == nil {
		return bin, nil // built by another process while we waited
	}

	start := time.Now()
	fmt.Fprintf(w, "building %s into %s (first use only; cached afterwards)\n", dir, d)
	stop := make(chan struct{})
	go func() { // a heartbeat, so a long build never looks hung
		t := time.NewTicker(15 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				fmt.Fprintf(w, "  still building %s (%s)\n", dir, time.Since(start).Round(time.Second))
			}
		}
	}()
	tmp := bin + ".tmp"
	err = build(ctx, tmp)
	close(stop)
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("build %s: %w", dir, err)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", err
	}
	fmt.Fprintf(w, "built %s in %s\n", dir, time.Since(start).Round(time.Second))
	return bin, nil
}

// lock takes an exclusive lock on the file at path, made with its
// directory if need be, and returns its release. Test packages run as
// separate processes side by side, so the lock is the kernel's (flock),
// released also when a process dies holding it.
func lock(path string) (func(), error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil // closing the file releases the lock
}

// goCmd runs the go tool, showing the packages it compiles as progress.
func goCmd(ctx context.Context, w io.Writer, dir string, env []string, args ...string) error {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "GOFLAGS=-mod=mod"), env...)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var tail []string
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		n := 0
		for sc.Scan() {
			line := sc.Text()
			tail = append(tail, line)
			if len(tail) > 30 {
				tail = tail[1:]
			}
			// -v names every package: show every 50th to keep it short.
			if n++; n%50 == 0 || strings.Contains(line, "error") {
				fmt.Fprintf(w, "  [%d packages] %s\n", n, line)
			}
		}
	}()
	err := cmd.Run()
	pw.Close()
	<-done
	if err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, strings.Join(tail, "\n"))
	}
	return nil
}

// HelmVersion is the Helm whose `lint` and `template` check the chart.
const HelmVersion = "v3.22.0"

// HelmBinary returns the path of a helm build, building it on first use
// (about 2 minutes on two cores).
func HelmBinary(ctx context.Context, w io.Writer) (string, error) {
	return cached(ctx, w, "helm-"+HelmVersion, "helm", func(ctx context.Context, out string) error {
		dir, err := os.MkdirTemp("", "runfleet-helm-build-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if err := goCmd(ctx, w, dir, []string{"CGO_ENABLED=0", "GOBIN=" + dir}, "install", "-v", "helm.sh/helm/v3/cmd/helm@"+HelmVersion); err != nil {
			return err
		}
		return os.Rename(filepath.Join(dir, "helm"), out)
	})
}
