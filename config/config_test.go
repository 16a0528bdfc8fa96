package config_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/secret"

	// The built-in drivers, whose sections a config holds.
	_ "github.com/runfleet/runfleet/forge/gitea"
	_ "github.com/runfleet/runfleet/forge/github"
	_ "github.com/runfleet/runfleet/forge/gitlab"
	_ "github.com/runfleet/runfleet/provider/docker"
	_ "github.com/runfleet/runfleet/provider/process"
)

const good = `
forges:
  - name: lab
    type: gitea
    url: http://gitea.lab:3000/
    token: ${TEST_GITEA_TOKEN}
    repo: ml/models
pools:
  - name: gpu
    labels: [gpu, cuda]
    size: 2
`

func TestGoodConfigDefaults(t *testing.T) {
	t.Setenv("TEST_GITEA_TOKEN", "s3cret-token")
	c, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	f, p := c.Forges[0], c.Pools[0]
	if f.Token.Reveal() != "s3cret-token" || string(f.Section) != `{"repo":"ml/models"}` || f.URL != "http://gitea.lab:3000" {
		t.Errorf("forge = %+v", f)
	}
	if p.Forge != "lab" || p.Provider != "process" || p.Max != 2 || p.BootstrapTimeout.Duration != DefaultBootstrapTimeout {
		t.Errorf("pool defaults = %+v", p)
	}
	if c.ID != DefaultID || !filepath.IsAbs(p.Workdir) {
		t.Errorf("id %q workdir %q", c.ID, p.Workdir)
	}
}

// A docker section reaches the pool as written, makes docker its
// provider, and the forge's runner_url defaults to its url. The section's
// own defaults and values are the docker driver's (provider/docker).
func TestDockerPool(t *testing.T) {
	t.Setenv("TEST_GITEA_TOKEN", "s3cret-token")
	c, err := Parse([]byte(good + `    docker:
      image: runfleet/gitea-runner:cuda
      memory: 8g
`))
	if err != nil {
		t.Fatal(err)
	}
	p := c.Pools[0]
	if p.Provider != "docker" || string(p.Section) != `{"image":"runfleet/gitea-runner:cuda","memory":"8g"}` {
		t.Errorf("provider %q section %s", p.Provider, p.Section)
	}
	if c.Forges[0].RunnerURL != c.Forges[0].URL {
		t.Errorf("runner_url = %q, want the url", c.Forges[0].RunnerURL)
	}
	if _, err := Parse([]byte(good + "    provider: docker\n    docker: {image: x, gpus: all, oom_score_adj: 0}\n")); err != nil {
		t.Errorf("provider and section both written: %v", err)
	}
}

func TestTokenFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "tok")
	os.WriteFile(file, []byte("from-file\n"), 0o600)
	c, err := Parse([]byte(strings.Replace(good, "token: ${TEST_GITEA_TOKEN}", "token_file: "+file, 1)))
	if err != nil {
		t.Fatal(err)
	}
	if c.Forges[0].Token.Reveal() != "from-file" {
		t.Errorf("token = %q", c.Forges[0].Token.Reveal())
	}
	// The same token from a variable, newline and all, is trimmed the
	// same: before, Gitea's client refused it ("invalid header field
	// value").
	t.Setenv("TEST_GITEA_TOKEN", "from-env\n")
	if c, err := Parse([]byte(good)); err != nil || c.Forges[0].Token.Reveal() != "from-env" {
		t.Errorf("token from a variable = %q, %v", c.Forges[0].Token.Reveal(), err)
	}
}

