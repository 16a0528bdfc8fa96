package bbsim

import (
	"net/http"
	"slices"
	"strings"
)

// Bitbucket's scopes, as an API token or access token holds them: each
// REST endpoint names the scope it requires (its OpenAPI description,
// developer.atlassian.com/cloud/bitbucket/rest: the repository's and its
// files' reads repository, the pipelines' reads pipeline, running a
// pipeline pipeline:write, a workspace's read none); the runners' internal
// endpoints are not described, and Atlassian's runners-autoscaler asks for
// runner:write (its README) to list, create, disable and delete them. A
// write scope implies its read ("Scopes for the Bitbucket Cloud REST
// API": pipeline:write, runner:write "implies" pipeline, runner). An API
// token's scopes are named read:<resource>:bitbucket and
// write:<resource>:bitbucket.

// required returns the scope a manager's call needs, "" for none.
func required(r *http.Request) string {
	p, read := r.URL.Path, r.Method == http.MethodGet
	switch {
	case strings.Contains(p, "/pipelines-config/runners"):
		if read {
			return "read:runner:bitbucket"
		}
		return "write:runner:bitbucket"
	case strings.HasPrefix(p, "/2.0/repositories/") && strings.Contains(p, "/pipelines"):
		if read {
			return "read:pipeline:bitbucket"
		}
		return "write:pipeline:bitbucket"
	case strings.HasPrefix(p, "/2.0/repositories/"):
		return "read:repository:bitbucket"
	}
	return ""
}

// scoped reports whether the credential's scopes allow r; when they do
// not, it answers as Bitbucket does: 403, "Your credentials lack one or
// more required privilege scopes.", with what was granted and required in
// its detail (the shape clients meet, e.g. in their tests' captured
// answers). Called with s.mu not held.
func (s *Server) scoped(w http.ResponseWriter, r *http.Request) bool {
	need := required(r)
	if need == "" || s.opt.Scopes == nil || slices.Contains(s.opt.Scopes, need) ||
		slices.Contains(s.opt.Scopes, strings.Replace(need, "read:", "write:", 1)) {
		return true
	}
	s.mu.Lock()
	s.scopeRefusals = append(s.scopeRefusals, r.Method+" "+r.URL.Path)
	s.mu.Unlock()
	writeJSON(w, http.StatusForbidden, map[string]any{"type": "error", "error": map[string]any{
		"message": "Your credentials lack one or more required privilege scopes.",
		"detail":  map[string]any{"granted": s.opt.Scopes, "required": []string{need}},
	}})
	return false
}

// ScopeRefusals returns the manager's calls refused for a scope its
// credential lacks.
func (s *Server) ScopeRefusals() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.scopeRefusals)
}

// failShaped answers an error with its words where Options.ErrorShape
// puts them, a generic message in error.message otherwise.
func (s *Server) failShaped(w http.ResponseWriter, code int, msg string) {
	e := map[string]any{}
	switch s.opt.ErrorShape {
	case "detail":
		e["message"], e["detail"] = http.StatusText(code), msg
	default:
		e["message"] = msg
	}
	writeJSON(w, code, map[string]any{"type": "error", "error": e})
}
