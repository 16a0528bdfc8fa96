// Package release checks what people install: `make release`'s binaries
// are the same whoever builds them where, and a build from a checkout
// knows its version.
package release

import (
	"bytes"
	"debug/elf"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/peers"
)

func root(t *testing.T) string {
	t.Helper()
	r, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func need(t *testing.T, tools ...string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds runfleet: skipped with -short")
	}
	for _, tool := range tools {
		_, err := exec.LookPath(tool)
		peers.Need(t, tool, err)
	}
}

// Two `make release` runs of one commit, in two directories, give the same
// SHA-256 sums: the static linux/amd64 and linux/arm64 binaries and the
// amd64 one with the NVML reader.
func TestReleaseIsReproducible(t *testing.T) {
	need(t, "make", "git", "gcc", "sha256sum")
	src := root(t)
	// A copy of the tree at another path: -trimpath must leave no trace
	// of where it was built.
	files, err := exec.Command("git", "-C", src, "ls-files", "-co", "--exclude-standard", "-z").Output()
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(t.TempDir(), "elsewhere", "runfleet")
	for f := range strings.SplitSeq(strings.TrimRight(string(files), "\x00"), "\x00") {
		b, err := os.ReadFile(filepath.Join(src, f))
		if os.IsNotExist(err) {
			continue // deleted in the work tree
		} else if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(other, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(other, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The tree copy has no git: the version comes from make's variables,
	// as in a release build from a tarball.
	vars := []string{"VERSION=v0.0.0-reprotest", "COMMIT=0123456789abcdef0123456789abcdef01234567", "DATE=2026-11-26T00:00:00Z"}
	sums := make([]string, 2)
	for i, dir := range []string{src, other} {
		dist := filepath.Join(t.TempDir(), "dist")
		cmd := exec.Command("make", append([]string{"-s", "release", "DIST=" + dist}, vars...)...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("make release in %s: %v\n%s", dir, err, out)
		}
		b, err := os.ReadFile(filepath.Join(dist, "SHA256SUMS"))
		if err != nil {
			t.Fatal(err)
		}
		sums[i] = string(b)
		if i == 0 {
			checkBinaries(t, dist)
		}
	}
	t.Logf("SHA256SUMS:\n%s", sums[0])
	if sums[0] != sums[1] {
		t.Errorf("two builds differ:\n%s\n%s", sums[0], sums[1])
	}
	for _, name := range []string{"runfleet-v0.0.0-reprotest-linux-amd64", "runfleet-v0.0.0-reprotest-linux-arm64", "runfleet-v0.0.0-reprotest-linux-amd64-nvml"} {
		if !strings.Contains(sums[0], "  "+name+"\n") {
			t.Errorf("SHA256SUMS lacks %s", name)
		}
	}
}

// checkBinaries: the plain builds are static for their architecture, the
// NVML one is linked against the C library, and each says its version.
func checkBinaries(t *testing.T, dist string) {
	t.Helper()
	for name, want := range map[string]struct {
		machine elf.Machine
		static  bool
	}{
		"runfleet-v0.0.0-reprotest-linux-amd64":      {elf.EM_X86_64, true},
		"runfleet-v0.0.0-reprotest-linux-arm64":      {elf.EM_AARCH64, true},
		"runfleet-v0.0.0-reprotest-linux-amd64-nvml": {elf.EM_X86_64, false},
	} {
		f, err := elf.Open(filepath.Join(dist, name))
		if err != nil {
			t.Fatal(err)
		}
		interp := false
		for _, p := range f.Progs {
			interp = interp || p.Type == elf.PT_INTERP
		}
		f.Close()
		if f.Machine != want.machine || interp == want.static {
			t.Errorf("%s: %s, dynamic %v", name, f.Machine, interp)
		}
	}
	out, err := exec.Command(filepath.Join(dist, "runfleet-v0.0.0-reprotest-linux-amd64"), "version").Output()
	if err != nil || !strings.HasPrefix(string(out), "runfleet v0.0.0-reprotest (commit 0123456789ab, built 2026-11-26T00:00:00Z,") {
		t.Errorf("version: %q %v", out, err)
	}
}

// `go install ./cmd/runfleet` from a checkout (no -ldflags) says the
// version the toolchain stamps: the tag or a pseudo-version, the commit.
func TestGoInstallKnowsItsVersion(t *testing.T) {
	need(t, "git")
	src := root(t)
	head, err := exec.Command("git", "-C", src, "rev-parse", "HEAD").Output()
	if err != nil {
		peers.Need(t, "a git checkout", err)
	}
	bin := t.TempDir()
	// -trimpath changes no stamp (the version and commit come from the
	// module and git either way) and lets this build reuse what make
	// test's go vet and static build compiled: without it, every package
	// was compiled once more, a quarter of an hour of CPU with Go's build
	// cache cold.
	cmd := exec.Command("go", "install", "-trimpath", "./cmd/runfleet")
	cmd.Dir = src
	// -buildvcs=true: whatever GOFLAGS this machine sets, as a newcomer's
	// go would (auto stamps a git checkout).
	cmd.Env = append(os.Environ(), "GOBIN="+bin, "GOFLAGS=-buildvcs=true", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go install: %v\n%s", err, out)
	}
	out, err := exec.Command(filepath.Join(bin, "runfleet"), "version", "-o", "json").Output()
	if err != nil {
		t.Fatal(err)
	}
	var v struct{ Version, Commit, Date string }
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatal(err)
	}
	t.Logf("go install ./cmd/runfleet: runfleet version -o json: %s", bytes.TrimSpace(out))
	if !strings.HasPrefix(v.Version, "v") || v.Commit != strings.TrimSpace(string(head)) || v.Date == "" {
		t.Errorf("version %+v, want a module version and commit %s", v, head)
	}
}
