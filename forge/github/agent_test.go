package github_test

import (
	"strings"
	"testing"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/github"
)

func TestAgentSpecKeepsCredentialOutOfArguments(t *testing.T) {
	r := agent.Runner{Name: "gpu-1", Manager: "m", Pool: "gpu", Labels: []string{"gpu", "linux"}, Env: map[string]string{"HF_HOME": "/data/hf"}}
	for _, cred := range []forge.Credential{
		{RunnerID: 7, Env: map[string]string{"ACTIONS_RUNNER_INPUT_JITCONFIG": "SECRETJIT"}},
		{Env: map[string]string{"ACTIONS_RUNNER_INPUT_TOKEN": "SECRETTOKEN", "ACTIONS_RUNNER_INPUT_URL": "https://github.com/acme/app"}},
	} {
		for _, inContainer := range []bool{false, true} {
			spec, err := github.Agent{Path: "/home/runner/run.sh", InContainer: inContainer}.Spec(r, cred)
			if err != nil {
				t.Fatal(err)
			}
			args := spec.Command + " " + strings.Join(spec.Args, " ")
			if strings.Contains(args, "SECRET") {
				t.Errorf("credential in the command line: %s", args)
			}
			for k, v := range cred.Env {
				if spec.Env[k] != v {
					t.Errorf("%s not passed in the environment", k)
				}
			}
			if spec.Env["HF_HOME"] != "/data/hf" || (inContainer && spec.Env["RUNNER_ALLOW_RUNASROOT"] != "1") {
				t.Errorf("env = %v", spec.Env)
			}
		}
	}
	if _, err := (github.Agent{Path: "run.sh"}).Spec(r, forge.Credential{}); err == nil {
		t.Error("a credential with neither JIT config nor token was accepted")
	}
}

func TestAgentPhase(t *testing.T) {
	const (
		ready = "√ Connected to GitHub\n\nCurrent runner version: '2.330.0'\n2026-11-21 10:00:00Z: Listening for Jobs\n"
		busy  = ready + "2026-11-21 10:00:05Z: Running job: test (3)\n"
		done  = busy + "2026-11-21 10:01:05Z: Job test (3) completed with result: Failed\n"
	)
	for out, want := range map[string]agent.Phase{"": agent.PhaseUnknown, "√ Connected to GitHub\n": agent.PhaseUnknown, ready: agent.PhaseReady, busy: agent.PhaseBusy, done: agent.PhaseDone,
		// Docker's copy prefixes each line with the engine's timestamp.
		"2026-11-21T10:00:05.1Z 2026-11-21 10:00:05Z: Running job: x\n": agent.PhaseBusy} {
		if got := (github.Agent{}).Phase([]byte(out)); got != want {
			t.Errorf("Phase(%q) = %s, want %s", out, got, want)
		}
	}
}

// The forge's agent defaults: run.sh in PATH on this host, the image's
// run.sh in a container.
func TestAgentDefaults(t *testing.T) {
	d, err := github.New(github.Config{URL: "https://github.com/acme/app", Token: "t"})
	if err != nil {
		t.Fatal(err)
	}
	a, err := d.Agent(agent.Config{})
	if err != nil || a.(github.Agent).Path != github.ImageRunScript || !a.(github.Agent).InContainer {
		t.Errorf("in an image: %+v %v", a, err)
	}
	t.Setenv("PATH", t.TempDir())
	if _, err := d.Agent(agent.Config{Local: true}); err == nil || !strings.Contains(err.Error(), `agent.path: "run.sh"`) {
		t.Errorf("on this host without run.sh: %v", err)
	}
}
