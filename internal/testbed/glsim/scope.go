package glsim

import (
	"net/http"
	"regexp"
	"slices"
	"strings"
)

// GitLab's access token scopes, as its API checks them: every route takes
// api (lib/api/api.rb: allow_access_with_scope :api), and read_api for GET
// and HEAD (the same file: allow_access_with_scope :read_api, if:
// request.get? || request.head?); POST /user/runners also takes
// create_runner (lib/api/user_runners.rb: allow_access_with_scope
// :create_runner, if: request.post?); a /runners/:id route also takes
// manage_runner (lib/api/ci/runners.rb: allow_access_with_scope
// :manage_runner, if: the request has :id and its path is
// /api/v[34]/runners/...: pause, delete, its jobs, its token's reset;
// not /runners/all, which has no :id).

var runnerByID = regexp.MustCompile(`^/api/v4/runners/\d+(/|$)`)

// scopesFor returns the scopes that would let r through.
func scopesFor(r *http.Request) []string {
	ok := []string{"api"}
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		ok = append(ok, "read_api")
	}
	if r.Method == http.MethodPost && r.URL.Path == "/api/v4/user/runners" {
		ok = append(ok, "create_runner")
	}
	if runnerByID.MatchString(r.URL.Path) {
		ok = append(ok, "manage_runner")
	}
	return ok
}

// scopeShort returns the scopes r would need when the token has none of
// them, nil when it may.
func (s *Server) scopeShort(r *http.Request) []string {
	have := s.opt.Scopes
	if have == nil {
		have = []string{"api"}
	}
	need := scopesFor(r)
	for _, sc := range need {
		if slices.Contains(have, sc) {
			return nil
		}
	}
	s.mu.Lock()
	s.scopeRefusals = append(s.scopeRefusals, r.Method+" "+r.URL.Path)
	s.mu.Unlock()
	return need
}

// insufficientScope answers as GitLab's API guard does for a token
// without the scope (lib/api/api_guard.rb, InsufficientScopeError: a
// Bearer Forbidden of rack-oauth2): 403, the error, its description and
// the scopes that would do.
func insufficientScope(w http.ResponseWriter, need []string) {
	writeJSON(w, http.StatusForbidden, map[string]string{
		"error":             "insufficient_scope",
		"error_description": "The request requires higher privileges than provided by the access token.",
		"scope":             strings.Join(need, " "),
	})
}

// ScopeRefusals returns the calls refused for a scope the token lacks.
func (s *Server) ScopeRefusals() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.scopeRefusals)
}
