package manager

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// A forge that cannot be reached at start is reported clearly and retried
// with growing backoff; the manager neither crashes nor spins, and exits
// cleanly on SIGTERM.
func TestUnreachableForgeRetriesWithBackoff(t *testing.T) {
	harness.NeedBinary(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now

	dir := t.TempDir()
	cfg := filepath.Join(dir, "fleet.yaml")
	os.WriteFile(cfg, []byte(`state_dir: `+filepath.Join(dir, "state")+`
forges:
  - {name: down, type: gitea, url: "http://`+addr+`", token: "${TOK}", repo: a/b}
pools:
  - {name: p, labels: [x], size: 1, agent: {path: /bin/true}}
`), 0o600)
	logPath := filepath.Join(dir, "log")
	logf, _ := os.Create(logPath)
	cmd := exec.Command(harness.FleetBin, "serve", "-c", cfg)
	cmd.Env = append(os.Environ(), "TOK=unreachable-secret-token")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		b, _ := os.ReadFile(logPath)
		t.Fatalf("manager exited (%v) instead of retrying:\n%s", err, b)
	case <-time.After(8 * time.Second):
	}
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v", err)
		}
	case <-time.After(15 * time.Second):
		cmd.Process.Kill()
		t.Fatal("manager did not exit after SIGTERM")
	}
	b, _ := os.ReadFile(logPath)
	log := string(b)
	if !strings.Contains(log, "connection refused") || !strings.Contains(log, addr) {
		t.Errorf("log does not say the forge at %s refused the connection:\n%s", addr, log)
	}
	// The pool's passes and the queue's polls back off alike, each on
	// its own.
	for _, what := range []string{"reconcile failed", "poll of queued jobs failed"} {
		retries := regexp.MustCompile(`msg="`+what+`".*retry_in=(\d+s)`).FindAllStringSubmatch(log, -1)
		var got []string
		for _, r := range retries {
			got = append(got, r[1])
		}
		// 8 seconds: tries at 0, 1, 3, 7 — each wait doubles, no tight loop.
		if len(got) < 3 || len(got) > 5 || got[0] != "1s" || got[1] != "2s" || got[2] != "4s" {
			t.Errorf("%s: retry waits = %v, want 1s, 2s, 4s, ...", what, got)
		}
	}
	if strings.Contains(log, "unreachable-secret-token") {
		t.Error("token in the log")
	}
}

// A bad config starts nothing and exits 2 with an error naming the field.
func TestBadConfigStartsNothing(t *testing.T) {
	harness.NeedBinary(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "fleet.yaml")
	state := filepath.Join(dir, "state")
	os.WriteFile(cfg, []byte(`state_dir: `+state+`
forges:
  - {name: g, type: gitea, url: "http://127.0.0.1:1", token: t, repo: a/b}
pools:
  - {name: p, labels: [x], size: 3, max: 2}
`), 0o600)
	out, err := exec.Command(harness.FleetBin, "serve", "-c", cfg).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("exit = %v, want 2\n%s", err, out)
	}
	if !strings.Contains(string(out), "pools[0].max: 2 is less than size 3") {
		t.Errorf("error does not name the field:\n%s", out)
	}
	if _, err := os.Stat(state); !os.IsNotExist(err) {
		t.Errorf("a bad config created %s", state)
	}
}
