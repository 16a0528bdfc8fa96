// Command runner stands in for gitlab-runner against the simulator in
// glsim: `gitlab-runner run-single` with the shell executor, speaking the
// runner protocol of gitlab-runner's network/gitlab.go. It takes the URL
// and token from CI_SERVER_URL and CI_SERVER_TOKEN (or --url and --token),
// or from a config file's runner (--config, --runner, as
// commands/single.go's HandleArgs: the runner's url, token, executor,
// pre_get_sources_script and pre_build_script),
// asks POST /api/v4/jobs/request for a job, runs its script with sh -c in
// a process group of its own and an environment of its own plus the job's
// variables (as the shell executor does), sends the log with PATCH
// /jobs/:id/trace and the result with PUT /jobs/:id, and stops after
// --max-builds jobs or --wait-timeout seconds without one. It prints the
// lines gitlab-runner prints ("Checking for jobs... received", "This
// runner has processed its build limit, so now exiting"). `gitlab-runner
// verify --config F --name N` checks the named runner's token as
// commands/verify.go does: "is valid" and exit 0, or "is not valid" and
// exit 1 for GitLab's 403, a failed call counted as valid.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/BurntSushi/toml"
)

// checkInterval is how long an idle runner waits between job requests
// (gitlab-runner's common.CheckInterval is 3 s; GitLab's long polling
// makes up for it, which the simulator does not do).
const checkInterval = time.Second

