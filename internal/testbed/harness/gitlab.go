package harness

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/glsim"
)

// GLToken is the simulated GitLab's access token: the secret that must
// reach no runner.
const GLToken = "e2e-simulated-gitlab-token-must-not-leak"

var glStandIn = &StandIn{pkg: "github.com/runfleet/runfleet/internal/testbed/glsim/runner", file: "gitlab-runner", name: "gitlab-runner"}

// NeedGitLabRunner builds the stand-in for gitlab-runner.
func NeedGitLabRunner(t testing.TB) string { return glStandIn.bin(t) }

// needGitLabImage builds an image with the stand-in at /bin/gitlab-runner.
func needGitLabImage(t testing.TB) string { return glStandIn.image(t) }

type GitLabOptions struct {
	Size, Max int
	Docker    bool
	Sim       glsim.Options
	Forge     string // appended to the forge
	Pool      string // appended to the pool
	Top       string // added at the top of the config
}

// NewGitLabFleet makes a manager config for a pool on a simulated GitLab
// project acme/<name>.
func NewGitLabFleet(t testing.TB, name string, opt GitLabOptions) *Fleet {
	t.Helper()
	bin := NeedGitLabRunner(t)
	image := ""
	if opt.Docker {
		image = needGitLabImage(t)
		opt.Sim.RunnerHost = "host.docker.internal"
	}
	opt.Sim.Token = GLToken
	opt.Sim.Projects = append(opt.Sim.Projects, "acme/"+name)
	sim := glsim.New(opt.Sim)
	t.Cleanup(sim.Close)
	if opt.Max == 0 {
		opt.Max = opt.Size
	}
	dir := t.TempDir()
	f := &Fleet{T: t, Repo: name, Dir: dir, State: filepath.Join(dir, "state"), Work: filepath.Join(dir, "work"), GL: sim, docker: opt.Docker,
		Env: []string{"E2E_GITLAB_TOKEN=" + GLToken}}
	cfg := opt.Top + fmt.Sprintf(`id: e2e-%[1]s
state_dir: %[2]s
resync: 2s
drain_timeout: 2m
forges:
  - name: gl
    type: gitlab
    url: %[3]s
    runner_url: %[4]s
    token: ${E2E_GITLAB_TOKEN}
    project: acme/%[1]s
%[7]spools:
  - name: %[1]s
    labels: [%[1]s, linux]
    size: %[5]d
    max: %[6]d
    workdir: %[8]s
    bootstrap_timeout: 1m
`, name, f.State, sim.URL, sim.RunnerURL(), opt.Size, opt.Max, opt.Forge, f.Work)
	if opt.Docker {
		cfg += "    agent:\n      path: /bin/gitlab-runner\n    docker:\n      image: " + image + "\n      pull: never\n"
	} else {
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

// IdleGitLab counts runners that asked GitLab for a job and run none.
func IdleGitLab(sim *glsim.Server) int {
	busy := map[int64]bool{}
	for _, j := range sim.Jobs() {
		if j.Status == "running" {
			busy[j.RunnerID] = true
		}
	}
	n := 0
	for _, r := range sim.Runners() {
		if !r.ContactedAt.IsZero() && !r.Paused && !busy[r.ID] {
			n++
		}
	}
	return n
}

// GLRunning counts the jobs running.
func GLRunning(sim *glsim.Server) int {
	n := 0
	for _, j := range sim.Jobs() {
		if j.Status == "running" {
			n++
		}
	}
	return n
}

func GLCompleted(sim *glsim.Server) (done, ok int) {
	for _, j := range sim.Jobs() {
		if j.Finished() {
			done++
			if j.Status == "success" {
				ok++
			}
		}
	}
	return done, ok
}

func GLJobs(name string, n int, script string) []glsim.JobSpec {
	specs := make([]glsim.JobSpec, n)
	for i := range specs {
		specs[i] = glsim.JobSpec{Name: fmt.Sprintf("test %d/%d", i+1, n), Tags: []string{name}, Script: script}
	}
	return specs
}

var serverTokenRE = regexp.MustCompile(`CI_SERVER_TOKEN=(glrt-\S+)`)

// CheckGitLabTokens reads every job's log (which prints its environment
// and every process's command line): the access token never shows, and
// the only runner token a job sees is its own runner's.
func CheckGitLabTokens(t testing.TB, sim *glsim.Server) {
	t.Helper()
	tokens := map[int64]string{}
	for _, r := range sim.AllRunners() {
		tokens[r.ID] = r.Token
	}
	for _, j := range sim.Jobs() {
		out := string(j.Trace)
		if strings.Contains(out, GLToken) {
			t.Errorf("job %d saw the access token", j.ID)
		}
		for id, tok := range tokens {
			if id != j.RunnerID && strings.Contains(out, tok) {
				t.Errorf("job %d (runner %d) saw runner %d's token", j.ID, j.RunnerID, id)
			}
		}
		if m := serverTokenRE.FindAllStringSubmatch(out, -1); len(m) != 1 || m[0][1] != tokens[j.RunnerID] {
			t.Errorf("job %d: its environment's CI_SERVER_TOKEN is not its own runner's token, once (%d found)", j.ID, len(m))
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, "gitlab-runner") && strings.Contains(line, "glrt-") {
				t.Errorf("job %d: a runner token in a process's arguments: %q", j.ID, line)
			}
		}
	}
	t.Logf("%d job logs (each job's environment and every process's arguments): the access token in none, each job's CI_SERVER_TOKEN its own runner's, no runner token in any argument", len(sim.Jobs()))
}

// CheckNoRunnerTokenOnDisk looks for every runner's token in what the
// manager and the agents wrote (logs, records, working directories).
func (f *Fleet) CheckNoRunnerTokenOnDisk() {
	f.T.Helper()
	runs := f.GL.AllRunners()
	files := 0
	_ = filepath.Walk(f.Dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return nil
		}
		files++
		b, _ := os.ReadFile(path)
		for _, r := range runs {
			if bytes.Contains(b, []byte(r.Token)) {
				f.T.Errorf("runner %s's token is in %s", r.Description, path)
			}
		}
		return nil
	})
	f.T.Logf("%d files the manager and the agents wrote: no runner token, no access token", files)
}

