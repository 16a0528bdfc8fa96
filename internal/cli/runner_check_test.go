package cli

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge/github"
	"github.com/runfleet/runfleet/forge/gitlab"
	"github.com/runfleet/runfleet/internal/testbed/azsim"
	"github.com/runfleet/runfleet/internal/testbed/bbsim"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/glsim"
)

const (
	rightToken = "right-token-0123456789"
	wrongToken = "wrong-token-9876543210"
)

// closedURL is an address nothing listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

// A wrong token, a wrong repository and an unreachable forge each end
// `runfleet runner` with exit 1 within seconds, saying what the forge
// answered, on every forge's stand-in, as CML's token check at start does
// (src/cml.js repoTokenCheck); nothing is left running. Before, the run
// waited out the idle timeout and exited 0.
func TestRunnerFailsFast(t *testing.T) {
	gh := ghsim.New(ghsim.Options{Token: rightToken, Repos: []string{"acme/models"}})
	t.Cleanup(gh.Close)
	gl := glsim.New(glsim.Options{Token: rightToken, Projects: []string{"acme/models"}})
	t.Cleanup(gl.Close)
	bb := bbsim.New(bbsim.Options{Token: rightToken, Repos: []string{"models"}})
	t.Cleanup(bb.Close)
	az := azsim.New(azsim.Options{Token: rightToken, Pools: []string{"ml"}})
	t.Cleanup(az.Close)
	closed := closedURL(t)
	// The Azure agent's directory, as its driver checks it: bin/ and
	// run.sh, which nothing here runs.
	azAgent := t.TempDir()
	if err := os.Mkdir(filepath.Join(azAgent, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(azAgent, "run.sh"), []byte("#!/bin/sh\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	type forgeCase struct {
		driver, repo, wrongRepo, unreachable, agent string
	}
	forges := []forgeCase{
		{"github", gh.URL + "/acme/models", gh.URL + "/acme/nothing", closed + "/acme/models", "/bin/true"},
		{"gitlab", gl.URL + "/acme/models", gl.URL + "/acme/nothing", closed + "/acme/models", "/bin/true"},
		{"bitbucket", bb.URL + "/acme/models", bb.URL + "/acme/nothing", closed + "/acme/models", "/bin/true"},
		{"azure-pipelines", az.URL + "/models?pool=ml", az.URL + "/models?pool=nothing", closed + "/acme/models?pool=ml", filepath.Join(azAgent, "run.sh")},
	}
	for _, f := range forges {
		for _, tc := range []struct {
			what, repo, token string
			want              []string
		}{
			{"wrong token", f.repo, wrongToken, []string{"the forge refused the token or the repository", "401|Unauthorized"}},
			{"wrong repository", f.wrongRepo, rightToken, []string{"the forge refused the token or the repository"}},
			{"unreachable forge", f.unreachable, rightToken, []string{"the forge could not be reached", "connection refused"}},
		} {
			t.Run(f.driver+" "+tc.what, func(t *testing.T) {
				t.Setenv("REPO_TOKEN", tc.token)
				t.Setenv("XDG_STATE_HOME", t.TempDir())
				var out bytes.Buffer
				start := time.Now()
				code := Main([]string{"runner", "launch", "--driver", f.driver, "--repo", tc.repo, "--agent", f.agent, "--idle-timeout", "60"}, &out, &out)
				took := time.Since(start)
				if code != ExitFailure || took > 10*time.Second {
					t.Errorf("exit %d after %s, want 1 within 10s:\n%s", code, took.Round(time.Millisecond), out.String())
				}
				for _, w := range tc.want {
					// "a|b": either one, as each forge words it.
					if !slices.ContainsFunc(strings.Split(w, "|"), func(w string) bool { return strings.Contains(out.String(), w) }) {
						t.Errorf("the output does not say %q:\n%s", w, out.String())
					}
				}
				if strings.Contains(out.String(), tc.token) {
					t.Error("the token was printed")
				}
				t.Logf("exit %d after %s: %s", code, took.Round(time.Millisecond), strings.TrimSpace(out.String()))
			})
		}
	}

	// --cloud=aws where EC2 refuses the credentials: the cloud's answer,
	// at once, and no registration is made.
	ec2, err := ec2sim.New(ec2sim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ec2.Close)
	t.Setenv("REPO_TOKEN", rightToken)
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	for k, v := range map[string]string{"AWS_ACCESS_KEY_ID": "not-the-key", "AWS_SECRET_ACCESS_KEY": "nope", "AWS_ENDPOINT_URL_EC2": ec2.URL,
		"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"} {
		t.Setenv(k, v)
	}
	var out bytes.Buffer
	start := time.Now()
	code := Main([]string{"runner", "--driver", "github", "--repo", gh.URL + "/acme/models", "--agent", "/bin/github-runner",
		"--cloud=aws", "--cloud-region=us-west", "--cloud-type=p2.xlarge", "--cloud-image", "ami-0123456789abcdef0", "--labels=cml-gpu"}, &out, &out)
	if took := time.Since(start); code != ExitFailure || took > 10*time.Second || !strings.Contains(out.String(), "the cloud refused to list the runners' machines (aws)") || !strings.Contains(out.String(), "AuthFailure") {
		t.Errorf("--cloud=aws with credentials EC2 refuses: exit %d after %s:\n%s", code, took, out.String())
	}
	if len(gh.Runners()) != 0 || len(ec2.Instances()) != 0 {
		t.Errorf("left %d registrations and %d instances", len(gh.Runners()), len(ec2.Instances()))
	}
}

// A runner whose agent never comes online (here it fails at once) ends
// the run with exit 1 and the reason, at the idle timeout, or after its
// one try with --single: exit 0 only means a runner served.
func TestRunnerNeverOnlineFails(t *testing.T) {
	gh := ghsim.New(ghsim.Options{Token: rightToken, Repos: []string{"acme/models"}})
	t.Cleanup(gh.Close)
	t.Setenv("REPO_TOKEN", rightToken)
	// An agent that fails at once and says so, as a real one does (a
	// version the forge refuses, a library missing).
	failing := filepath.Join(t.TempDir(), "run.sh")
	if err := os.WriteFile(failing, []byte("#!/bin/sh\necho 'runner: cannot start: a library is missing' >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"--idle-timeout", "3"}, {"--single"}} {
		t.Setenv("XDG_STATE_HOME", t.TempDir())
		var out bytes.Buffer
		start := time.Now()
		code := Main(append([]string{"runner", "--driver", "github", "--repo", gh.URL + "/acme/models", "--agent", failing}, args...), &out, &out)
		took := time.Since(start)
		if code != ExitFailure || !strings.Contains(out.String(), "no runner came online") || !strings.Contains(out.String(), "agent exited without taking a job") || !strings.Contains(out.String(), "a library is missing") {
			t.Errorf("%v with an agent that exits at once: exit %d after %s:\n%s", args, code, took, out.String())
		}
		if took > time.Minute {
			t.Errorf("%v: took %s", args, took)
		}
		if len(gh.Runners()) != 0 {
			t.Errorf("%v: registrations left: %+v", args, gh.Runners())
		}
		t.Logf("%v: exit %d after %s", args, code, took.Round(100*time.Millisecond))
	}
}

// Without GitHub's runner on this host and without --agent, runner
// fetches the release it pins, here from a loopback mirror (--agent-url)
// with the checksum of the mirror's own build (--agent-sha256), and runs
// it; a file whose checksum is not the one given is refused, with exit 1
// and nothing run. The release's run.sh here says it ran and fails, which
// the pool shows.
func TestRunnerFetchesTheAgent(t *testing.T) {
	gh := ghsim.New(ghsim.Options{Token: rightToken, Repos: []string{"acme/models"}})
	t.Cleanup(gh.Close)
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	script := "#!/bin/sh\necho 'the fetched agent ran'\nexit 1\n"
	tw.WriteHeader(&tar.Header{Name: "run.sh", Mode: 0o755, Size: int64(len(script)), Typeflag: tar.TypeReg})
	tw.Write([]byte(script))
	tw.Close()
	gz.Close()
	release := buf.Bytes()
	file := strings.NewReplacer("{arch}", github.AgentRelease.Arch[runtime.GOARCH], "{version}", github.AgentRelease.Version).Replace(github.AgentRelease.File)
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/mirror/"+file {
			http.NotFound(w, r)
			return
		}
		w.Write(release)
	}))
	t.Cleanup(mirror.Close)
	sum := sha256.Sum256(release)
	t.Setenv("REPO_TOKEN", rightToken)
	t.Setenv("PATH", "/usr/bin:/bin") // no run.sh
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	for _, tc := range []struct {
		sum  string
		want string
	}{
		{hex.EncodeToString(sum[:]), "the fetched agent ran"},
		{strings.Repeat("0", 64), "checksum mismatch"},
	} {
		t.Setenv("XDG_STATE_HOME", t.TempDir())
		var out bytes.Buffer
		code := Main([]string{"runner", "--driver", "github", "--repo", gh.URL + "/acme/models", "--single",
			"--agent-url", mirror.URL + "/mirror", "--agent-sha256", tc.sum}, &out, &out)
		if code != ExitFailure || !strings.Contains(out.String(), tc.want) {
			t.Errorf("--agent-sha256 %s: exit %d, want 1 and %q:\n%s", tc.sum[:8], code, tc.want, out.String())
		}
	}
	if entries, _ := os.ReadDir(filepath.Join(os.Getenv("XDG_CACHE_HOME"), "runfleet", "releases", "actions-runner")); len(entries) != 1 {
		t.Errorf("the cache holds %d releases of actions-runner, want the one that matched", len(entries))
	}
}