func main() {
	if len(os.Args) >= 2 && os.Args[1] == "verify" {
		os.Exit(verify(os.Args[2:]))
	}
	if len(os.Args) < 2 || os.Args[1] != "run-single" {
		fmt.Fprintln(os.Stderr, "usage: gitlab-runner run-single|verify [options]")
		os.Exit(2)
	}
	r, err := configure(os.Args[2:])
	if err != nil {
		logf("FATAL: %v", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGQUIT)
	defer stop()
	os.Exit(r.run(ctx))
}

type runner struct {
	url, token, executor, buildsDir, name string
	// preGetSources and preBuild are the config file's hooks.
	preGetSources, preBuild string
	maxBuilds, waitTimeout  int
	hc                      *http.Client
	systemID                string
}

// fileRunner is a [[runners]] entry of config.toml (common/config.go),
// the keys the stand-in reads.
type fileRunner struct {
	Name          string `toml:"name"`
	URL           string `toml:"url"`
	Token         string `toml:"token"`
	Executor      string `toml:"executor"`
	BuildsDir     string `toml:"builds_dir"`
	PreGetSources string `toml:"pre_get_sources_script"`
	PreBuild      string `toml:"pre_build_script"`
}

// loadRunner reads the named runner of a config file, as
// configfile.Load and Config.RunnerByName do.
func loadRunner(path, name string) (fileRunner, error) {
	var cfg struct {
		Runners []fileRunner `toml:"runners"`
	}
	if _, err := toml.DecodeFile(path, &cfg); err != nil {
		return fileRunner{}, fmt.Errorf("Error loading config: decoding configuration file: %w", err)
	}
	for _, fr := range cfg.Runners {
		if fr.Name == name {
			return fr, nil
		}
	}
	return fileRunner{}, fmt.Errorf("Error loading runner by name: could not find a runner with the name '%s'", name)
}

func configure(args []string) (*runner, error) {
	fs := flag.NewFlagSet("run-single", flag.ContinueOnError)
	r := &runner{hc: &http.Client{Timeout: 30 * time.Second}, systemID: fmt.Sprintf("s_%012x", os.Getpid())}
	fs.StringVar(&r.url, "url", os.Getenv("CI_SERVER_URL"), "GitLab instance URL")
	fs.StringVar(&r.token, "token", os.Getenv("CI_SERVER_TOKEN"), "runner token")
	fs.StringVar(&r.executor, "executor", os.Getenv("RUNNER_EXECUTOR"), "executor")
	fs.StringVar(&r.buildsDir, "builds-dir", os.Getenv("RUNNER_BUILDS_DIR"), "builds directory")
	fs.StringVar(&r.name, "description", os.Getenv("RUNNER_NAME"), "runner name")
	fs.IntVar(&r.maxBuilds, "max-builds", 0, "how many builds to process before exiting")
	fs.IntVar(&r.waitTimeout, "wait-timeout", 0, "seconds to wait for the first job")
	config := fs.String("config", os.Getenv("CONFIG_FILE"), "config file")
	name := fs.String("runner", "", "runner name from the config file")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *name != "" {
		fr, err := loadRunner(*config, *name)
		if err != nil {
			return nil, err
		}
		r.name, r.url, r.token, r.executor, r.buildsDir = fr.Name, fr.URL, fr.Token, fr.Executor, fr.BuildsDir
		r.preGetSources, r.preBuild = fr.PreGetSources, fr.PreBuild
	}
	switch {
	case r.url == "":
		return nil, errors.New("Missing URL")
	case r.token == "":
		return nil, errors.New("Missing Token")
	case r.executor == "":
		return nil, errors.New("Missing Executor")
	case r.executor != "shell":
		return nil, fmt.Errorf("Unknown executor: %s", r.executor)
	}
	r.url = strings.TrimRight(r.url, "/")
	if r.buildsDir == "" {
		wd, _ := os.Getwd()
		r.buildsDir = filepath.Join(wd, "builds")
	}
	return r, nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
}

// short is gitlab-runner's ShortenToken: the token's first 9 characters
// after its prefix.
func short(tok string) string {
	tok = regexp.MustCompile(`^glrt-(t[123]_)?`).ReplaceAllString(tok, "")
	return tok[:min(9, len(tok))]
}

func (r *runner) run(ctx context.Context) int {
	logf("Runtime platform                                    arch=amd64 os=linux pid=%d revision=glsim version=18.6.0", os.Getpid())
	logf("Starting runner for %s with token %s ...", r.url, short(r.token))
	last := time.Now()
	for ctx.Err() == nil {
		job, wait := r.request(ctx)
		if job != nil {
			r.process(ctx, job)
			last = time.Now()
			if r.maxBuilds > 0 {
				r.maxBuilds--
				if r.maxBuilds == 0 {
					logf("This runner has processed its build limit, so now exiting")
					return 0
				}
			}
			continue
		}
		if r.waitTimeout > 0 && time.Since(last) > time.Duration(r.waitTimeout)*time.Second {
			logf("This runner has not received a job in %d seconds, so now exiting", r.waitTimeout)
			return 0
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	logf("Requested exit: terminated")
	return 0
}

// job is the part of spec.Job the stand-in uses.
type job struct {
	ID      int64  `json:"id"`
	Token   string `json:"token"`
	JobInfo struct {
		Name      string `json:"name"`
		ProjectID int64  `json:"project_id"`
		Path      string `json:"project_full_path"`
	} `json:"job_info"`
	GitInfo struct {
		RepoURL string `json:"repo_url"`
	} `json:"git_info"`
	Variables []struct {
		Key   string `json:"key"`
		Value string `json:"value"`
	} `json:"variables"`
	Steps []struct {
		Name    string   `json:"name"`
		Script  []string `json:"script"`
		Timeout int      `json:"timeout"`
	} `json:"steps"`
}

// request asks for a job: a job, or nil and how long to wait.
func (r *runner) request(ctx context.Context) (*job, time.Duration) {
	body, _ := json.Marshal(map[string]any{
		"info":  map[string]any{"name": "gitlab-runner", "version": "18.6.0", "revision": "glsim", "platform": "linux", "architecture": "amd64", "executor": r.executor, "shell": "bash", "features": map[string]bool{"variables": true, "trace_reset": true, "trace_checksum": true, "trace_size": true, "cancelable": true}},
		"token": r.token, "system_id": r.systemID,
	})
	req, err := http.NewRequestWithContext(ctx, "POST", r.url+"/api/v4/jobs/request", bytes.NewReader(body))
	if err != nil {
		return nil, checkInterval
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("RUNNER-TOKEN", r.token)
	resp, err := r.hc.Do(req)
	if err != nil {
		if ctx.Err() == nil {
			logf("WARNING: Checking for jobs... failed                runner=%s status=%v", short(r.token), err)
		}
		return nil, checkInterval
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusCreated:
		var j job
		if err := json.NewDecoder(resp.Body).Decode(&j); err != nil {
			logf("ERROR: Checking for jobs... client error     runner=%s error=%v", short(r.token), err)
			return nil, checkInterval
		}
		return &j, 0
	case http.StatusNoContent:
		return nil, checkInterval
	case http.StatusForbidden:
		logf("ERROR: Checking for jobs... forbidden                runner=%s", short(r.token))
		logf("Runner is not healthy!")
		return nil, 3 * checkInterval
	}
	logf("WARNING: Checking for jobs... failed                runner=%s status=%s", short(r.token), resp.Status)
	return nil, checkInterval
}

// trace is a job's log as it is written and sent.
type trace struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	sent int
}

func (t *trace) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.buf.Write(p)
}

func (t *trace) pending() (int, []byte) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.sent, bytes.Clone(t.buf.Bytes()[t.sent:])
}

func (t *trace) all() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return bytes.Clone(t.buf.Bytes())
}