// Each bad config is rejected with an error that names the field, and the
// bad value where there is one.
func TestInvalidConfigsNameTheField(t *testing.T) {
	t.Setenv("TEST_GITEA_TOKEN", "s3cret-token")
	edit := func(old, new string) string {
		if !strings.Contains(good, old) {
			panic("fixture lacks " + old)
		}
		return strings.Replace(good, old, new, 1)
	}
	cases := []struct {
		name, yaml string
		want       []string
	}{
		{"empty", "", []string{"config is empty"}},
		{"not yaml", "forges: [", []string{"parse"}},
		{"a tab", "id: x\nforges:\n\t- name: a\n", []string{"parse", "line 3 holds a tab: YAML indents with spaces only"}},
		{"unknown field", edit("size: 2", "size: 2\n    sise: 3"), []string{`unknown field "sise"`}},
		{"size not a number", edit("size: 2", "size: two"), []string{"size", "whole number"}},
		{"negative size", edit("size: 2", "size: -1"), []string{"pools[0].size", "-1"}},
		{"max below size", edit("size: 2", "size: 2\n    max: 1"), []string{"pools[0].max", "1 is less than size 2"}},
		{"bad duration", edit("size: 2", "size: 2\n    idle_timeout: 5x"), []string{"pools[0].idle_timeout", `"5x"`}},
		{"duration without unit", edit("size: 2", "size: 2\n    bootstrap_timeout: 30"), []string{"pools[0].bootstrap_timeout", `"30"`}},
		{"negative duration", edit("size: 2", "size: 2\n    max_lifetime: -1h"), []string{"pools[0].max_lifetime", "-1h"}},
		{"unknown forge type", edit("type: gitea", "type: gitee"), []string{"forges[0].type", `"gitee"`}},
		{"url without scheme", edit("url: http://gitea.lab:3000/", "url: gitea.lab:3000"), []string{"forges[0].url", `"gitea.lab:3000"`}},
		{"unset env var", edit("${TEST_GITEA_TOKEN}", "${NOT_SET_ANYWHERE_42}"), []string{"forges[0].token", "NOT_SET_ANYWHERE_42"}},
		{"missing token", edit("token: ${TEST_GITEA_TOKEN}", "scope: repo"), []string{"forges[0].token", "required"}},
		{"bad repo", edit("repo: ml/models", "repo: models"), []string{"forges[0].repo", `"models"`}},
		{"unknown scope", edit("repo: ml/models", "scope: galaxy"), []string{"forges[0].scope", `"galaxy"`}},
		{"unknown pool forge", edit("size: 2", "size: 2\n    forge: nope"), []string{"pools[0].forge", `"nope"`}},
		{"unknown provider", edit("size: 2", "size: 2\n    provider: dockr"), []string{"pools[0].provider", `"dockr"`}},
		{"bad pool name", edit("name: gpu", "name: GPU_Pool"), []string{"pools[0].name", `"GPU_Pool"`}},
		{"label with colon", edit("labels: [gpu, cuda]", "labels: [gpu, 'ubuntu:host']"), []string{"pools[0].labels[1]", `"ubuntu:host"`}},
		{"repeated label", edit("labels: [gpu, cuda]", "labels: [gpu, gpu]"), []string{"pools[0].labels[1]", "repeated"}},
		{"no labels", edit("labels: [gpu, cuda]", "labels: []"), []string{"pools[0].labels", "at least one"}},
		{"relative workdir", edit("size: 2", "size: 2\n    workdir: work"), []string{"pools[0].workdir", `"work"`}},
		{"duplicate pool", good + "  - name: gpu\n    labels: [x]\n", []string{"pools[1].name", `"gpu" is used`}},
		{"bad env name", edit("size: 2", "size: 2\n    env: {'BAD-NAME': x}"), []string{"pools[0].env", `"BAD-NAME"`}},
		{"no pools", "forges:\n  - {name: a, type: gitea, url: 'http://a', token: t, repo: a/b}\n", []string{"pools", "at least one"}},
		{"resync too short", "resync: 1ms\n" + good, []string{"resync", "too short"}},
		{"docker without section", edit("size: 2", "size: 2\n    provider: docker"), []string{"pools[0].docker", "is required"}},
		{"docker section on process pool", edit("size: 2", "size: 2\n    provider: process\n    docker: {image: x}"), []string{"pools[0].docker", `"process"`}},
		{"two provider sections", edit("size: 2", "size: 2\n    process: {}\n    docker: {image: x}"), []string{"pools[0]: has sections for docker and process; set provider"}},
		{"unknown provider section", edit("size: 2", "size: 2\n    kubernetes: {namespace: ci}"), []string{`pools[0]: unknown field "kubernetes"`, "docker, process"}},
		{"bad forge section", edit("repo: ml/models", "repo: ml/models\n    app_id: 3"), []string{"forges[0].app_id: unknown field"}},
		{"docker without image", edit("size: 2", "size: 2\n    docker: {network: host}"), []string{"pools[0].docker.image", "required"}},
		{"bad gpus_per_runner", edit("size: 2", "size: 2\n    gpus_per_runner: some"), []string{"pools[0].gpus_per_runner", `"all"`}},
		{"negative gpus_per_runner", edit("size: 2", "size: 2\n    gpus_per_runner: -3"), []string{"pools[0].gpus_per_runner"}},
		{"gpus_per_runner with docker gpus", edit("size: 2", "size: 2\n    gpus_per_runner: 1\n    docker: {image: x, gpus: all}"), []string{"pools[0].gpus_per_runner", "docker.gpus"}},
		{"bad image template", edit("size: 2", "size: 2\n    docker: {image: 'cuda:{{.CUDA'}"), []string{"pools[0].docker.image", "template"}},
		{"image and images", edit("size: 2", "size: 2\n    docker: {image: x, images: [{image: y, min_cuda: '12.0'}]}"), []string{"pools[0].docker.images", "image"}},
		{"bad min_cuda", edit("size: 2", "size: 2\n    docker: {images: [{image: y, min_cuda: twelve}]}"), []string{"pools[0].docker.images[0].min_cuda", `"twelve"`}},
		{"docker bad memory", edit("size: 2", "size: 2\n    docker: {image: x, memory: lots}"), []string{"pools[0].docker.memory", `"lots"`}},
		{"docker bad oom", edit("size: 2", "size: 2\n    docker: {image: x, oom_score_adj: 2000}"), []string{"pools[0].docker.oom_score_adj", "2000"}},
		{"docker bad volume", edit("size: 2", "size: 2\n    docker: {image: x, volumes: ['/data']}"), []string{"pools[0].docker.volumes[0]", `"/data"`}},
		{"docker bad volume mode", edit("size: 2", "size: 2\n    docker: {image: x, volumes: ['/data:/data:rx']}"), []string{"pools[0].docker.volumes[0]", `"rx"`}},
		{"docker socket by volume", edit("size: 2", "size: 2\n    docker: {image: x, volumes: ['/var/run/docker.sock:/var/run/docker.sock']}"), []string{"pools[0].docker.volumes[0]", "mount_docker_socket"}},
		{"docker bad gpus", edit("size: 2", "size: 2\n    docker: {image: x, gpus: some}"), []string{"pools[0].docker.gpus", `"some"`}},
		{"docker bad pull", edit("size: 2", "size: 2\n    docker: {image: x, pull: sometimes}"), []string{"pools[0].docker.pull", `"sometimes"`}},
		{"runner url without scheme", edit("repo: ml/models", "repo: ml/models\n    runner_url: gitea:3000"), []string{"forges[0].runner_url", `"gitea:3000"`}},
	}
	if len(cases) < 10 {
		t.Fatal("at least 10 cases")
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("accepted:\n%s", tc.yaml)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "s3cret-token") {
				t.Errorf("error reveals the token: %q", err)
			}
		})
	}
}

