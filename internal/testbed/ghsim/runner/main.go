// Command runner stands in for GitHub's runner (actions/runner) against the
// simulator in ghsim. Like run.sh it takes its just-in-time config from
// --jitconfig or, better, from ACTIONS_RUNNER_INPUT_JITCONFIG, which it
// clears before any job step runs. It prints the lines Runner.Listener
// prints (Listening for Jobs, Running job, completed with result), takes
// one job, runs its script with sh -c while heartbeating, reports the
// result and exits: a JIT runner is ephemeral.
package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

const jitEnv = "ACTIONS_RUNNER_INPUT_JITCONFIG"

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "%s: An error occurred: %v\n", stamp(), err)
		os.Exit(1)
	}
}

func stamp() string { return time.Now().UTC().Format("2006-01-02 15:04:05Z") }

type settings struct {
	name, server, token string
}

func decode(jit string) (settings, error) {
	var files map[string]string
	raw, err := base64.StdEncoding.DecodeString(jit)
	if err != nil {
		return settings{}, fmt.Errorf("jitconfig is not base64: %w", err)
	}
	if err := json.Unmarshal(raw, &files); err != nil {
		return settings{}, fmt.Errorf("jitconfig: %w", err)
	}
	file := func(name string, v any) error {
		b, err := base64.StdEncoding.DecodeString(files[name])
		if err != nil {
			return fmt.Errorf("jitconfig %s: %w", name, err)
		}
		return json.Unmarshal(b, v)
	}
	var r struct {
		Name   string `json:"agentName"`
		Server string `json:"serverUrl"`
	}
	var c struct {
		Data struct {
			Token string `json:"token"`
		} `json:"data"`
	}
	if err := file(".runner", &r); err != nil {
		return settings{}, err
	}
	if err := file(".credentials", &c); err != nil {
		return settings{}, err
	}
	return settings{name: r.Name, server: strings.TrimRight(r.Server, "/"), token: c.Data.Token}, nil
}

type client struct {
	s settings
	h *http.Client
}

func (c client) post(ctx context.Context, path string, body any, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.s.server+path, rd)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Authorization", "Bearer "+c.s.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.h.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return resp.StatusCode, fmt.Errorf("%s: %s: %s", path, resp.Status, strings.TrimSpace(string(msg)))
	}
	if out != nil && resp.StatusCode == http.StatusOK {
		return resp.StatusCode, json.NewDecoder(resp.Body).Decode(out)
	}
	return resp.StatusCode, nil
}

type job struct {
	ID     int64  `json:"id"`
	Name   string `json:"name"`
	Script string `json:"script"`
}

func run() error {
	jit := os.Getenv(jitEnv)
	// The runner clears the variable so that no job step inherits it.
	os.Unsetenv(jitEnv)
	for i, a := range os.Args[1:] {
		if a == "--jitconfig" && i+2 < len(os.Args) {
			jit = os.Args[i+2]
		}
	}
	if jit == "" {
		return errors.New("no just-in-time config: set " + jitEnv + " or pass --jitconfig")
	}
	s, err := decode(jit)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	c := client{s: s, h: &http.Client{Timeout: 30 * time.Second}}
	if _, err := c.post(ctx, "/_runner/connect", nil, nil); err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	fmt.Println("√ Connected to GitHub")
	fmt.Println()
	fmt.Println("Current runner version: '2.330.0'")
	fmt.Printf("%s: Listening for Jobs\n", stamp())
	for {
		var j job
		code, err := c.post(ctx, "/_runner/acquire", nil, &j)
		if ctx.Err() != nil {
			fmt.Printf("%s: Exiting...\n", stamp())
			return nil
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: acquire: %v\n", stamp(), err)
			time.Sleep(time.Second)
			continue
		}
		if code != http.StatusOK {
			continue
		}
		fmt.Printf("%s: Running job: %s\n", stamp(), j.Name)
		conclusion, output := execute(ctx, c, j)
		if conclusion == "cancelled" {
			// The service ended the job itself: nothing to report.
			fmt.Printf("%s: Job %s completed with result: Canceled\n", stamp(), j.Name)
			return nil
		}
		result := "Succeeded"
		if conclusion != "success" {
			result = "Failed"
		}
		if _, err := c.post(context.WithoutCancel(ctx), "/_runner/complete", map[string]any{"id": j.ID, "conclusion": conclusion, "output": output}, nil); err != nil {
			return fmt.Errorf("report job %s: %w", j.Name, err)
		}
		fmt.Printf("%s: Job %s completed with result: %s\n", stamp(), j.Name, result)
		return nil
	}
}

// execute runs a job's script, heartbeating until it ends.
func execute(ctx context.Context, c client, j job) (conclusion, output string) {
	hb, cancel := context.WithCancel(ctx)
	defer cancel()
	// A heartbeat answered 409 cancels the job (its timeout passed): the
	// script is killed and the job not reported.
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	var cancelled atomic.Bool
	go func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-hb.Done():
				return
			case <-t.C:
				if code, _ := c.post(hb, "/_runner/heartbeat", map[string]any{"id": j.ID}, nil); code == http.StatusConflict {
					fmt.Printf("%s: Job %s cancelled by the service\n", stamp(), j.Name)
					cancelled.Store(true)
					stop()
					return
				}
			}
		}
	}()
	cmd := exec.CommandContext(ctx, "sh", "-c", j.Script)
	// A cancelled job's whole script goes, not only its shell.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	cmd.Env = append(os.Environ(), "GITHUB_ACTIONS=true", "CI=true", "GITHUB_JOB="+j.Name, "RUNNER_NAME="+c.s.name)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if out.Len() > 1<<16 {
		out.Truncate(1 << 16)
	}
	switch {
	case cancelled.Load():
		return "cancelled", out.String()
	case err != nil:
		return "failure", out.String() + "\n" + err.Error()
	}
	return "success", out.String()
}