// PostHook posts a hook delivery with headers and returns the status.
func PostHook(t *testing.T, url string, headers map[string]string, body string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	return res.StatusCode
}

// gitLabChaos is ChaosForge for a fleet on the GitLab simulator.
func (f *Fleet) gitLabChaos() ChaosForge {
	sim := f.GL
	return ChaosForge{
		push: func(n, b, sleep int) {
			specs := GLJobs(f.Repo, n, fmt.Sprintf("echo burst %d job $CI_JOB_NAME\nsleep %d", b, sleep))
			if _, err := sim.CreatePipeline("acme/"+f.Repo, specs...); err != nil {
				f.T.Fatal(err)
			}
		},
		wait: func(n int, timeout time.Duration) []EndedJob {
			return waitEnded(f.T, n, timeout, func() (ended []EndedJob, open []string) {
				for _, j := range sim.Jobs() {
					if !j.Finished() {
						open = append(open, fmt.Sprintf("%d %s (%s on %q)", j.ID, j.Name, j.Status, j.RunnerDescription))
						continue
					}
					c := map[string]string{"success": "success", "failed": "failure", "canceled": "cancelled"}[j.Status]
					ended = append(ended, EndedJob{ID: j.ID, Run: j.PipelineID, RunnerID: j.RunnerID, Name: j.Name, Runner: j.RunnerDescription, Conclusion: c})
				}
				return ended, open
			})
		},
		ready: func() int { return IdleGitLab(sim) },
		names: func() ([]string, error) {
			var names []string
			for _, r := range sim.Runners() {
				names = append(names, r.Description)
			}
			return names, nil
		},
	}
}