// Problems of every kind come in one error: a key nobody knows, a
// driver's section, a common field, across entries.
func TestAllKindsOfErrorsAtOnce(t *testing.T) {
	_, err := Parse([]byte(`
forges:
  - {name: a, type: gitea, url: "http://a", token: t, repo: nope, app_id: 3}
pools:
  - {name: p, labels: [l], size: 2, max: 1, rerun_on_timeout: -1, docker: {image: x, memory: 12q}}
  - {name: q, labels: [l], kubernetes: {namespace: ci}}
`))
	for _, w := range []string{`pools[0].rerun_on_timeout: -1 is not a number of re-runs`, `forges[0].app_id: unknown field`, `forges[0].repo: "nope" is not owner/name`, `pools[0].docker.memory: "12q" is not a size`, "pools[0].max: 1 is less than size 2", `pools[1]: unknown field "kubernetes"`} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("error does not report %s:\n%v", w, err)
		}
	}
}

func TestAllErrorsAtOnce(t *testing.T) {
	_, err := Parse([]byte("forges:\n  - {name: a, type: x, url: y, token: t, repo: a/b}\npools:\n  - {name: p, labels: [l], size: -1, provider: z}\n"))
	if err == nil {
		t.Fatal("accepted")
	}
	for _, w := range []string{"forges[0].type", "forges[0].url", "pools[0].size", "pools[0].provider"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error does not report %s:\n%v", w, err)
		}
	}
}

