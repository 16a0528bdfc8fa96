package gitea

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/secret"
)

func cfg(section string) forge.Config {
	c := forge.Config{Name: "lab", URL: "http://gitea.lab:3000", Token: secret.String("t")}
	if section != "" {
		c.Section = json.RawMessage(section)
	}
	return c
}

// The scope defaults from repo or org; each problem names its field.
func TestSection(t *testing.T) {
	for section, want := range map[string]Scope{
		`{"repo":"ml/models"}`:       {Kind: "repo", Owner: "ml", Repo: "models"},
		`{"org":"ml"}`:               {Kind: "org", Owner: "ml"},
		`{"scope":"instance"}`:       {Kind: "instance"},
		`{"scope":"org","org":"ml"}`: {Kind: "org", Owner: "ml"},
	} {
		got, err := decode(cfg(section))
		if err != nil || got != want {
			t.Errorf("%s: %+v %v, want %+v", section, got, err, want)
		}
	}
	for section, want := range map[string]string{
		`{"repo":"models"}`:         `repo: "models" is not owner/name`,
		`{"scope":"galaxy"}`:        `scope: unknown scope "galaxy" (known: repo, org, instance)`,
		``:                          "scope: is required (repo, org or instance)",
		`{"scope":"org"}`:           "org: is required with scope org",
		`{"repo":"a/b","app_id":1}`: "app_id: unknown field",
		`{"repo":["a/b"]}`:          "repo: must be a string",
	} {
		if err := (driver{}).Check(cfg(section)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", section, err, want)
		}
	}
	c := cfg(`{"repo":"a/b"}`)
	c.Token = ""
	if err := (driver{}).Check(c); err == nil || !strings.Contains(err.Error(), "token: is required") {
		t.Errorf("no token: %v", err)
	}
}

// `runfleet runner --repo` takes a Gitea repository or organisation URL.
func TestRepoConfig(t *testing.T) {
	for repo, want := range map[string]string{
		"https://gitea.example.com/ml/models.git": `https://gitea.example.com {"scope":"","repo":"ml/models","org":""}`,
		"http://127.0.0.1:3000/ml":                `http://127.0.0.1:3000 {"scope":"","repo":"","org":"ml"}`,
	} {
		u, sec, err := (driver{}).RepoConfig(repo)
		if err != nil || u+" "+string(sec) != want {
			t.Errorf("%s: %s %s %v, want %s", repo, u, sec, err, want)
		}
		if _, err := decode(forge.Config{URL: u, Token: "t", Section: sec}); err != nil {
			t.Errorf("%s: its own section does not check: %v", repo, err)
		}
	}
	u, _ := url.Parse("https://codeberg.org/a/b")
	if !(driver{}).Recognize(u) {
		t.Error("codeberg is Forgejo")
	}
	if !(driver{}).InCI(func(k string) (string, bool) { return map[string]string{"GITEA_ACTIONS": "true"}[k], true }) {
		t.Error("GITEA_ACTIONS")
	}
}

// A URL that is no Gitea (any web server answers 404 to Gitea's API) or
// names no such repository is said to be that, never "runner not found".
func TestNotAGitea(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	d := New(Config{URL: srv.URL, Token: "t", Scope: Scope{Kind: "repo", Owner: "ml", Repo: "models"}})
	_, err := d.Runners(context.Background())
	if err == nil || errors.Is(err, forge.ErrNotFound) || !strings.Contains(err.Error(), "repo ml/models is not at "+srv.URL) ||
		!strings.Contains(err.Error(), "is not a Gitea") {
		t.Errorf("listing runners at a URL that is not a Gitea: %v", err)
	}
}
