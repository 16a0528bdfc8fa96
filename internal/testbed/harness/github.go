package harness

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// GHToken is the simulated GitHub's personal access token: the secret that
// must reach no runner.
const GHToken = "e2e-simulated-github-token-that-must-not-leak-0042"

// needGitHubRunner builds the stand-in for GitHub's runner (static, so
// that it also runs in a FROM scratch image).
func needGitHubRunner(t testing.TB) string {
	return ghStandIn.bin(t)
}

// NeedGitHubImage builds an image with the stand-in runner at
// /bin/github-runner.
func NeedGitHubImage(t testing.TB) string {
	return ghStandIn.image(t)
}

var ghStandIn = &StandIn{pkg: "github.com/runfleet/runfleet/internal/testbed/ghsim/runner", file: "run.sh", name: "github-runner"}

// StandIn is a stand-in agent built once per test binary, and its image.
type StandIn struct {
	pkg  string // the command's package
	file string // its file name in the build directory
	name string // its name in /bin of the image, and the image's
	once sync.Once
	path string
	err  error
	img  string
}

// bin builds the stand-in (static, so that it also runs in a FROM
// scratch image).
func (s *StandIn) bin(t testing.TB) string {
	t.Helper()
	NeedBinaries(t)
	s.once.Do(func() {
		dir, err := os.MkdirTemp("", "runfleet-standin-")
		if err != nil {
			s.err = err
			return
		}
		s.path = filepath.Join(dir, s.file)
		// -trimpath, as make test's go vet and static build: what
		// they compiled is reused rather than compiled again.
		cmd := exec.Command("go", "build", "-trimpath", "-o", s.path, s.pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			s.err = fmt.Errorf("build the stand-in %s: %v\n%s", s.name, err, out)
		}
	})
	if s.err != nil {
		t.Fatal(s.err)
	}
	return s.path
}

// image builds an image with the stand-in at /bin/<name>.
func (s *StandIn) image(t testing.TB) string {
	t.Helper()
	bin := s.bin(t)
	NeedDocker(t)
	if s.img == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		img, err := peers.AgentImage(ctx, DockerCli, "runfleet-test/"+s.name, s.name, bin)
		if err != nil {
			t.Fatal(err)
		}
		s.img = img
	}
	return s.img
}

type GitHubOptions struct {
	Size, Max int
	Docker    bool
	Sim       ghsim.Options
	Forge     string // appended to the forge
	Pool      string // appended to the pool
	// Top is added at the top of the config.
	Top string
	// Engine runs the containers instead of the default engine, with
	// host networking.
	Engine *GPUEngine
	// AgentPath replaces the stand-in runner of a process pool.
	AgentPath string
	// Org makes the forge the organisation acme, not the repository.
	Org bool
}

