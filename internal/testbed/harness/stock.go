package harness

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/forge/gitlab"
	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/provider/aws"
	"github.com/runfleet/runfleet/provider/azure"
	"github.com/runfleet/runfleet/provider/gcp"
)

// StockAMI is the EC2 stand-in's AMI for a stock image (no runfleet, no
// agent), which AWS's and Canonical's public parameters name.
const StockAMI = "ami-0e2e00000000005fe"

var (
	stockOnce  sync.Once
	stockImage string
	stockErr   error
)

// needStockImage builds, once, the clouds' stand-ins' stock image.
func needStockImage(t testing.TB) string {
	t.Helper()
	NeedDocker(t)
	stockOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		stockImage, stockErr = peers.StockImage(ctx, DockerCli)
	})
	peers.Need(t, "the cloud stand-ins' stock image", stockErr)
	return stockImage
}

// AddStockImages gives an EC2 stand-in the stock image behind the public
// parameters runfleet names (aws.StockUbuntu, aws.StockGPU).
func AddStockImages(t testing.TB, sim *ec2sim.Server) {
	t.Helper()
	sim.AddImage(StockAMI, needStockImage(t))
	for _, p := range []string{aws.StockUbuntu, aws.StockGPU} {
		sim.AddParameter(strings.TrimPrefix(p, "resolve:ssm:"), StockAMI)
	}
}

// AddGCEStockImages gives a Compute Engine stand-in the stock image behind
// the image families runfleet names (gcp.StockUbuntu, gcp.StockGPU).
func AddGCEStockImages(t testing.TB, sim *gcesim.Server) {
	t.Helper()
	for _, f := range []string{gcp.StockUbuntu, gcp.StockGPU} {
		sim.AddImage(f, needStockImage(t))
	}
}

// AddARMStockImages gives an Azure stand-in the stock image behind the
// marketplace images runfleet names (azure.StockUbuntu, azure.StockGPU).
func AddARMStockImages(t testing.TB, sim *armsim.Server) {
	t.Helper()
	for _, urn := range []string{azure.StockUbuntu, azure.StockGPU} {
		sim.AddImage(urn, needStockImage(t))
	}
}

// Releases serves, as a release site would, runfleet's release (the
// static build the instances run, named as `make release` names it, and
// its SHA256SUMS), a mirror of GitHub's runner release (the stand-in
// runner, packed as actions/runner packs its own) and one of
// gitlab-runner's (the stand-in, laid out as GitLab's bucket: binaries/
// beside release.sha256), at an address both this host and its containers
// reach: the Docker bridge's.
type Releases struct {
	// URL is runfleet's release directory (RUNFLEET_RELEASE_URL); Agent
	// the runner release's mirror (--agent-url) and AgentSHA256 its file's
	// checksum (--agent-sha256); GitLab gitlab-runner's mirror, whose
	// checksums its release.sha256 lists.
	URL, Agent, AgentSHA256, GitLab string
	mu                              sync.Mutex
	fetched                         map[string]int
	tamper                          bool
}

// NewReleases serves the releases until the test ends.
func NewReleases(t testing.TB) *Releases {
	t.Helper()
	needInstanceImage(t) // builds staticBin
	bin := staticBin
	out, err := exec.Command(bin, "version", "-o", "json").Output()
	if err != nil {
		t.Fatalf("%s version: %v", bin, err)
	}
	var v struct{ Version string }
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatal(err)
	}
	runfleet, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	name := "runfleet-" + v.Version + "-linux-amd64"
	agent := GitHubRunnerRelease(t)
	rel := github.AgentRelease
	agentFile := strings.NewReplacer("{arch}", rel.Arch[runtime.GOARCH], "{version}", rel.Version).Replace(rel.File)
	sums := fmt.Sprintf("%s  %s\n", sum(runfleet), name)
	r := &Releases{fetched: map[string]int{}, AgentSHA256: sum(agent)}
	files := map[string][]byte{"/runfleet/SHA256SUMS": []byte(sums), "/runfleet/" + name: runfleet, "/actions-runner/" + agentFile: agent}
	gl, err := os.ReadFile(NeedGitLabRunner(t))
	if err != nil {
		t.Fatal(err)
	}
	glFile := strings.ReplaceAll(gitlab.AgentRelease.File, "{arch}", gitlab.AgentRelease.Arch[runtime.GOARCH])
	files["/gitlab-runner/"+glFile] = gl
	files["/gitlab-runner/release.sha256"] = fmt.Appendf(nil, "%s *%s\n", sum(gl), glFile)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		b, ok := files[req.URL.Path]
		if !ok {
			http.NotFound(w, req)
			return
		}
		r.mu.Lock()
		r.fetched[req.URL.Path]++
		tamper := r.tamper && !strings.Contains(strings.ToLower(req.URL.Path), "sha256")
		r.mu.Unlock()
		if tamper {
			b = append([]byte("tampered"), b...)
		}
		w.Write(b)
	}))
	gw := bridgeAddr(t)
	l, err := net.Listen("tcp", gw+":0")
	if err != nil {
		t.Fatal(err)
	}
	srv.Listener = l
	srv.Start()
	t.Cleanup(srv.Close)
	r.URL, r.Agent, r.GitLab = srv.URL+"/runfleet", srv.URL+"/actions-runner", srv.URL+"/gitlab-runner"
	return r
}

