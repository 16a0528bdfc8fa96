// Package release checks what people install: `make release`'s binaries
// are the same whoever builds them where, and a build from a checkout
// knows its version.
package release

import (
	"bytes"
	"debug/elf"
	"encoding/json"
	"errors"
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
// amd64 one with the NVML reader, with every driver, and the static builds
// of a set of drivers; the first run makes every common set.
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
		args := append([]string{"-s", "release", "DIST=" + dist}, vars...)
		if i == 1 {
			// The sets differ from each other by build tags alone: one
			// set, built elsewhere, shows the path leaves no trace, and
			// spares CI six more links of 40 to 100 MB.
			args = append(args, "RELEASE_SETS=hosts")
		}
		cmd := exec.Command("make", args...)
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
			checkSets(t, dist)
		}
	}
	t.Logf("SHA256SUMS:\n%s", sums[0])
	elsewhere := strings.SplitAfter(sums[1], "\n")
	if len(elsewhere) != 6 { // five binaries, and the end
		t.Errorf("the build elsewhere made %d binaries, want 5:\n%s", len(elsewhere)-1, sums[1])
	}
	for _, line := range elsewhere {
		if !strings.Contains(sums[0], line) {
			t.Errorf("two builds differ: %q elsewhere, here\n%s", line, sums[0])
		}
	}
	names := []string{"runfleet-v0.0.0-reprotest-linux-amd64", "runfleet-v0.0.0-reprotest-linux-arm64", "runfleet-v0.0.0-reprotest-linux-amd64-nvml"}
	for _, set := range []string{"hosts", "aws", "gcp", "azure"} {
		names = append(names, "runfleet-v0.0.0-reprotest-linux-amd64-"+set, "runfleet-v0.0.0-reprotest-linux-arm64-"+set)
	}
	for _, name := range names {
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

// The cloud SDKs' modules, by path prefix, none of which a build without
// that cloud's driver may link.
var cloudSDKs = map[string][]string{
	"aws":   {"github.com/aws/"},
	"gcp":   {"cloud.google.com/go", "google.golang.org/api", "google.golang.org/grpc", "github.com/googleapis/"},
	"azure": {"github.com/Azure/", "github.com/AzureAD/"},
}

// checkSets: each set's binary links its own drivers' code alone (go
// version -m lists the modules a binary links), says which drivers it has,
// and refuses a config naming a driver it lacks with the build tags that
// would have it.
func checkSets(t *testing.T, dist string) {
	t.Helper()
	for set, want := range map[string]struct{ clouds, providers string }{
		"hosts": {"", "docker, kubernetes, process, slurm"},
		"aws":   {"aws", "aws"},
		"gcp":   {"gcp", "gcp"},
		"azure": {"azure", "azure"},
	} {
		bin := filepath.Join(dist, "runfleet-v0.0.0-reprotest-linux-amd64-"+set)
		mods, err := exec.Command("go", "version", "-m", bin).Output()
		if err != nil {
			t.Fatalf("go version -m %s: %v", bin, err)
		}
		for cloud, prefixes := range cloudSDKs {
			linked := []string{}
			for line := range strings.SplitSeq(string(mods), "\n") {
				f := strings.Fields(line)
				if len(f) < 2 || (f[0] != "dep" && f[0] != "=>") {
					continue
				}
				for _, p := range prefixes {
					if strings.HasPrefix(f[1], p) {
						linked = append(linked, f[1])
					}
				}
			}
			if cloud == want.clouds && len(linked) == 0 {
				t.Errorf("%s: links none of %s's SDK (%v)", set, cloud, prefixes)
			}
			if cloud != want.clouds && len(linked) > 0 {
				t.Errorf("%s: links %s's SDK: %v", set, cloud, linked)
			}
		}
		out, err := exec.Command(bin, "version").Output()
		if err != nil || !strings.Contains(string(out), "forges: azure-pipelines, bitbucket, gitea, github, gitlab; providers: "+want.providers+"\n") {
			t.Errorf("%s: version: %q %v", set, out, err)
		}
		if set == "hosts" {
			checkLeftOut(t, bin)
		}
	}
}

// checkLeftOut: the hosts build, given a config with an EC2 pool, starts
// nothing and says which build has it.
func checkLeftOut(t *testing.T, bin string) {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "fleet.yaml")
	yaml := "id: lab\nforges:\n  - {name: lab, type: gitea, url: http://127.0.0.1:1, token: abc, repo: a/b}\n" +
		"pools:\n  - name: burst\n    forge: lab\n    labels: [gpu]\n    aws:\n      region: us-east-1\n      instance_type: g5.xlarge\n"
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "serve", "-c", cfg, "--status-listen", "off")
	cmd.Dir = t.TempDir()
	out, err := cmd.CombinedOutput()
	want := `pools[0].aws: provider "aws" is not in this build of runfleet: build with -tags 'forge_azurepipelines forge_bitbucket forge_gitea forge_github forge_gitlab provider_aws provider_docker provider_kubernetes provider_process provider_slurm' (make build DRIVERS="aws azurepipelines bitbucket docker gitea github gitlab kubernetes process slurm")`
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), want) {
		t.Errorf("hosts build with an aws pool: %v\n%s\nwant exit 2 and %s", err, out, want)
	}
	t.Logf("hosts build with an aws pool: %s", bytes.TrimSpace(out))
	// And `runfleet runner --cloud aws`, CML's way, before it looks for
	// anything to install.
	out, err = exec.Command(bin, "runner", "--repo", "https://github.com/a/b", "--token", "tok-secret", "--cloud", "aws").CombinedOutput()
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), "--cloud: aws is not in this build of runfleet: build with -tags '") {
		t.Errorf("hosts build, runner --cloud aws: %v\n%s", err, out)
	}
}
