package bitbucket

import (
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/secret"
)

func TestDecode(t *testing.T) {
	for sec, want := range map[string]string{
		`{"workspace": "acme", "repository": "models"}`:                   "",
		`{"workspace": "acme", "repositories": ["a", "b"]}`:               "",
		`{"repository": "models"}`:                                        "workspace: is required",
		`{"workspace": "acme", "repository": "m", "repositories": ["a"]}`: "repositories: is for workspace runners",
		`{"workspace": "acme", "repositories": ["acme/a"]}`:               `repositories[0]: "acme/a" is not a repository slug`,
		`{"workspace": "acme", "project": "x"}`:                           "project",
	} {
		err := (driver{}).Check(forge.Config{Token: secret.String("t"), Section: []byte(sec)})
		switch {
		case want == "" && err != nil:
			t.Errorf("%s: %v", sec, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("%s: %v, want %q", sec, err, want)
		}
	}
	err := (driver{}).Check(forge.Config{URL: "api.bitbucket.org", Section: []byte(`{"workspace": "acme"}`)})
	if err == nil || !strings.Contains(err.Error(), "token: is required") || !strings.Contains(err.Error(), "url:") {
		t.Errorf("no token and a bad url: %v", err)
	}
}

func TestCheckLabels(t *testing.T) {
	if err := (driver{}).CheckLabels([]string{"gpu", "cuda.12", "self.hosted", "linux"}); err != nil {
		t.Error(err)
	}
	err := (driver{}).CheckLabels([]string{"gpu", "GPU", "gpu=a100"})
	if err == nil || !strings.Contains(err.Error(), `labels[1]: "GPU"`) || !strings.Contains(err.Error(), `labels[2]: "gpu=a100"`) {
		t.Errorf("bad labels: %v", err)
	}
	many := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"}
	if err := (driver{}).CheckLabels(many); err == nil || !strings.Contains(err.Error(), "at most 10") {
		t.Errorf("11 labels: %v", err)
	}
}

func TestRepoConfig(t *testing.T) {
	u, sec, err := (driver{}).RepoConfig("https://bitbucket.org/acme/models.git")
	if err != nil || u != DefaultURL || string(sec) != `{"repository":"models","workspace":"acme"}` {
		t.Errorf("got %s %s %v", u, sec, err)
	}
	if u, _, _ := (driver{}).RepoConfig("http://127.0.0.1:9/acme/models"); u != "http://127.0.0.1:9" {
		t.Errorf("a test bed's URL: %s", u)
	}
	if _, _, err := (driver{}).RepoConfig("https://bitbucket.org/acme"); err == nil {
		t.Error("a workspace URL taken as a repository")
	}
	env := map[string]string{"BITBUCKET_BUILD_NUMBER": "7"}
	getenv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	if !(driver{}).InCI(getenv) {
		t.Error("a Bitbucket step not recognised")
	}
}

func TestAuthorization(t *testing.T) {
	repoToken := base64.StdEncoding.EncodeToString([]byte("bot:pw"))
	for _, c := range []struct{ user, token, want string }{
		{"", "ATCTT3xFfGN0abc", "Bearer ATCTT3xFfGN0abc"},
		{"", repoToken, "Basic " + repoToken},
		{"bot", "pw", "Basic " + repoToken},
		{"", base64.StdEncoding.EncodeToString([]byte("no colon")), "Bearer " + base64.StdEncoding.EncodeToString([]byte("no colon"))},
	} {
		if got := authorization(c.user, c.token); got != c.want {
			t.Errorf("%q %q: %q, want %q", c.user, c.token, got, c.want)
		}
	}
}

// TestAgentSpec: the runner's credential is in its environment, never an
// argument, and the manager's environment is not inherited.
func TestAgentSpec(t *testing.T) {
	t.Setenv("BITBUCKET_TOKEN", "manager-secret")
	a := Agent{Path: "/opt/runner", Local: true}
	cred := forge.Credential{Env: map[string]string{EnvAccount: "{a}", EnvRunner: "{r}", EnvClientID: "id", EnvClientSecret: "s3cret"}}
	spec, err := a.Spec(agent.Runner{Name: "p-1", Manager: "m", Pool: "p", Env: map[string]string{"X": "1"}}, cred)
	if err != nil {
		t.Fatal(err)
	}
	if spec.Env[EnvClientSecret] != "s3cret" || spec.Env["X"] != "1" || spec.Env["BITBUCKET_TOKEN"] != "" {
		t.Errorf("env %v", spec.Env)
	}
	if slices.ContainsFunc(spec.Args, func(s string) bool { return strings.Contains(s, "s3cret") }) || spec.Args[len(spec.Args)-1] != "/opt/runner" {
		t.Errorf("args %q", spec.Args)
	}
	if _, err := a.Spec(agent.Runner{Name: "p-1"}, forge.Credential{}); err == nil {
		t.Error("a credential without the runner's client taken")
	}
	for out, want := range map[string]agent.Phase{
		"[t] Updating runner status to \"ONLINE\" and checking":                       agent.PhaseReady,
		"x\n[t] Getting step StepId{accountUuid={a}}.\n":                              agent.PhaseBusy,
		"[t] Getting step StepId{\n[t] Completing step with result Result{}\nWaiting": agent.PhaseDone,
	} {
		if got := a.Phase([]byte(out)); got != want {
			t.Errorf("%q: phase %v, want %v", out, got, want)
		}
	}
}

func TestMeets(t *testing.T) {
	d := &Forge{}
	pool := []string{"gpu", "gpu-h100", "cuda-12.4"}
	for runsOn, want := range map[string]bool{
		"self.hosted gpu":                true,
		"self.hosted linux gpu.h100":     true,
		"self.hosted cuda.12.4 GPU.H100": true,
		"self.hosted gpu.a100":           false,
		"self.hosted windows":            false,
	} {
		if got := d.Meets(pool, strings.Fields(runsOn)); got != want {
			t.Errorf("%s: %v, want %v", runsOn, got, want)
		}
	}
}

// fakeDocker stands in for Docker's CLI: `run` notes its arguments and
// environment, writes the container's ID where --cidfile says (as docker
// run does), prints the runner's lines for one step and then waits for
// the next, as the runner does, until `stop` names that ID.
const fakeDocker = `#!/bin/sh
case $1 in
run)
  shift
  echo "$*" > "$LOG/args"
  env > "$LOG/env"
  while [ $# -gt 0 ]; do [ "$1" = --cidfile ] && echo cid-1 > "$2"; shift; done
  echo 'Updating runner status to "ONLINE" and checking for new steps'
  echo 'Getting step StepId{accountUuid={a}}.'
  echo 'Completing step with result Result{status=PASSED}'
  echo 'Waiting for next step'
  i=0; while [ ! -f "$LOG/stopped" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
  exit 143 ;;
stop) echo "$*" > "$LOG/stop"; touch "$LOG/stopped" ;;
esac
`

// An agent.path of docker://IMAGE runs the runner as that image through
// the machine's engine, as Atlassian's instructions run it: the engine's
// socket and a working directory of its own at the same path inside and
// out, removed after it, the credential by name only, and the container
// stopped once the runner waits for its second step.
func TestAgentImage(t *testing.T) {
	bin, log := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "docker"), []byte(fakeDocker), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	a, err := (&Forge{}).Agent(agent.Config{Path: ImagePrefix + RunnerImage, Local: true})
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("p-%d", time.Now().UnixNano())
	t.Cleanup(func() { os.RemoveAll("/tmp/runfleet-" + name) })
	cred := forge.Credential{Env: map[string]string{EnvAccount: "{a}", EnvRunner: "{r}", EnvClientID: "id", EnvClientSecret: "s3cret"}}
	spec, err := a.(Agent).Spec(agent.Runner{Name: name, Pool: "p", Env: map[string]string{"X": "1"}}, cred)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(spec.Command, spec.Args...)
	cmd.Dir = t.TempDir()
	for k, v := range spec.Env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.Env = append(cmd.Env, "LOG="+log)
	done := make(chan error, 1)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("the runner was not stopped after its step:\n%s", out.String())
	}
	read := func(f string) string { b, _ := os.ReadFile(filepath.Join(log, f)); return string(b) }
	args := read("args")
	wd := "/tmp/runfleet-" + name
	for _, want := range []string{"--rm", "-v /var/run/docker.sock:/var/run/docker.sock", "-v " + wd + ":" + wd, "-e WORKING_DIRECTORY",
		"-e " + EnvClientSecret, "-e " + EnvRunner, "-e X", "--label runfleet.runner=" + name, RunnerImage} {
		if !strings.Contains(args, want) {
			t.Errorf("docker run %s: no %q", args, want)
		}
	}
	if strings.Contains(args, "s3cret") || strings.Contains(strings.Join(spec.Args, " "), "s3cret") || strings.Contains(args, "-e PATH") {
		t.Errorf("docker run %s: the secret, or the machine's PATH, in its arguments", args)
	}
	if env := read("env"); !strings.Contains(env, EnvClientSecret+"=s3cret") || !strings.Contains(env, "WORKING_DIRECTORY="+wd) {
		t.Errorf("docker run's environment lacks the credential or the working directory:\n%s", env)
	}
	if stop := read("stop"); !strings.Contains(stop, "cid-1") {
		t.Errorf("docker stop %q: not the runner's container\n%s", stop, out.String())
	}
	if _, err := os.Stat(wd); !os.IsNotExist(err) {
		t.Errorf("the runner's working directory %s outlived it: %v", wd, err)
	}
	if a.(Agent).Phase([]byte(out.String())) != agent.PhaseDone {
		t.Errorf("phase of %q", out.String())
	}
	for _, bad := range []string{ImagePrefix, ImagePrefix + "a b", ImagePrefix + "x$(id)"} {
		if _, err := (&Forge{}).Agent(agent.Config{Path: bad}); err == nil || !strings.Contains(err.Error(), "agent.path") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
