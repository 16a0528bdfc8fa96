package bitbucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
)

func init() { forge.Register("bitbucket", driver{}) }

// driver is the registry's entry for Bitbucket Pipelines.
type driver struct{}

// section is what a bitbucket forge adds to the common fields. The forge's
// url is the API: https://api.bitbucket.org for Bitbucket Cloud.
type section struct {
	// Workspace is the workspace's slug (or {uuid}).
	Workspace string `json:"workspace"`
	// Repository makes the runners repository runners, and is where
	// demand is read; without it they are workspace runners.
	Repository string `json:"repository"`
	// Repositories are read for demand in a workspace scope.
	Repositories []string `json:"repositories"`
	// Username (the Atlassian account's email), with token as an API
	// token, is basic authentication; without it the token is an access
	// token, or CML's REPO_TOKEN.
	Username string `json:"username"`
	// CacheTTL is how long a listing of runners is reused (5s).
	CacheTTL config.Duration `json:"cache_ttl"`
}

// labelRE is what Bitbucket takes as a runner label.
var labelRE = lazyregexp.New(`^[a-z0-9.]+$`)

// maxCustomLabels is how many labels a runner may have beside self.hosted
// and linux.
const maxCustomLabels = 10

// decode reads and checks a bitbucket forge's configuration, returning
// every problem found, each naming its field.
func decode(c forge.Config) (section, error) {
	var s section
	errs := []error{config.DecodeSection(c.Section, &s)}
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if c.Token == "" {
		bad("token", "is required (a workspace, project or repository access token, an API token with username, or CML's REPO_TOKEN; \"${ENV_VAR}\" or token_file)")
	}
	if c.URL != "" {
		if u, err := url.Parse(c.URL); err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
			bad("url", "%q is not the API's URL (%s)", c.URL, DefaultURL)
		}
	}
	if s.Workspace == "" {
		bad("workspace", "is required: the workspace's slug or {uuid}")
	}
	if s.Repository != "" && len(s.Repositories) > 0 {
		bad("repositories", "is for workspace runners: repository runners read their own repository")
	}
	for i, r := range s.Repositories {
		if r == "" || strings.Contains(r, "/") {
			bad(fmt.Sprintf("repositories[%d]", i), "%q is not a repository slug", r)
		}
	}
	return s, errors.Join(errs...)
}

// DefaultBudget stays under Bitbucket Cloud's 1,000 calls an hour per user
// or access token for most resources: a pool costs four or five calls a
// step, and the polls of pipelines a few a minute.
func (driver) DefaultBudget() (perHour, burst int) { return 900, 30 }

func (driver) Check(c forge.Config) error {
	_, err := decode(c)
	return err
}

// CheckLabels refuses labels Bitbucket would: other than lowercase
// letters, digits and dots, or more than ten beside self.hosted and linux.
func (driver) CheckLabels(labels []string) error {
	var errs []error
	n := 0
	for i, l := range labels {
		if !labelRE.MatchString(l) {
			errs = append(errs, fmt.Errorf("labels[%d]: %q: Bitbucket takes lowercase letters, digits and dots only", i, l))
		}
		if l != LabelSelfHosted && l != LabelLinux {
			n++
		}
	}
	if n > maxCustomLabels {
		errs = append(errs, fmt.Errorf("labels: %d labels; Bitbucket takes at most %d beside self.hosted and linux", n, maxCustomLabels))
	}
	return errors.Join(errs...)
}

func (driver) Open(ctx context.Context, c forge.Config, env forge.Env) (forge.Forge, error) {
	s, err := decode(c)
	if err != nil {
		return nil, err
	}
	return New(Config{
		URL:          c.URL,
		RunnerURL:    c.RunnerURL,
		Workspace:    s.Workspace,
		Repository:   s.Repository,
		Repositories: s.Repositories,
		Token:        c.Token.Reveal(),
		Username:     s.Username,
		CacheTTL:     s.CacheTTL.Duration,
		Manager:      env.Manager,
		Version:      env.Version,
		Logger:       env.Logger,
		Budget:       env.Budget,
		Owed:         env.Owed,
	})
}

// Recognize takes bitbucket.org.
func (driver) Recognize(repo *url.URL) bool {
	h := strings.ToLower(repo.Hostname())
	return h == "bitbucket.org" || h == "www.bitbucket.org"
}

// InCI reports a Bitbucket Pipelines step, which has BITBUCKET_BUILD_NUMBER.
func (driver) InCI(getenv func(string) (string, bool)) bool {
	_, ok := getenv("BITBUCKET_BUILD_NUMBER")
	return ok
}

// RepoConfig takes a repository URL (https://bitbucket.org/acme/models):
// repository runners of that repository, on Bitbucket Cloud's API; a URL
// of another host is taken as that host's API (a test bed's).
func (driver) RepoConfig(repo string) (string, json.RawMessage, error) {
	u, err := url.Parse(repo)
	if err != nil {
		return "", nil, err
	}
	parts := strings.Split(strings.Trim(u.Path, "/"), "/")
	if u.Scheme == "" || u.Host == "" || len(parts) < 2 || parts[0] == "" || parts[1] == "" {
		return "", nil, fmt.Errorf("%q is not a repository URL (https://bitbucket.org/<workspace>/<repository>)", repo)
	}
	api := u.Scheme + "://" + u.Host
	if (driver{}).Recognize(u) {
		api = DefaultURL
	}
	b, err := json.Marshal(map[string]string{"workspace": parts[0], "repository": strings.TrimSuffix(parts[1], ".git")})
	return api, b, err
}