// NewGitHubFleet makes a manager config for a pool on a simulated GitHub
// repository acme/<name>.
func NewGitHubFleet(t testing.TB, name string, opt GitHubOptions) *Fleet {
	t.Helper()
	bin := needGitHubRunner(t)
	image := ""
	switch {
	case opt.Engine != nil:
		image = opt.Engine.image(t, bin)
		opt.Sim.RunnerHost = "127.0.0.1" // host networking
	case opt.Docker:
		image = NeedGitHubImage(t)
		opt.Sim.RunnerHost = "host.docker.internal"
	}
	opt.Sim.Token = GHToken
	opt.Sim.Repos = append(opt.Sim.Repos, "acme/"+name)
	scope := "/acme/" + name
	if opt.Org {
		opt.Sim.Orgs, scope = append(opt.Sim.Orgs, "acme"), "/acme"
	}
	if opt.Sim.LostAfter == 0 {
		opt.Sim.LostAfter = 2 * time.Second
	}
	sim := ghsim.New(opt.Sim)
	t.Cleanup(sim.Close)
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	dir := t.TempDir()
	f := &Fleet{T: t, Repo: name, Dir: dir, State: filepath.Join(dir, "state"), Work: filepath.Join(dir, "work"), GH: sim, docker: opt.Docker}
	if opt.Engine != nil {
		f.engine, f.Env = opt.Engine.cli, []string{"DOCKER_HOST=" + opt.Engine.host}
	}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: 2m
forges:
  - name: gh
    type: github
    url: %[3]s%[8]s
    token: ${E2E_GITHUB_TOKEN}
%[7]spools:
  - name: %[1]s
    labels: [%[1]s, linux]
    size: %[4]d
    max: %[5]d
    workdir: %[6]s
    bootstrap_timeout: 1m
`, name, f.State, sim.URL, opt.Size, opt.Max, f.Work, opt.Forge, scope)
	if opt.Size < 0 { // sized by the pool's GPUs
		cfg = strings.Replace(cfg, fmt.Sprintf("    size: %d\n    max: %d\n", opt.Size, opt.Max), "", 1)
	}
	if opt.Docker {
		cfg += "    agent:\n      path: /bin/github-runner\n    docker:\n      image: " + image + "\n      pull: never\n"
		if opt.Engine != nil {
			cfg += "      network: host\n"
		}
	} else {
		if opt.AgentPath != "" {
			bin = opt.AgentPath
		}
		cfg += "    agent:\n      path: " + bin + "\n"
	}
	cfg += opt.Pool
	f.Config = filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(f.Config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Cleanup)
	return f
}

// IdleGitHub counts runners online at the simulator without a job.
func IdleGitHub(sim *ghsim.Server) int {
	n := 0
	for _, r := range sim.Runners() {
		if r.Online && r.JobID == 0 {
			n++
		}
	}
	return n
}

func Completed(sim *ghsim.Server) (done, ok int) {
	for _, j := range sim.Jobs() {
		if j.Status == "completed" {
			done++
			if j.Conclusion == "success" {
				ok++
			}
		}
	}
	return done, ok
}

// JobScript runs in every job: it fails if an earlier job's file is
// there, and prints what a hostile job could read: its environment and
// every process's command line.
const JobScript = `test ! -e left-by-earlier-job || { echo "earlier job's file is here"; exit 1; }
touch left-by-earlier-job
echo "host=$(hostname) dir=$(pwd)"
env
for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' < "$f" 2>/dev/null; echo; done
sleep 0.3`

// CheckNoSecretOnDisk looks for the access tokens in everything the
// manager and its runners wrote: logs, records, working directories,
// container files.
func (f *Fleet) CheckNoSecretOnDisk() {
	f.T.Helper()
	_ = filepath.Walk(f.Dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() || path == f.Config {
			return nil
		}
		b, _ := os.ReadFile(path)
		if bytes.Contains(b, []byte(GHToken)) {
			f.T.Errorf("the GitHub token is in %s", path)
		}
		if bytes.Contains(b, []byte(GLToken)) {
			f.T.Errorf("the GitLab token is in %s", path)
		}
		if bytes.Contains(b, []byte(AZToken)) {
			f.T.Errorf("the Azure DevOps PAT is in %s", path)
		}
		return nil
	})
}

func FileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// GitHubRunnerBin is the stand-in for GitHub's runner, a host binary.
func GitHubRunnerBin(t testing.TB) string { return needGitHubRunner(t) }

// GitHubRunnerRelease is a release of the stand-in runner packed as
// actions/runner packs its own (a tarball with run.sh at its top), for a
// test's loopback mirror.
func GitHubRunnerRelease(t testing.TB) []byte {
	t.Helper()
	bin, err := os.ReadFile(needGitHubRunner(t))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	if err := tw.WriteHeader(&tar.Header{Name: "run.sh", Mode: 0o755, Size: int64(len(bin)), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	tw.Write(bin)
	tw.Close()
	gz.Close()
	return buf.Bytes()
}
