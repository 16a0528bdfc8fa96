package gitea

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
)

func init() { forge.Register("gitea", driver{}) }

// driver is the registry's entry for Gitea and Forgejo forges.
type driver struct{}

// section is what a gitea forge adds to the common fields.
type section struct {
	// Scope is where runners are registered: repo, org or instance. It
	// defaults to repo when Repo is set, org when Org is.
	Scope string `json:"scope"`
	Repo  string `json:"repo"` // owner/name, with scope repo
	Org   string `json:"org"`  // with scope org
}

// Scopes are the kinds of scope a gitea forge may have.
var Scopes = []string{"repo", "org", "instance"}

// decode reads and checks a gitea forge's configuration, returning every
// problem found, each naming its field.
func decode(c forge.Config) (Scope, error) {
	var s section
	// A key that did not decode leaves its field empty: the rest is
	// checked all the same, so that every problem shows at once.
	errs := []error{config.DecodeSection(c.Section, &s)}
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if c.Token == "" {
		bad("token", "is required (a token, \"${ENV_VAR}\", or token_file)")
	}
	if s.Scope == "" {
		switch {
		case s.Repo != "":
			s.Scope = "repo"
		case s.Org != "":
			s.Scope = "org"
		}
	}
	sc := Scope{Kind: s.Scope}
	switch s.Scope {
	case "repo":
		o, r, ok := strings.Cut(s.Repo, "/")
		if !ok || o == "" || r == "" || strings.Contains(r, "/") {
			bad("repo", "%q is not owner/name", s.Repo)
		}
		sc.Owner, sc.Repo = o, r
	case "org":
		if s.Org == "" {
			bad("org", "is required with scope org")
		}
		sc.Owner = s.Org
	case "instance":
	case "":
		bad("scope", "is required (repo, org or instance)")
	default:
		bad("scope", "unknown scope %q (known: %s)", s.Scope, strings.Join(Scopes, ", "))
	}
	return sc, errors.Join(errs...)
}

// DefaultBudget is ten calls a second, with bursts of 300: Gitea has no API
// rate limit, and a pool costs about five calls a job (register, disable,
// list, delete, and its share of polling), so GitHub's default would hold
// a busy fleet to about 700 jobs an hour. The budget is still there to stop
// a crash loop from flooding the server.
func (driver) DefaultBudget() (perHour, burst int) { return 36000, 300 }

func (driver) Check(c forge.Config) error {
	_, err := decode(c)
	return err
}

func (driver) Open(ctx context.Context, c forge.Config, env forge.Env) (forge.Forge, error) {
	sc, err := decode(c)
	if err != nil {
		return nil, err
	}
	return New(Config{
		URL:       c.URL,
		RunnerURL: c.RunnerURL,
		Token:     c.Token.Reveal(),
		Scope:     sc,
		Version:   "runfleet-" + env.Version,
		UserAgent: "runfleet/" + env.Version,
		Logger:    env.Logger,
		Budget:    env.Budget,
		Owed:      env.Owed,
	}), nil
}

// Recognize takes the hosts of Gitea, Forgejo and Codeberg by their name.
func (driver) Recognize(repo *url.URL) bool {
	h := strings.ToLower(repo.Hostname())
	return slices.ContainsFunc([]string{"gitea", "forgejo", "codeberg"}, func(s string) bool { return strings.Contains(h, s) })
}

// InCI reports a Gitea Actions job (which also sets GITHUB_ACTIONS, for
// the actions it runs).
func (driver) InCI(getenv func(string) (string, bool)) bool {
	v, _ := getenv("GITEA_ACTIONS")
	return v == "true"
}

// RepoConfig splits a repository URL into Gitea's address and the
// repository, or organisation, it names.
func (driver) RepoConfig(repo string) (string, json.RawMessage, error) {
	u, err := url.Parse(repo)
	if err != nil {
		return "", nil, err
	}
	if u.Scheme == "" || u.Host == "" {
		return "", nil, fmt.Errorf("%q is not a repository URL (https://<host>/<owner>/<repo>)", repo)
	}
	path := strings.Trim(strings.TrimSuffix(u.Path, ".git"), "/")
	s := section{Org: path}
	if strings.Count(path, "/") == 1 {
		s = section{Repo: path}
	}
	b, err := json.Marshal(s)
	return u.Scheme + "://" + u.Host, b, err
}
