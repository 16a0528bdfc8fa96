// Command runner stands in for Bitbucket Pipelines' runner in the test
// bed. It reads what Bitbucket's runner reads from its environment
// (ACCOUNT_UUID, REPOSITORY_UUID, RUNNER_UUID, OAUTH_CLIENT_ID,
// OAUTH_CLIENT_SECRET, WORKING_DIRECTORY) and BITBUCKET_RUNNER_API_URL for
// the simulator's address, and speaks bbsim's runner protocol (bbsim's
// invention: Atlassian does not publish the runner's). Like the real
// runner it has no single-step mode: after a step it waits for the next,
// until it is stopped. It prints the runner's log lines that the manager
// reads: `Updating runner status to "ONLINE"` once connected, "Getting step
// StepId{...}" when it takes a step, "Completing step with result" when
// the step ends.
//
// A step runs with sh in a fresh build directory below WORKING_DIRECTORY,
// removed after it, with the runner's environment less its OAuth client,
// as the runner's build container is given none of it.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

type runner struct {
	api, uuid, account, repo string
	token                    string
	work                     string
	setup                    time.Duration // before a step's script runs
	hc                       *http.Client
}

type step struct {
	UUID     string `json:"uuid"`
	Pipeline string `json:"pipeline_uuid"`
	Repo     string `json:"repository_uuid"`
	Build    int64  `json:"build_number"`
	Name     string `json:"name"`
	Script   string `json:"script"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil && ctx.Err() == nil {
		logf("Runner failed: %v", err)
		os.Exit(1)
	}
}

func logf(format string, args ...any) {
	fmt.Printf("[%s] %s\n", time.Now().UTC().Format("2006-01-02 15:04:05,000"), fmt.Sprintf(format, args...))
}

func run(ctx context.Context) error {
	r := &runner{api: strings.TrimRight(os.Getenv("BITBUCKET_RUNNER_API_URL"), "/"), uuid: os.Getenv("RUNNER_UUID"),
		account: os.Getenv("ACCOUNT_UUID"), repo: os.Getenv("REPOSITORY_UUID"), work: os.Getenv("WORKING_DIRECTORY"),
		hc: &http.Client{Timeout: 30 * time.Second}}
	id, secret := os.Getenv("OAUTH_CLIENT_ID"), os.Getenv("OAUTH_CLIENT_SECRET")
	if r.api == "" || r.uuid == "" || r.account == "" || id == "" || secret == "" || r.work == "" {
		return errors.New("ACCOUNT_UUID, RUNNER_UUID, OAUTH_CLIENT_ID, OAUTH_CLIENT_SECRET, WORKING_DIRECTORY and BITBUCKET_RUNNER_API_URL are required")
	}
	poll, err := r.login(ctx, id, secret)
	if err != nil {
		return err
	}
	logf("Updating runner status to \"ONLINE\" and checking for new steps assigned to the runner after 0 seconds and then every %g seconds.", poll.Seconds())
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.send(c, http.MethodPut, "/state", map[string]string{"status": "OFFLINE"}, nil)
	}()
	for {
		if err := r.send(ctx, http.MethodPut, "/state", map[string]string{"status": "ONLINE"}, nil); err != nil {
			logf("Failed to update the runner's state: %v", err)
		}
		var st step
		err := r.send(ctx, http.MethodGet, "/step", nil, &st)
		switch {
		case err != nil:
			logf("Failed to check for new steps: %v", err)
		case st.UUID != "":
			r.runStep(ctx, st)
			logf("Waiting for next step.")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(poll):
		}
	}
}

// login takes an access token for the runner's OAuth client, retrying
// while the API cannot be reached, and returns how often to check for a
// step: the simulator's word, 30 s (the real runner's) without it.
func (r *runner) login(ctx context.Context, id, secret string) (time.Duration, error) {
	form := url.Values{"grant_type": {"client_credentials"}, "client_id": {id}, "client_secret": {secret}}
	for attempt := 0; ; attempt++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.api+"/oauth/token", strings.NewReader(form.Encode()))
		if err != nil {
			return 0, err
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		resp, err := r.hc.Do(req)
		if err == nil {
			var tok struct {
				AccessToken string `json:"access_token"`
				CheckMS     int64  `json:"check_interval_ms"`
				SetupMS     int64  `json:"step_setup_ms"`
			}
			err = json.NewDecoder(resp.Body).Decode(&tok)
			resp.Body.Close()
			if resp.StatusCode == http.StatusUnauthorized {
				return 0, errors.New("the runner's OAuth client was refused: it was deleted, or its secret is wrong")
			}
			if err == nil && tok.AccessToken != "" {
				r.token = tok.AccessToken
				r.setup = time.Duration(tok.SetupMS) * time.Millisecond
				if tok.CheckMS > 0 {
					return time.Duration(tok.CheckMS) * time.Millisecond, nil
				}
				return 30 * time.Second, nil
			}
			if err == nil {
				err = fmt.Errorf("the token endpoint answered %s", resp.Status)
			}
		}
		if attempt >= 30 {
			return 0, fmt.Errorf("no access token: %v", err)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func (r *runner) send(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if b, ok := body.([]byte); ok {
		rd = bytes.NewReader(b)
	} else if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, r.api+"/runner-api/runners/"+url.PathEscape(r.uuid)+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+r.token)
	resp, err := r.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("%s %s: %d %s", method, path, resp.StatusCode, b)
	}
	if out != nil && resp.StatusCode == http.StatusOK {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}

// runStep runs a step, heartbeats going on meanwhile, and reports its log
// and result.
func (r *runner) runStep(ctx context.Context, st step) {
	logf("Getting step StepId{accountUuid=%s, repositoryUuid=%s, pipelineUuid=%s, stepUuid=%s}.", r.account, st.Repo, st.Pipeline, st.UUID)
	logf("Setting runner state to executing step.")
	hbCtx, stopHB := context.WithCancel(ctx)
	go func() {
		for {
			select {
			case <-hbCtx.Done():
				return
			case <-time.After(2 * time.Second):
				_ = r.send(hbCtx, http.MethodPut, "/state", map[string]string{"status": "ONLINE"}, nil)
			}
		}
	}()
	logf("Setting up step %s.", st.Name)
	var out []byte
	var err error
	select {
	case <-ctx.Done():
		err = ctx.Err()
	case <-time.After(r.setup):
		logf("Executing step.")
		out, err = r.exec(ctx, st)
	}
	stopHB()
	result, status := "SUCCESSFUL", "PASSED"
	if err != nil {
		result, status = "FAILED", "FAILED"
		out = append(out, fmt.Sprintf("\n%v\n", err)...)
	}
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := r.send(c, http.MethodPost, "/steps/"+url.PathEscape(st.UUID)+"/log", out, nil); err != nil {
		logf("Failed to upload the step's log: %v", err)
	}
	if err := r.send(c, http.MethodPut, "/steps/"+url.PathEscape(st.UUID)+"/result", map[string]string{"result": result}, nil); err != nil {
		logf("Failed to complete the step: %v", err)
	}
	logf("Completing step with result Result{status=%s, error=None}.", status)
	logf("Setting runner state to not executing step.")
}

func (r *runner) exec(ctx context.Context, st step) ([]byte, error) {
	dir := filepath.Join(r.work, "build")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cmd := exec.CommandContext(ctx, "sh", "-c", st.Script)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "OAUTH_CLIENT_SECRET" && k != "OAUTH_CLIENT_ID" {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "BITBUCKET_BUILD_NUMBER="+fmt.Sprint(st.Build), "BITBUCKET_STEP_UUID="+st.UUID,
		"BITBUCKET_PIPELINE_UUID="+st.Pipeline, "BITBUCKET_CLONE_DIR="+dir)
	return cmd.CombinedOutput()
}