// gitlab-runner, where runfleet pins no digest: fetched from a loopback
// mirror laid out as GitLab's bucket (binaries/ beside release.sha256),
// checked against the list read from there first, and run; a binary the
// list does not match is refused, exit 1, nothing run.
func TestRunnerFetchesGitLabRunner(t *testing.T) {
	gl := glsim.New(glsim.Options{Token: rightToken, Projects: []string{"acme/models"}})
	t.Cleanup(gl.Close)
	bin := []byte("#!/bin/sh\necho 'the fetched gitlab-runner ran'\nexit 1\n")
	file := strings.ReplaceAll(gitlab.AgentRelease.File, "{arch}", gitlab.AgentRelease.Arch[runtime.GOARCH])
	served := bin
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/mirror/release.sha256":
			h := sha256.Sum256(bin)
			fmt.Fprintf(w, "%x *%s\n", h, file)
		case "/mirror/" + file:
			w.Write(served)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(mirror.Close)
	t.Setenv("REPO_TOKEN", rightToken)
	t.Setenv("PATH", "/usr/bin:/bin") // no gitlab-runner
	for _, tc := range []struct {
		body []byte
		want string
	}{
		{bin, "the fetched gitlab-runner ran"},
		{append([]byte("#tampered\n"), bin...), "checksum mismatch"},
	} {
		served = tc.body
		t.Setenv("XDG_CACHE_HOME", t.TempDir())
		t.Setenv("XDG_STATE_HOME", t.TempDir())
		var out bytes.Buffer
		code := Main([]string{"runner", "--driver", "gitlab", "--repo", gl.URL + "/acme/models", "--single", "--agent-url", mirror.URL + "/mirror"}, &out, &out)
		if code != ExitFailure || !strings.Contains(out.String(), tc.want) {
			t.Errorf("exit %d, want 1 and %q:\n%s", code, tc.want, out.String())
		}
	}
}

