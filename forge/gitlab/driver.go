package gitlab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
)

func init() { forge.Register("gitlab", driver{}) }

// driver is the registry's entry for GitLab (gitlab.com and self-managed).
type driver struct{}

// section is what a gitlab forge adds to the common fields.
type section struct {
	// Scope is where runners are created: project, group or instance.
	// It defaults to project when Project is set, group when Group is.
	Scope   string `json:"scope"`
	Project ref    `json:"project"` // full path or id
	Group   ref    `json:"group"`   // full path or id
	// RunUntagged lets the runners take jobs without tags.
	RunUntagged bool `json:"run_untagged"`
	// AccessLevel is the runners' access_level: ref_protected (the
	// default: jobs of protected branches only, so that no job of an
	// unprotected branch runs where protected variables could be
	// reached) or not_protected (any job, what GitLab makes by default).
	AccessLevel string `json:"access_level"`
	// MaximumTimeout caps a job's timeout on these runners (at least
	// 10m, as GitLab requires).
	MaximumTimeout config.Duration `json:"maximum_timeout"`
	// CacheTTL is how long a listing of runners is reused (15s).
	CacheTTL config.Duration `json:"cache_ttl"`
}

// ref is a project or group: its full path, or its id as a number.
type ref string

func (r *ref) UnmarshalJSON(b []byte) error {
	if bytes.HasPrefix(b, []byte(`"`)) {
		var s string
		err := json.Unmarshal(b, &s)
		*r = ref(strings.Trim(s, "/"))
		return err
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("%s is not a path or an id", b)
	}
	*r = ref(n.String())
	return nil
}

// Scopes are the kinds of scope a gitlab forge may have.
var Scopes = []string{"project", "group", "instance"}

// decode reads and checks a gitlab forge's configuration, returning every
// problem found, each naming its field.
func decode(c forge.Config) (section, Scope, error) {
	var s section
	errs := []error{config.DecodeSection(c.Section, &s)}
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if c.Token == "" {
		bad("token", "is required (an access token with the create_runner and manage_runner scopes, \"${ENV_VAR}\", or token_file)")
	}
	if s.Scope == "" {
		switch {
		case s.Project != "":
			s.Scope = "project"
		case s.Group != "":
			s.Scope = "group"
		}
	}
	sc := Scope{Kind: s.Scope}
	switch s.Scope {
	case "project":
		if s.Project == "" {
			bad("project", "is required with scope project (a full path, acme/models, or an id)")
		} else if !strings.Contains(string(s.Project), "/") && !isID(string(s.Project)) {
			bad("project", "%q is neither a full path (group/project) nor an id", s.Project)
		}
		sc.Ref = string(s.Project)
	case "group":
		if s.Group == "" {
			bad("group", "is required with scope group (a full path, or an id)")
		}
		sc.Ref = string(s.Group)
	case "instance":
	case "":
		bad("scope", "is required (project, group or instance), or set project or group")
	default:
		bad("scope", "unknown scope %q (known: %s)", s.Scope, strings.Join(Scopes, ", "))
	}
	if s.Scope != "project" && s.Project != "" || s.Scope != "group" && s.Group != "" {
		bad("scope", "%s: set one of project and group, matching the scope", s.Scope)
	}
	switch s.AccessLevel {
	case "":
		s.AccessLevel = AccessRefProtected
	case AccessRefProtected, AccessNotProtected:
	default:
		bad("access_level", "%q is not ref_protected or not_protected", s.AccessLevel)
	}
	if d := s.MaximumTimeout.Duration; d != 0 && d < 10*time.Minute {
		bad("maximum_timeout", "%s is under GitLab's minimum of 10m", d)
	}
	return s, sc, errors.Join(errs...)
}

func isID(s string) bool {
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return s != ""
}

// DefaultBudget is GitLab.com's limit for authenticated API calls (2,000 a
// minute) well below: a pool costs about five calls a job.
func (driver) DefaultBudget() (perHour, burst int) { return 36000, 300 }

func (driver) Check(c forge.Config) error {
	_, _, err := decode(c)
	return err
}

func (driver) Open(ctx context.Context, c forge.Config, env forge.Env) (forge.Forge, error) {
	s, sc, err := decode(c)
	if err != nil {
		return nil, err
	}
	return New(Config{
		URL:            c.URL,
		RunnerURL:      c.RunnerURL,
		Token:          c.Token.Reveal(),
		Scope:          sc,
		RunUntagged:    s.RunUntagged,
		AccessLevel:    s.AccessLevel,
		MaximumTimeout: s.MaximumTimeout.Duration,
		CacheTTL:       s.CacheTTL.Duration,
		Version:        env.Version,
		Logger:         env.Logger,
		Budget:         env.Budget,
		Owed:           env.Owed,
	})
}

// Recognize takes gitlab.com and hosts named after GitLab.
func (driver) Recognize(repo *url.URL) bool {
	return strings.Contains(strings.ToLower(repo.Hostname()), "gitlab")
}

// InCI reports a GitLab CI job: GITLAB_CI, or the server's and the
// project's URLs that every GitLab job has.
func (driver) InCI(getenv func(string) (string, bool)) bool {
	v, _ := getenv("GITLAB_CI")
	server, _ := getenv("CI_SERVER_URL")
	project, _ := getenv("CI_PROJECT_URL")
	return v == "true" || server != "" && project != ""
}

// RepoConfig splits a project URL (https://gitlab.example.com/acme/ml/models)
// into GitLab's address and the project; a URL of a group alone is a
// group scope only when it has one path element, since GitLab's groups
// nest and a project's path cannot be told from a subgroup's.
func (driver) RepoConfig(repo string) (string, json.RawMessage, error) {
	u, err := url.Parse(repo)
	if err != nil {
		return "", nil, err
	}
	if u.Scheme == "" || u.Host == "" {
		return "", nil, fmt.Errorf("%q is not a project URL (https://<host>/<group>/<project>)", repo)
	}
	path := strings.Trim(strings.TrimSuffix(u.Path, ".git"), "/")
	path, _, _ = strings.Cut(path, "/-/")
	if path == "" {
		return "", nil, fmt.Errorf("%q names no project", repo)
	}
	// As cml runner's: runners that take the jobs of any branch, merge
	// requests' included.
	s := map[string]string{"project": path, "access_level": AccessNotProtected}
	if !strings.Contains(path, "/") {
		s = map[string]string{"group": path, "access_level": AccessNotProtected}
	}
	b, err := json.Marshal(s)
	return u.Scheme + "://" + u.Host, b, err
}