func TestSecretNeverFormats(t *testing.T) {
	s := secret.String("glpat-very-secret")
	var buf strings.Builder
	slog.New(slog.NewTextHandler(&buf, nil)).Info("x", "token", s, "forge", Forge{Token: s})
	b, _ := json.Marshal(Forge{Token: s})
	for _, out := range []string{fmt.Sprint(s), fmt.Sprintf("%v %+v %#v %s", s, Forge{Token: s}, s, s), buf.String(), string(b)} {
		if strings.Contains(out, "very-secret") {
			t.Errorf("secret revealed: %s", out)
		}
	}
	if s.Reveal() != "glpat-very-secret" {
		t.Error("Reveal")
	}
}

func TestGitHubForge(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "app.pem")
	if err := os.WriteFile(key, []byte("-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	pools := "pools:\n  - name: gpu\n    labels: [gpu]\n    size: 1\n"
	c, err := Parse([]byte("forges:\n  - name: gh\n    type: github\n    url: https://github.com/acme/models\n    app_id: 12\n    installation_id: 34\n    private_key_file: " + key + "\n" + pools))
	if err != nil {
		t.Fatal(err)
	}
	if f := c.Forges[0]; !strings.Contains(string(f.Section), `"app_id":12`) || strings.Contains(fmt.Sprintf("%v", f), "RSA PRIVATE KEY") {
		t.Errorf("forge = %v", f)
	}
	for doc, want := range map[string]string{
		"    url: https://github.com/\n    token: t\n":                           "forges[0].url: \"https://github.com\" must name an organisation",
		"    url: https://github.com/acme/models\n":                              "forges[0].token: is required",
		"    url: https://github.com/acme/models\n    token: t\n    app_id: 1\n": "forges[0].token: set a token or a GitHub App",
		"    url: https://github.com/acme/models\n    app_id: 1\n":               "forges[0].installation_id: is required with a GitHub App",
		"    url: https://github.com/acme/models\n    token: t\n    repo: a/b\n": "forges[0].scope: github infers the scope from url",
	} {
		_, err := Parse([]byte("forges:\n  - name: gh\n    type: github\n" + doc + pools))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err = %v, want %q", doc, err, want)
		}
	}
}

