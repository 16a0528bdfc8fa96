package azurepipelines_test

import (
	"encoding/json"
	"net/url"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/forge/azurepipelines"
	"github.com/runfleet/runfleet/secret"
)

func check(t *testing.T, u, section, tok string) error {
	t.Helper()
	d, ok := forge.Lookup("azure-pipelines")
	if !ok {
		t.Fatal("azure-pipelines is not registered")
	}
	return d.Check(forge.Config{Name: "ado", URL: u, Token: secret.String(tok), Section: json.RawMessage(section)})
}

// Every problem of an azure-pipelines forge's section is named at once.
func TestCheck(t *testing.T) {
	for _, ok := range []string{`{"pool":"gpu"}`, `{"pool":12}`, `{"pool":"gpu","project":"ml","agent_version":"4.275.0","cache_ttl":"10s"}`, `{"pool":"gpu","architecture":"arm64"}`} {
		if err := check(t, "https://dev.azure.com/acme", ok, "pat"); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	err := check(t, "dev.azure.com/acme", `{"agent_version":"latest","colour":"red","architecture":"sparc"}`, "")
	for _, want := range []string{"token: is required", "url: ", "pool: is required", `agent_version: "latest" is not a version`, "colour", `architecture: "sparc" is not X64 or ARM64`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not say %q", err, want)
		}
	}
	if err := check(t, "https://dev.azure.com/acme", `{"pool":true}`, "pat"); err == nil || !strings.Contains(err.Error(), "pool") {
		t.Errorf("a pool that is neither a name nor an id: %v", err)
	}
}

// runfleet runner configures Azure Pipelines from a project's URL.
func TestRepoConfig(t *testing.T) {
	d, _ := forge.Lookup("azure-pipelines")
	rd := d.(forge.RepoDriver)
	cases := map[string][2]string{
		"https://dev.azure.com/acme/ml/_git/models":                           {"https://dev.azure.com/acme", `{"pool":"Default","project":"ml"}`},
		"https://dev.azure.com/acme/ml?pool=gpu":                              {"https://dev.azure.com/acme", `{"pool":"gpu","project":"ml"}`},
		"https://dev.azure.com/acme?pool=7":                                   {"https://dev.azure.com/acme", `{"pool":7}`},
		"https://acme.visualstudio.com/ml/_git/repo":                          {"https://acme.visualstudio.com", `{"pool":"Default","project":"ml"}`},
		"https://ado.example.com/tfs/DefaultCollection/ml/_git/repo?pool=gpu": {"https://ado.example.com/tfs/DefaultCollection", `{"pool":"gpu","project":"ml"}`},
		"http://127.0.0.1:8080/acme/ml":                                       {"http://127.0.0.1:8080/acme", `{"pool":"Default","project":"ml"}`},
	}
	for in, want := range cases {
		u, sec, err := rd.RepoConfig(in)
		if err != nil || u != want[0] || string(sec) != want[1] {
			t.Errorf("RepoConfig(%s) = %s %s %v, want %s %s", in, u, sec, err, want[0], want[1])
		}
	}
	if _, _, err := rd.RepoConfig("https://dev.azure.com/"); err == nil {
		t.Error("a URL without an organisation was taken")
	}
	for in, want := range map[string]bool{"https://dev.azure.com/acme": true, "https://acme.visualstudio.com/x": true, "https://github.com/a/b": false} {
		u, _ := url.Parse(in)
		if rd.Recognize(u) != want {
			t.Errorf("Recognize(%s) = %v", in, !want)
		}
	}
	env := map[string]string{"TF_BUILD": "True"}
	if !rd.InCI(func(k string) (string, bool) { v, ok := env[k]; return v, ok }) {
		t.Error("an Azure Pipelines job (TF_BUILD=True) is not recognised")
	}
}

// The agent runs from its run.sh with the three files, and nothing else
// of the credential; its console lines tell its phase.
func TestAgentSpec(t *testing.T) {
	a := azurepipelines.Agent{Root: "/azp"}
	files := map[string][]byte{".agent": []byte("{}"), ".credentials": []byte("{}"), ".credentials_rsaparams": []byte("{}")}
	spec, err := a.Spec(agent.Runner{Name: "gpu-1", Manager: "m", Pool: "gpu", Env: map[string]string{"CUDA_CACHE": "/c"}}, forge.Credential{RunnerID: 3, Files: files})
	if err != nil {
		t.Fatal(err)
	}
	if spec.Command != "/bin/sh" || spec.Args[len(spec.Args)-2] != "/azp" || spec.Env["CUDA_CACHE"] != "/c" || len(spec.Files) != 3 {
		t.Errorf("spec %+v", spec)
	}
	if !strings.Contains(spec.Args[1], "exec ./run.sh --once") {
		t.Errorf("the script does not start run.sh --once: %s", spec.Args[1])
	}
	if _, err := a.Spec(agent.Runner{Name: "gpu-1"}, forge.Credential{Files: map[string][]byte{".agent": []byte("{}")}}); err == nil {
		t.Error("a credential without the key file was taken")
	}
	out := "2026-11-25 10:00:00Z: Listening for Jobs\n2026-11-25 10:00:05Z: Running job: train\n"
	if ph := a.Phase([]byte(out)); ph != agent.PhaseBusy {
		t.Errorf("phase %s, want busy", ph)
	}
	if ph := a.Phase([]byte(out + "2026-11-25 10:01:00Z: Job train completed with result: Succeeded\n")); ph != agent.PhaseDone {
		t.Errorf("phase %s, want done", ph)
	}
	d, _ := forge.Lookup("azure-pipelines")
	conn, err := d.Open(t.Context(), forge.Config{Name: "ado", URL: "https://dev.azure.com/acme", Token: "pat", Section: json.RawMessage(`{"pool":"gpu"}`)}, forge.Env{Manager: "m"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.(agent.Maker).Agent(agent.Config{Path: "/opt/azp/bin/Agent.Listener"}); err == nil {
		t.Error("an agent path that is not run.sh was taken")
	}
	if _, err := conn.(agent.Maker).Agent(agent.Config{Path: t.TempDir() + "/run.sh", Local: true}); err == nil {
		t.Error("a local agent path that does not exist was taken")
	}
}
