package manager

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// deploy/systemd's unit and its Docker drop-in pass systemd's own check
// without a warning, and keep their promises: reload is SIGHUP, stop is
// a drain (SIGTERM to runfleet alone, for longer than the default
// drain_timeout), and the sandbox is on.
func TestSystemdUnit(t *testing.T) {
	harness.NeedBinaries(t)
	analyze, err := exec.LookPath("systemd-analyze")
	peers.Need(t, "systemd-analyze (Debian's systemd)", err)

	dir := filepath.Join(harness.RepoRoot(), "deploy", "systemd")
	unit, err := os.ReadFile(filepath.Join(dir, "runfleet.service"))
	if err != nil {
		t.Fatal(err)
	}
	dropIn, err := os.ReadFile(filepath.Join(dir, "runfleet.service.d", "docker.conf"))
	if err != nil {
		t.Fatal(err)
	}
	// verify wants ExecStart's program to exist: the unit as installed,
	// with the binary where this test built it.
	tmp := t.TempDir()
	installed := strings.ReplaceAll(string(unit), "/usr/local/bin/runfleet", harness.FleetBin)
	if err := os.WriteFile(filepath.Join(tmp, "runfleet.service"), []byte(installed), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(tmp, "runfleet.service.d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, "runfleet.service.d", "docker.conf"), dropIn, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(analyze, "verify", filepath.Join(tmp, "runfleet.service"))
	cmd.Env = append(os.Environ(), "SYSTEMD_UNIT_PATH="+tmp+":") // the drop-in too
	out, err := cmd.CombinedOutput()
	// verify exits 0 on an unknown key or a bad value, with a warning.
	if err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
	t.Logf("systemd-analyze verify runfleet.service (with docker.conf): no warning")

	keys := unitKeys(string(unit))
	for k, want := range map[string]string{
		"ExecReload": "/bin/kill -HUP $MAINPID", "KillSignal": "SIGTERM", "KillMode": "process",
		"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes", "User": "runfleet",
	} {
		if keys[k] != want {
			t.Errorf("%s=%q, want %q", k, keys[k], want)
		}
	}
	if strings.Contains(string(unit), "SupplementaryGroups") || !strings.Contains(string(dropIn), "SupplementaryGroups=docker") {
		t.Error("the Docker socket's group belongs in the drop-in only")
	}
	stop, err := time.ParseDuration(strings.TrimSuffix(keys["TimeoutStopSec"], "in")) // 31min -> 31m
	if err != nil || stop <= config.DefaultDrainTimeout {
		t.Errorf("TimeoutStopSec=%s: not above the default drain_timeout %s", keys["TimeoutStopSec"], config.DefaultDrainTimeout)
	}
	if !regexp.MustCompile(`(?m)^ExecStart=/usr/local/bin/runfleet serve -c /etc/runfleet/fleet.yaml$`).Match(unit) {
		t.Error("ExecStart does not run serve with /etc/runfleet/fleet.yaml")
	}
}

// unitKeys reads a unit's Key=Value lines (the last of a key wins, as in
// systemd).
func unitKeys(unit string) map[string]string {
	keys := map[string]string{}
	for line := range strings.SplitSeq(unit, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			keys[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	return keys
}