func TestGPUPool(t *testing.T) {
	t.Setenv("TEST_GITEA_TOKEN", "s3cret-token")
	doc := strings.Replace(good, "size: 2", "gpus_per_runner: all\n    hardware_labels: false\n    docker:\n      images:\n        - {image: 'r:cu118', min_cuda: '11.8'}\n        - {image: 'r:cu124', min_cuda: '12.4'}", 1)
	c, err := Parse([]byte("gpu: {nvidia_smi: /opt/nvidia-smi}\n" + doc))
	if err != nil {
		t.Fatal(err)
	}
	p := c.Pools[0]
	if p.GPUsPerRunner != AllGPUs || !p.SizeFromGPUs || p.HasHardwareLabels() || c.GPU.NvidiaSMI != "/opt/nvidia-smi" || p.Provider != "docker" {
		t.Fatalf("pool %+v", p)
	}
	c, err = Parse([]byte(strings.Replace(good, "size: 2", "size: 2\n    gpus_per_runner: 1", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if p := c.Pools[0]; p.GPUsPerRunner != 1 || p.SizeFromGPUs || p.Size != 2 || !p.HasHardwareLabels() {
		t.Fatalf("pool %+v", p)
	}
}

// leader_election gets its defaults (the Lease named after the id), its
// identity from the environment, and client-go's conditions on its
// durations, each named.
func TestLeaderElection(t *testing.T) {
	t.Setenv("TEST_GITEA_TOKEN", "s3cret-token")
	t.Setenv("POD_NAME", "runfleet-7d9f-abcde")
	c, err := Parse([]byte("id: lab\nleader_election:\n  namespace: ci\n  identity: ${POD_NAME}\n" + good))
	if err != nil {
		t.Fatal(err)
	}
	le := c.LeaderElection
	if le.Lease != "runfleet-lab" || le.Identity != "runfleet-7d9f-abcde" || le.LeaseDuration.Duration != DefaultLeaseDuration ||
		le.RenewDeadline.Duration != DefaultRenewDeadline || le.RetryPeriod.Duration != DefaultRetryPeriod {
		t.Errorf("leader_election = %+v", le)
	}
	for _, tc := range []struct{ yaml, want string }{
		{"  lease_duration: 5s\n  renew_deadline: 10s\n", "leader_election.renew_deadline: 10s must be shorter than lease_duration 5s"},
		{"  renew_deadline: 2s\n  retry_period: 2s\n", "leader_election.retry_period"},
		{"  lease_duration: soon\n", `leader_election.lease_duration`},
		{"  lease: Not_A_Name\n", "leader_election.lease"},
		{"  advertise: 10.0.0.5:8080\n", "leader_election.advertise"},
		{"  advertise: http://10.0.0.5:8080/webhook/x\n", "leader_election.advertise"},
		{"  in_cluster: true\n  kubeconfig: /k\n", "leader_election.in_cluster"},
		{"  colour: blue\n", "colour"},
	} {
		_, err := Parse([]byte("leader_election:\n" + tc.yaml + good))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
}

// A dynamic pool: its limits checked with the field named, no size taken
// from its GPUs, and a max required.
func TestDynamicPool(t *testing.T) {
	t.Setenv("T", "x")
	base := "forges:\n  - {name: f, type: gitea, url: 'http://x', token: '${T}', repo: a/b}\npools:\n  - name: p\n    labels: [gpu]\n    gpus_per_runner: 1\n"
	c, err := Parse([]byte(base + "    max: 4\n    dynamic: {gpus: [1, 2], mem: 64g}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if p := c.Pools[0]; p.SizeFromGPUs || p.Size != 0 || p.Max != 4 || p.Dynamic.Keys()[1] != "mem" {
		t.Fatalf("pool %+v", p)
	}
	for doc, want := range map[string]string{
		"    dynamic: {gpus: [1]}\n":                   "pools[0].max: a pool whose jobs choose their machine needs max",
		"    max: 2\n    dynamic: {gpus: [0]}\n":       "pools[0].dynamic.gpus[0]: 0 is not a number of GPUs",
		"    max: 2\n    dynamic: {}\n":                "pools[0].dynamic: allows nothing",
		"    max: 2\n    dynamic: {gpus: [1], x: 1}\n": "x",
	} {
		if _, err := Parse([]byte(base + doc)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", doc, err, want)
		}
	}
}

// Prices: a pool's price per hour and its prices by type must be numbers,
// 0 or more, and the currency a code; given, they are kept.
func TestPrices(t *testing.T) {
	_, err := Parse([]byte(`
currency: dollars
forges:
  - {name: a, type: gitea, url: "http://a", token: t, repo: a/b}
pools:
  - {name: p, labels: [l], price_per_hour: -1, prices: {g4dn.xlarge: -0.5, g5.xlarge: 1.006}}
`))
	for _, w := range []string{`currency: "dollars" is not a currency code`, `pools[0].price_per_hour: -1 is not a price`, `pools[0].prices.g4dn.xlarge: -0.5 is not a price`} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("error does not report %s:\n%v", w, err)
		}
	}
	if err != nil && strings.Contains(err.Error(), "g5.xlarge") {
		t.Errorf("a good price refused: %v", err)
	}
	c, err := Parse([]byte(`
forges:
  - {name: a, type: gitea, url: "http://a", token: t, repo: a/b}
pools:
  - {name: p, labels: [l], price_per_hour: 0.75, prices: {g5.xlarge: 1.006}}
`))
	if err != nil {
		t.Fatal(err)
	}
	if p := c.Pools[0]; c.Currency != "USD" || p.PricePerHour == nil || *p.PricePerHour != 0.75 || p.Prices["g5.xlarge"] != 1.006 {
		t.Errorf("currency %q, pool %+v", c.Currency, p)
	}
}
