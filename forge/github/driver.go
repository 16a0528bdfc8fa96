package github

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
)

func init() { forge.Register("github", driver{}) }

// driver is the registry's entry for GitHub (github.com and Enterprise
// Server).
type driver struct{}

// section is what a github forge adds to the common fields. The scope
// comes from the URL, so scope, repo and org are refused.
type section struct {
	// APIURL overrides the REST base derived from the URL.
	APIURL string `json:"api_url"`
	// A GitHub App instead of a token: its id, the installation's id
	// and the App's private key (PEM), in a file.
	AppID          int64  `json:"app_id"`
	InstallationID int64  `json:"installation_id"`
	PrivateKeyFile string `json:"private_key_file"`
	// RunnerGroupID is the runner group JIT runners join (1, Default).
	RunnerGroupID int64 `json:"runner_group_id"`
	// CacheTTL is how long a listing of runners is reused.
	CacheTTL config.Duration `json:"cache_ttl"`
	// Mode is how runners are registered and demand is learnt: "jit"
	// (the default: JIT configs through the REST API, demand from
	// webhooks and polls) or "scaleset" (a runner scale set and its
	// message session).
	Mode string `json:"mode"`
	// ScaleSet names the scale set, which jobs name in runs-on; and
	// RunnerGroup the runner group it is in ("default").
	ScaleSet    string `json:"scale_set"`
	RunnerGroup string `json:"runner_group"`

	Scope string `json:"scope"`
	Repo  string `json:"repo"`
	Org   string `json:"org"`
}

// decode reads and checks a github forge's configuration, the App's
// private key included, returning every problem found.
func decode(c forge.Config) (Config, error) {
	var s section
	// A key that did not decode leaves its field empty: the rest is
	// checked all the same, so that every problem shows at once.
	errs := []error{config.DecodeSection(c.Section, &s)}
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if c.URL != "" {
		if _, _, err := ParseURL(c.URL); err != nil {
			bad("url", "%q must name an organisation (https://github.com/<org>) or a repository (https://github.com/<owner>/<repo>)", c.URL)
		}
	}
	if s.Scope != "" || s.Repo != "" || s.Org != "" {
		bad("scope", "github infers the scope from url; drop scope, repo and org")
	}
	if s.APIURL != "" {
		if u, err := url.Parse(s.APIURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("api_url", "%q is not an http:// or https:// URL with a host", s.APIURL)
		}
	}
	cfg := Config{URL: c.URL, APIURL: s.APIURL, Token: c.Token.Reveal(), AppID: s.AppID, InstallationID: s.InstallationID,
		RunnerGroupID: s.RunnerGroupID, CacheTTL: s.CacheTTL.Duration}
	app := s.AppID != 0 || s.InstallationID != 0 || s.PrivateKeyFile != ""
	switch {
	case app && c.Token != "":
		bad("token", "set a token or a GitHub App (app_id, installation_id, private_key_file), not both")
	case app:
		if s.AppID <= 0 {
			bad("app_id", "is required with a GitHub App")
		}
		if s.InstallationID <= 0 {
			bad("installation_id", "is required with a GitHub App")
		}
		if s.PrivateKeyFile == "" {
			bad("private_key_file", "is required with a GitHub App")
		} else if key, err := os.ReadFile(s.PrivateKeyFile); err != nil {
			bad("private_key_file", "%v", err)
		} else {
			cfg.PrivateKey = key
		}
	case c.Token == "":
		bad("token", "is required (a token, \"${ENV_VAR}\", token_file, or a GitHub App)")
	}
	if s.RunnerGroupID < 0 {
		bad("runner_group_id", "must not be negative, got %d", s.RunnerGroupID)
	}
	if err := s.CacheTTL.Check(); err != nil {
		bad("cache_ttl", "%v", err)
	}
	checkMode(s, bad)
	return cfg, errors.Join(errs...)
}

// scaleSetName is what GitHub takes as a scale set's name (which jobs
// write in runs-on): at most 45 characters, no spaces.
var scaleSetName = lazyregexp.New(`^[A-Za-z0-9._-]{1,45}$`)

// checkMode checks the keys of the registration mode.
func checkMode(s section, bad func(field, format string, args ...any)) {
	switch s.Mode {
	case "", modeJIT:
		if s.ScaleSet != "" || s.RunnerGroup != "" {
			bad("mode", "scale_set and runner_group need mode: scaleset")
		}
	case modeScaleSet:
		switch {
		case s.ScaleSet == "":
			bad("scale_set", "is required with mode: scaleset (the name jobs write in runs-on)")
		case !scaleSetName.MatchString(s.ScaleSet):
			bad("scale_set", "%q is not a scale set name (at most 45 letters, digits, '.', '_' or '-')", s.ScaleSet)
		}
		if s.RunnerGroupID != 0 {
			bad("runner_group_id", "is not used with mode: scaleset; name the group in runner_group")
		}
		if s.APIURL != "" {
			bad("api_url", "is not used with mode: scaleset (the API is derived from url)")
		}
	default:
		bad("mode", "%q is not jit or scaleset", s.Mode)
	}
}

const (
	modeJIT      = "jit"
	modeScaleSet = "scaleset"
)

func (driver) Check(c forge.Config) error {
	_, err := decode(c)
	return err
}

func (driver) Open(ctx context.Context, c forge.Config, env forge.Env) (forge.Forge, error) {
	cfg, err := decode(c)
	if err != nil {
		return nil, err
	}
	cfg.Version, cfg.Logger, cfg.Budget, cfg.Owed = env.Version, env.Logger, env.Budget, env.Owed
	var s section
	if err := config.DecodeSection(c.Section, &s); err != nil {
		return nil, err
	}
	if s.Mode == modeScaleSet {
		return NewScaleSet(ScaleSetConfig{Config: cfg, Name: s.ScaleSet, RunnerGroup: s.RunnerGroup})
	}
	return New(cfg)
}

// CheckLabels applies GitHub's limits on a runner's labels.
func (driver) CheckLabels(labels []string) error { return checkLabels(labels) }

// Recognize takes github.com and hosts named after GitHub (an Enterprise
// Server's github.example.com).
func (driver) Recognize(repo *url.URL) bool {
	return strings.Contains(strings.ToLower(repo.Hostname()), "github")
}

// InCI reports a GitHub Actions job.
func (driver) InCI(getenv func(string) (string, bool)) bool {
	v, _ := getenv("GITHUB_ACTIONS")
	return v == "true"
}

// RepoConfig takes a repository or organisation URL as it is: the scope
// is inferred from it.
func (driver) RepoConfig(repo string) (string, json.RawMessage, error) {
	if _, _, err := ParseURL(repo); err != nil {
		return "", nil, err
	}
	return repo, nil, nil
}