func (r *runner) process(ctx context.Context, j *job) {
	repo := regexp.MustCompile(`//[^@/]*@`).ReplaceAllString(j.GitInfo.RepoURL, "//")
	logf("Checking for jobs... received                       job=%d repo_url=%s runner=%s", j.ID, repo, short(r.token))
	if code := r.update(j, "running", "", 0, nil); code == http.StatusForbidden {
		return
	}
	t := &trace{}
	fmt.Fprintf(t, "Running with gitlab-runner 18.6.0 (glsim)\n  on %s %s\nUsing Shell (sh) executor...\n", r.name, short(r.token))
	jobCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	canceled := make(chan struct{})
	var once sync.Once
	done := make(chan struct{})
	go func() { // sends the log every second; a canceled job stops
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Second):
			}
			if r.patch(j, t) == "canceled" {
				once.Do(func() { close(canceled) })
				cancel()
				return
			}
		}
	}()
	state, reason, exit := r.script(jobCtx, j, t)
	close(done)
	select {
	case <-canceled:
		logf("WARNING: Job failed: canceled                   job=%d runner=%s", j.ID, short(r.token))
		return
	default:
	}
	if ctx.Err() != nil {
		state, reason = "failed", "runner_system_failure"
	}
	if state == "success" {
		fmt.Fprintf(t, "Job succeeded\n")
	} else {
		fmt.Fprintf(t, "ERROR: Job failed: exit status %d\n", exit)
	}
	for range 30 {
		r.patch(j, t)
		code := r.update(j, state, reason, exit, t)
		if code != http.StatusAccepted && code < 500 && code != 0 {
			break
		}
		time.Sleep(time.Second)
	}
	if state == "success" {
		logf("Job succeeded                                       job=%d project=%d runner=%s", j.ID, j.JobInfo.ProjectID, short(r.token))
	} else {
		logf("WARNING: Job failed: exit status %d               job=%d project=%d runner=%s", exit, j.ID, j.JobInfo.ProjectID, short(r.token))
	}
}

// script runs the job's stages with sh -c in the build directory, the
// job's variables in their environment: get_sources (the config's
// pre_get_sources_script, which gitlab-runner skips when GIT_STRATEGY is
// none or empty: shells/abstract.go, guardGetSourcesScriptHooks), then
// step_script (the config's pre_build_script, then the job's script, in
// one shell).
func (r *runner) script(ctx context.Context, j *job, t io.Writer) (state, reason string, exit int) {
	dir := filepath.Join(r.buildsDir, short(r.token), "0", j.JobInfo.Path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fmt.Fprintf(t, "ERROR: %v\n", err)
		return "failed", "runner_system_failure", 1
	}
	env := os.Environ()
	strategy := ""
	for _, v := range j.Variables {
		env = append(env, v.Key+"="+v.Value)
		if v.Key == "GIT_STRATEGY" {
			strategy = v.Value
		}
	}
	env = append(env, "CI_BUILDS_DIR="+r.buildsDir, "CI_PROJECT_DIR="+dir, "CI_RUNNER_SHORT_TOKEN="+short(r.token))
	for _, st := range j.Steps {
		if st.Name != "script" {
			continue
		}
		timeout := time.Duration(max(st.Timeout, 1)) * time.Second
		sctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		stages := [][2]string{}
		if r.preGetSources != "" && strategy != "none" && strategy != "empty" {
			stages = append(stages, [2]string{"get_sources", r.preGetSources})
		}
		body := strings.Join(st.Script, "\n")
		if r.preBuild != "" {
			body = r.preBuild + "\n" + body
		}
		stages = append(stages, [2]string{"step_script", body})
		for _, sg := range stages {
			err := r.stage(sctx, sg[0], sg[1], dir, env, t)
			timedOut := errors.Is(sctx.Err(), context.DeadlineExceeded)
			switch {
			case timedOut:
				fmt.Fprintf(t, "ERROR: Job failed: execution took longer than %s seconds\n", strconv.Itoa(st.Timeout))
				return "failed", "job_execution_timeout", 1
			case ctx.Err() != nil:
				return "failed", "job_canceled", 1
			case err != nil:
				code := 1
				var ee *exec.ExitError
				if errors.As(err, &ee) {
					code = ee.ExitCode()
				} else {
					fmt.Fprintf(t, "ERROR: %v\n", err)
					return "failed", "runner_system_failure", 1
				}
				return "failed", "script_failure", code
			}
		}
	}
	return "success", "", 0
}

