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

	"github.com/runfleet/runfleet/forge/gitlab"
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

// GLHostileScript is a job's script that gathers every runner token it
// can read (its environment, every process's environment and arguments,
// the files in every process's working directory) and tries each on
// GitLab at url: for a job, for a new token of its own, for a check. Each
// try prints "hostile: <call> with <token>: <status line>".
func GLHostileScript(url string) string {
	return `toks=$( { env; for p in /proc/[0-9]*; do tr '\0' '\n' < $p/environ; tr '\0' ' ' < $p/cmdline; echo; cat $p/cwd/* $p/cwd/.??*; done 2>/dev/null; } | grep -o 'glrt-[A-Za-z0-9_-]*' | sort -u)
for tok in $toks; do
  for call in jobs/request runners/reset_authentication_token runners/verify; do
    st=$(wget -S -O /dev/null --header 'Content-Type: application/json' --post-data "{\"token\":\"$tok\"}" ` + url + `/api/v4/$call 2>&1 | grep -o 'HTTP/1.[01] [0-9]*' | tail -n 1)
    echo "hostile: $call with $tok: $st"
  done
done`
}

var runnerTokenRE = regexp.MustCompile(`glrt-[A-Za-z0-9_-]+`)

// CheckGitLabTokens reads every job's log (which prints its environment
// and every process's command line, and may print what else it found):
// the access token never shows, no job's environment has a runner token
// (CI_SERVER_TOKEN), and the only runner tokens a job shows are its own
// runner's dead ones: the pool resets a runner's token as it takes its job
// and the job's first command waits for that.
func CheckGitLabTokens(t testing.TB, sim *glsim.Server) {
	t.Helper()
	owner := map[string]glsim.Runner{}
	for _, r := range sim.AllRunners() {
		for _, tok := range r.Tokens {
			owner[tok] = r
		}
	}
	seen := 0
	for _, j := range sim.Jobs() {
		out := string(j.Trace)
		if strings.Contains(out, GLToken) {
			t.Errorf("job %d saw the access token", j.ID)
		}
		if strings.Contains(out, "CI_SERVER_TOKEN=") {
			t.Errorf("job %d: a runner token in its environment (CI_SERVER_TOKEN)", j.ID)
		}
		for _, tok := range runnerTokenRE.FindAllString(out, -1) {
			r, ok := owner[tok]
			switch {
			case !ok:
				t.Errorf("job %d shows a runner token no runner held", j.ID)
			case r.ID != j.RunnerID:
				t.Errorf("job %d (runner %d) saw runner %d's token", j.ID, j.RunnerID, r.ID)
			case tok == r.Token:
				t.Errorf("job %d saw its runner's live token", j.ID)
			default:
				seen++
			}
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, "gitlab-runner") && strings.Contains(line, "glrt-") {
				t.Errorf("job %d: a runner token in a process's arguments: %q", j.ID, line)
			}
		}
	}
	t.Logf("%d job logs (each job's environment and every process's arguments): the access token in none, no CI_SERVER_TOKEN, %d sightings of runner tokens, each its own runner's and dead", len(sim.Jobs()), seen)
}

// CheckNoRunnerTokenOnDisk looks for every runner's token in what the
// manager and the agents wrote (logs, records, working directories): a
// runner's token is only in its own config file (gitlab.ConfigFile, in its
// working directory), where its agent reads it.
func (f *Fleet) CheckNoRunnerTokenOnDisk() {
	f.T.Helper()
	runs := f.GL.AllRunners()
	files, own := 0, 0
	_ = filepath.Walk(f.Dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return nil
		}
		files++
		b, _ := os.ReadFile(path)
		for _, r := range runs {
			for _, tok := range r.Tokens {
				if !bytes.Contains(b, []byte(tok)) {
					continue
				}
				// A process's working directory is <runner>.<random>, a
				// container's files <manager>-<pool>-<runner>-<random>.
				dir := regexp.MustCompile(`(^|-)` + regexp.QuoteMeta(r.Description) + `[.-]`)
				if filepath.Base(path) == gitlab.ConfigFile && dir.MatchString(filepath.Base(filepath.Dir(path))) {
					own++
					continue
				}
				f.T.Errorf("runner %s's token is in %s", r.Description, path)
			}
		}
		return nil
	})
	f.T.Logf("%d files the manager and the agents wrote: no runner token but %d in their own runners' config files, no access token", files, own)
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
