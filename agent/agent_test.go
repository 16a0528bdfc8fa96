package agent

import (
	"strings"
	"testing"

	"github.com/runfleet/runfleet/forge"
)

func TestGitHubRunnerSpecKeepsCredentialOutOfArguments(t *testing.T) {
	r := Runner{Name: "gpu-1", Manager: "m", Pool: "gpu", Labels: []string{"gpu", "linux"}, Env: map[string]string{"HF_HOME": "/data/hf"}}
	for _, cred := range []forge.Credential{
		{RunnerID: 7, Env: map[string]string{"ACTIONS_RUNNER_INPUT_JITCONFIG": "SECRETJIT"}},
		{Env: map[string]string{"ACTIONS_RUNNER_INPUT_TOKEN": "SECRETTOKEN", "ACTIONS_RUNNER_INPUT_URL": "https://github.com/acme/app"}},
	} {
		for _, inContainer := range []bool{false, true} {
			spec, err := GitHubRunner{Path: "/home/runner/run.sh", InContainer: inContainer}.Spec(r, cred)
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
	if _, err := (GitHubRunner{Path: "run.sh"}).Spec(r, forge.Credential{}); err == nil {
		t.Error("a credential with neither JIT config nor token was accepted")
	}
}

func TestGitHubRunnerPhase(t *testing.T) {
	const (
		ready = "√ Connected to GitHub\n\nCurrent runner version: '2.330.0'\n2026-11-21 10:00:00Z: Listening for Jobs\n"
		busy  = ready + "2026-11-21 10:00:05Z: Running job: test (3)\n"
		done  = busy + "2026-11-21 10:01:05Z: Job test (3) completed with result: Failed\n"
	)
	for out, want := range map[string]Phase{"": PhaseUnknown, "√ Connected to GitHub\n": PhaseUnknown, ready: PhaseReady, busy: PhaseBusy, done: PhaseDone,
		// Docker's copy prefixes each line with the engine's timestamp.
		"2026-11-21T10:00:05.1Z 2026-11-21 10:00:05Z: Running job: x\n": PhaseBusy} {
		if got := (GitHubRunner{}).Phase([]byte(out)); got != want {
			t.Errorf("Phase(%q) = %s, want %s", out, got, want)
		}
	}
}
