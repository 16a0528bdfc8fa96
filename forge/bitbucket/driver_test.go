package bitbucket

import (
	"encoding/base64"
	"slices"
	"strings"
	"testing"

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
	d := &Driver{}
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
