package github

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/daemon"
	_ "github.com/runfleet/runfleet/provider/process" // the pool's provider
	"github.com/runfleet/runfleet/secret"
)

// A GitHub forge's own keys: a token or an App (its key read from a file),
// never both; the scope comes from the URL; each problem names its field.
func TestSection(t *testing.T) {
	key := filepath.Join(t.TempDir(), "app.pem")
	if err := os.WriteFile(key, []byte("-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := forge.Config{Name: "gh", URL: "https://github.com/acme/models", Section: json.RawMessage(`{"app_id":12,"installation_id":34,"private_key_file":"` + key + `","cache_ttl":"10s"}`)}
	got, err := decode(c)
	if err != nil || got.AppID != 12 || got.InstallationID != 34 || !strings.Contains(string(got.PrivateKey), "RSA PRIVATE KEY") || got.CacheTTL.Seconds() != 10 {
		t.Fatalf("decoded %+v, %v", got, err)
	}
	tok := secret.String("t")
	for _, tc := range []struct {
		url, section string
		token        secret.String
		want         string
	}{
		{"https://github.com/", ``, tok, `url: "https://github.com/" must name an organisation`},
		{"https://github.com/acme/models", ``, "", "token: is required"},
		{"https://github.com/acme/models", `{"app_id":1}`, tok, "token: set a token or a GitHub App"},
		{"https://github.com/acme/models", `{"app_id":1}`, "", "installation_id: is required with a GitHub App"},
		{"https://github.com/acme/models", `{"app_id":1,"installation_id":2,"private_key_file":"/nonexistent/key.pem"}`, "", "private_key_file: open /nonexistent/key.pem"},
		{"https://github.com/acme/models", `{"repo":"a/b"}`, tok, "scope: github infers the scope from url"},
		{"https://github.com/acme/models", `{"cache_ttl":"soon"}`, tok, `cache_ttl: invalid duration "soon"`},
		{"https://github.com/acme/models", `{"api_url":"ghe.example.com"}`, tok, `api_url: "ghe.example.com" is not an http:// or https:// URL`},
		{"https://github.com/acme/models", `{"runner_group_id":-1}`, tok, "runner_group_id: must not be negative"},
		{"https://github.com/acme/models", `{"webhook":"x"}`, tok, "webhook: unknown field"},
		{"https://github.com/acme", `{"mode":"scaleset"}`, tok, "scale_set: is required with mode: scaleset"},
		{"https://github.com/acme", `{"mode":"auto"}`, tok, `mode: "auto" is not jit or scaleset`},
		{"https://github.com/acme", `{"scale_set":"gpu"}`, tok, "mode: scale_set and runner_group need mode: scaleset"},
		{"https://github.com/acme", `{"mode":"scaleset","scale_set":"two words"}`, tok, `scale_set: "two words" is not a scale set name`},
		{"https://github.com/acme", `{"mode":"scaleset","scale_set":"gpu","runner_group_id":3}`, tok, "runner_group_id: is not used with mode: scaleset"},
	} {
		c := forge.Config{URL: tc.url, Token: tc.token}
		if tc.section != "" {
			c.Section = json.RawMessage(tc.section)
		}
		if err := (driver{}).Check(c); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s: %v, want %q", tc.url, tc.section, err, tc.want)
		}
	}
}

// A pool of a GitHub forge with more labels than GitHub takes is a config
// error naming the pool's labels.
func TestConfigRefusesLabelsGitHubRefuses(t *testing.T) {
	labels := make([]string, 101)
	for i := range labels {
		labels[i] = fmt.Sprint("l", i)
	}
	yml := "id: m\nforges:\n  - name: gh\n    type: github\n    url: https://github.com/acme/models\n    token: t\n" +
		"pools:\n  - name: cpu\n    forge: gh\n    labels: [" + strings.Join(labels, ", ") + "]\n"
	_, err := config.Parse([]byte(yml))
	if err == nil || !strings.Contains(err.Error(), "pools[0].labels: GitHub takes 1 to 100 labels a runner, got 101") {
		t.Fatalf("101 labels: %v", err)
	}
	yml = strings.Replace(yml, strings.Join(labels, ", "), strings.Join(labels[:100], ", "), 1)
	if _, err := config.Parse([]byte(yml)); err != nil {
		t.Fatalf("100 labels: %v", err)
	}
}

// A scale set says what one pool needs: a second pool on it is refused,
// at start and at reload.
func TestScaleSetServesOnePool(t *testing.T) {
	yml := "id: m\nstate_dir: " + t.TempDir() + "\nforges:\n  - name: gh\n    type: github\n    url: https://github.com/acme\n    token: t\n    mode: scaleset\n    scale_set: gpu\n" +
		"pools:\n  - name: a\n    forge: gh\n    labels: [x]\n    agent: {path: /bin/sh}\n"
	cfg, err := config.Parse([]byte(yml))
	if err != nil {
		t.Fatal(err)
	}
	f, err := daemon.New(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("one pool on a scale set: %v", err)
	}
	defer f.Close()
	if _, ok := f.Forges["a"].(*ScaleSet); !ok {
		t.Fatalf("the forge is a %T, want a *ScaleSet", f.Forges["a"])
	}
	two, err := config.Parse([]byte(yml + "  - name: b\n    forge: gh\n    labels: [y]\n    agent: {path: /bin/sh}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Reload(t.Context(), two); err == nil || !strings.Contains(err.Error(), "it serves one pool") {
		t.Fatalf("reload with two pools on the scale set: %v", err)
	}
	if _, err := daemon.New(t.Context(), two, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "it serves one pool") {
		t.Fatalf("two pools on the scale set: %v", err)
	}
}