// A forge whose agent runfleet does not fetch, and that is not on this
// host: said before anything starts, with where to read how to install it.
func TestRunnerSaysWhichAgentToInstall(t *testing.T) {
	bb := bbsim.New(bbsim.Options{Token: rightToken, Repos: []string{"models"}})
	t.Cleanup(bb.Close)
	t.Setenv("REPO_TOKEN", rightToken)
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	var out bytes.Buffer
	code := Main([]string{"runner", "--driver", "bitbucket", "--repo", bb.URL + "/acme/models", "--single"}, &out, &out)
	if code != ExitUsage || !strings.Contains(out.String(), "is not on this host") || !strings.Contains(out.String(), "docs/forges/bitbucket.md") ||
		!strings.Contains(out.String(), "--agent docker://docker-public.packages.atlassian.com/sox/atlassian/bitbucket-pipelines-runner:1") {
		t.Errorf("exit %d:\n%s", code, out.String())
	}
	if len(bb.Runners()) != 0 {
		t.Errorf("a runner was registered: %+v", bb.Runners())
	}
}

// A runner whose job ends, and which is stopped (SIGTERM, as a CI job
// that deploys it does) before the pool's next pass reads that it ran,
// served: the run exits 0. The pass made while draining reads the agent's
// last line, and that answer, not the one from before the signal, is the
// exit. Before, it exited 1, "no runner came online", whenever the signal
// came within a resync of the job's end.
func TestRunnerStoppedRightAfterItsJob(t *testing.T) {
	gh := ghsim.New(ghsim.Options{Token: rightToken, Repos: []string{"acme/models"}})
	t.Cleanup(gh.Close)
	t.Setenv("REPO_TOKEN", rightToken)
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	dir := t.TempDir()
	ran := filepath.Join(dir, "ran")
	// Runner.Listener's lines for a job taken and finished
	// (forge/github/agent.go phaseMarkers), then the mark the test
	// waits for, and a second to exit in, as the real one takes to
	// report its job and end.
	script := filepath.Join(dir, "run.sh")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho 'Listening for Jobs'\necho 'Running job: train'\necho 'Job train completed with result: Succeeded'\ntouch "+ran+"\nsleep 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			if _, err := os.Stat(ran); err == nil {
				// runRunner's signal.NotifyContext has this process's
				// SIGTERM by now: it was set before the agent started.
				syscall.Kill(os.Getpid(), syscall.SIGTERM)
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	var out bytes.Buffer
	code := Main([]string{"runner", "--driver", "github", "--repo", gh.URL + "/acme/models", "--agent", script, "--idle-timeout", "never"}, &out, &out)
	if code != 0 {
		t.Errorf("stopped right after its job: exit %d, want 0:\n%s", code, out.String())
	}
	// Its registration is GitHub's to delete, as it deletes a just-in-time
	// runner's once its job ended: the pool asks nothing more of it
	// (pool.classifyExited). This agent never reached the stand-in, which
	// therefore keeps it.
}