// Tamper makes every release file served from now on differ from its
// checksum, as a compromised mirror's would.
func (r *Releases) Tamper() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tamper = true
}

// Fetched counts the requests for files whose path ends with suffix.
func (r *Releases) Fetched(suffix string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for p, c := range r.fetched {
		if strings.HasSuffix(p, suffix) {
			n += c
		}
	}
	return n
}

// BridgeAddr is this host's address on Docker's default bridge: a
// stand-in listening there is reached at the same URL by this host and by
// the containers that play cloud machines.
func BridgeAddr(t testing.TB) string { return bridgeAddr(t) }

// bridgeAddr is this host's address on Docker's default bridge, which
// containers reach it at (host.docker.internal is not a name this host
// knows).
func bridgeAddr(t testing.TB) string {
	t.Helper()
	ifc, err := net.InterfaceByName("docker0")
	if err != nil {
		t.Fatalf("Docker's bridge: %v", err)
	}
	addrs, _ := ifc.Addrs()
	for _, a := range addrs {
		if ip, ok := a.(*net.IPNet); ok && ip.IP.To4() != nil {
			return ip.IP.String()
		}
	}
	t.Fatal("Docker's bridge has no IPv4 address")
	return ""
}

func sum(b []byte) string { h := sha256.Sum256(b); return hex.EncodeToString(h[:]) }

// RunJob queues a job for the runner started (cmd, out) on a stock image,
// waits for it to succeed there, for its machine to be seen gone after
// its one job, stops the runner as a user does (exit 0: a runner served),
// and checks that runfleet and the agent were fetched (the slot's next
// machine may have fetched them again by then).
func (r *Releases) RunJob(t *testing.T, gh *ghsim.Server, repo, label string, cmd *exec.Cmd, out *Output) {
	t.Helper()
	gh.Queue(repo, ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", label}, Script: "echo trained-on-a-stock-image"})
	Eventually(t, 3*time.Minute, "the job done", func() bool {
		jobs := gh.Jobs()
		return len(jobs) == 1 && jobs[0].Conclusion != ""
	})
	if jobs := gh.Jobs(); jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained-on-a-stock-image") {
		t.Fatalf("jobs = %+v", jobs)
	}
	Eventually(t, time.Minute, "the machine's end seen", func() bool { return strings.Contains(out.String(), "runner removed") })
	_ = cmd.Process.Signal(syscall.SIGTERM)
	WaitExit(t, cmd, 2*time.Minute)
	if r.Fetched("linux-amd64") < 1 || r.Fetched(".tar.gz") < 1 {
		t.Errorf("runfleet fetched %d times, the agent %d: the job ran on what?", r.Fetched("linux-amd64"), r.Fetched(".tar.gz"))
	}
	if strings.Contains(out.String(), GHToken) {
		t.Error("the token reached the runner's log")
	}
}

var (
	stockDockerOnce  sync.Once
	stockDockerImage string
	stockDockerErr   error
)

// AddStockDockerImages is AddStockImages with a stock image whose archive
// holds Docker (peers.StockDockerImage), built once, from this host's
// Docker CLI, which must be a static build: the image has no C library.
func AddStockDockerImages(t testing.TB, sim *ec2sim.Server) {
	t.Helper()
	NeedDocker(t)
	stockDockerOnce.Do(func() {
		cliPath, err := staticDockerCLI()
		if err != nil {
			stockDockerErr = err
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		stockDockerImage, stockDockerErr = peers.StockDockerImage(ctx, DockerCli, cliPath)
	})
	peers.Need(t, "a stock image whose archive holds Docker", stockDockerErr)
	sim.AddImage(StockAMI, stockDockerImage)
	for _, p := range []string{aws.StockUbuntu, aws.StockGPU} {
		sim.AddParameter(strings.TrimPrefix(p, "resolve:ssm:"), StockAMI)
	}
}

// staticDockerCLI is this host's docker, where it is a static build (no
// program interpreter): Docker's own static release is, Debian's is not.
func staticDockerCLI() (string, error) {
	p, err := exec.LookPath("docker")
	if err != nil {
		return "", fmt.Errorf("Docker's CLI: %w", err)
	}
	switch ok, err := peers.Static(p); {
	case err != nil:
		return "", fmt.Errorf("Docker's CLI %s: %w", p, err)
	case !ok:
		return "", fmt.Errorf("Docker's CLI %s is not a static build (Docker's static release is: download.docker.com/linux/static)", p)
	}
	return p, nil
}
