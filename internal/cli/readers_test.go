package cli

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/internal/daemon"
)

// readerConfig writes a config of a pool of host processes on a forge
// nothing listens at, with its state directory in dir, and an agent that
// is on no PATH.
func readerConfig(t *testing.T, dir string) string {
	t.Helper()
	cfg := "id: lab\nstate_dir: " + filepath.Join(dir, "state") + `
forges:
  - name: lab
    type: gitea
    url: ` + closedURL(t) + `
    token: abc
    repo: ml/models
pools:
  - name: cpu
    labels: [linux]
    size: 1
    agent:
      path: no-such-gitea-runner
`
	p := filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// `status` reads, and only reads: it makes no directory, needs no agent
// on this host, and exits 1 for a forge it cannot read whichever the
// output, saying so once. Before, it made state_dir/{process,logs,work},
// refused to run without the agent, and exited 0 with -o json.
func TestStatusReadsOnly(t *testing.T) {
	dir := t.TempDir()
	cfg := readerConfig(t, dir)
	for _, out := range []string{"table", "json"} {
		var buf bytes.Buffer
		code := Main([]string{"status", "-c", cfg, "-o", out}, &buf, &buf)
		if code != ExitFailure || !strings.Contains(buf.String(), "connection refused") {
			t.Errorf("-o %s: exit %d, want 1 with the forge's error:\n%s", out, code, buf.String())
		}
		if strings.Contains(buf.String(), "pool cpu: pool cpu") || strings.Contains(buf.String(), "agent.path") {
			t.Errorf("-o %s:\n%s", out, buf.String())
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "state")); !os.IsNotExist(err) {
		t.Errorf("status made the state directory: %v", err)
	}
}

// `gc` that could not read a forge says nothing reassuring and exits 1,
// in either output.
func TestGCIncompleteListing(t *testing.T) {
	dir := t.TempDir()
	cfg := readerConfig(t, dir)
	var buf bytes.Buffer
	if code := Main([]string{"gc", "-c", cfg}, &buf, &buf); code != ExitFailure || strings.Contains(buf.String(), "left nothing") ||
		!strings.Contains(buf.String(), "could not list everything") {
		t.Errorf("gc against an unreachable forge: exit %d:\n%s", code, buf.String())
	}
	buf.Reset()
	var stdout bytes.Buffer
	code := Main([]string{"gc", "-c", cfg, "-o", "json"}, &stdout, &buf)
	var rep GCReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil || code != ExitFailure || rep.Complete || rep.Leftovers == nil || len(rep.Errors) == 0 {
		t.Errorf("gc -o json: exit %d, %+v %v:\n%s", code, rep, err, stdout.String())
	}
	if _, err := os.Stat(filepath.Join(dir, "state")); !os.IsNotExist(err) {
		t.Errorf("gc made the state directory: %v", err)
	}
}

// An empty history is [] in JSON, as no history is: never null.
func TestJobsEmptyIsAList(t *testing.T) {
	path := filepath.Join(t.TempDir(), "history.db")
	s, err := history.Open(path, history.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	for _, p := range []string{path, filepath.Join(t.TempDir(), "none.db")} {
		var out bytes.Buffer
		if code := Main([]string{"jobs", "-c", jobsConfig(t, p), "-o", "json"}, &out, &out); code != 0 || strings.TrimSpace(out.String()) != "[]" {
			t.Errorf("%s: exit %d: %q", p, code, out.String())
		}
	}
}

// The status page is served at the default address with the README's
// first config (no listen: nothing was served before); should another
// program hold that default, serve goes on without it, while an address
// the config names and cannot have starts nothing.
func TestStatusPageByDefault(t *testing.T) {
	cfgPath := readerConfig(t, t.TempDir())
	cfg, err := loadConfig(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.StatusListen != config.DefaultStatusListen || cfg.StatusListenGiven {
		t.Fatalf("status_listen %q (given %v), want the default", cfg.StatusListen, cfg.StatusListenGiven)
	}
	fleet, err := daemon.Inspect(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer fleet.Close()
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))

	// Free: served.
	free := closedURL(t)
	cfg.StatusListen = strings.TrimPrefix(free, "http://")
	servers, err := startServers(fleet, log)
	if err != nil || len(servers) != 1 {
		t.Fatalf("a free default address: %d servers, %v", len(servers), err)
	}
	if code, _ := httpGet(t, free+"/healthz"); code != 200 {
		t.Errorf("/healthz on the default address answered %d", code)
	}
	servers[0].Close()

	// Held, as the default: no page, and a warning.
	cfg.StatusListen = held.Addr().String()
	servers, err = startServers(fleet, log)
	if err != nil || len(servers) != 0 || !strings.Contains(logs.String(), "the default address is taken") {
		t.Errorf("a default address held elsewhere: %d servers, %v\n%s", len(servers), err, logs.String())
	}
	// Held, as written: an error.
	cfg.StatusListenGiven = true
	if _, err := startServers(fleet, log); err == nil {
		t.Error("an address the config names and cannot have was let go")
	}
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