// stage runs one stage's shell in a process group of its own, killed
// with the context.
func (r *runner) stage(ctx context.Context, name, script, dir string, env []string, t io.Writer) error {
	cmd := exec.Command("sh", "-c", script)
	cmd.Dir, cmd.Env, cmd.Stdout, cmd.Stderr = dir, env, t, t
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	fmt.Fprintf(t, "Executing \"%s\" stage of the job script\n", name)
	if err := cmd.Start(); err != nil {
		return err
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	select {
	case err := <-waited:
		return err
	case <-ctx.Done():
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		return <-waited
	}
}

// verify is `gitlab-runner verify --config F --name N`
// (commands/verify.go): POST /runners/verify with the runner's token;
// "is valid" and 0 for a 200, "is not valid" and 1 for a 403, a failed
// call logged and counted as valid.
func verify(args []string) int {
	fs := flag.NewFlagSet("verify", flag.ContinueOnError)
	config := fs.String("config", os.Getenv("CONFIG_FILE"), "config file")
	name := fs.String("name", "", "runner name")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fr, err := loadRunner(*config, *name)
	if err != nil {
		logf("FATAL: %v", err)
		return 1
	}
	body, _ := json.Marshal(map[string]any{"token": fr.Token, "system_id": fmt.Sprintf("s_%012x", os.Getpid())})
	req, err := http.NewRequest("POST", strings.TrimRight(fr.URL, "/")+"/api/v4/runners/verify", bytes.NewReader(body))
	if err != nil {
		logf("FATAL: %v", err)
		return 1
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		logf("ERROR: Verifying runner... failed                 runner=%s status=%v", short(fr.Token), err)
		return 0
	}
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		logf("Verifying runner... is valid                        runner=%s", short(fr.Token))
		return 0
	case http.StatusForbidden:
		logf("Verifying runner... is not valid                    runner=%s", short(fr.Token))
		logf("FATAL: Failed to verify runners")
		return 1
	}
	logf("ERROR: Verifying runner... failed                 runner=%s status=%s", short(fr.Token), resp.Status)
	return 0
}

// patch sends the log not yet sent; it returns the job's status when
// GitLab says it, "canceled" for a job canceled meanwhile.
func (r *runner) patch(j *job, t *trace) string {
	from, data := t.pending()
	if len(data) == 0 {
		return ""
	}
	req, _ := http.NewRequest("PATCH", fmt.Sprintf("%s/api/v4/jobs/%d/trace?debug_trace=false", r.url, j.ID), bytes.NewReader(data))
	req.Header.Set("Content-Type", "text/plain")
	req.Header.Set("JOB-TOKEN", j.Token)
	req.Header.Set("Content-Range", fmt.Sprintf("%d-%d", from, from+len(data)-1))
	resp, err := r.hc.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	status := resp.Header.Get("Job-Status")
	switch resp.StatusCode {
	case http.StatusAccepted:
		t.mu.Lock()
		t.sent = from + len(data)
		t.mu.Unlock()
	case http.StatusRequestedRangeNotSatisfiable:
		// GitLab has another length: send from there.
		if _, end, ok := strings.Cut(resp.Header.Get("Range"), "-"); ok {
			if n, err := strconv.Atoi(end); err == nil {
				t.mu.Lock()
				t.sent = min(n, t.buf.Len())
				t.mu.Unlock()
			}
		}
	}
	if status == "canceled" || status == "canceling" || status == "failed" {
		return "canceled"
	}
	return status
}

// update sends the job's state; it returns the status code, 0 when no
// answer came.
func (r *runner) update(j *job, state, reason string, exit int, t *trace) int {
	body := map[string]any{"token": j.Token, "state": state, "info": map[string]any{"name": "gitlab-runner", "version": "18.6.0"}}
	if t != nil {
		all := t.all()
		body["output"] = map[string]any{"checksum": fmt.Sprintf("crc32:%08x", crc32.ChecksumIEEE(all)), "bytesize": len(all)}
		body["exit_code"] = exit
		if reason != "" {
			body["failure_reason"] = reason
		}
	}
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest("PUT", fmt.Sprintf("%s/api/v4/jobs/%d", r.url, j.ID), bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("JOB-TOKEN", j.Token)
	resp, err := r.hc.Do(req)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}
