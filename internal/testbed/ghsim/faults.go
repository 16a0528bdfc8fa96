package ghsim

import (
	"net/http"
	"strings"
)

// fault answers the next n requests whose "METHOD /path" contains match
// with code.
type fault struct {
	match   string
	code, n int
}

// Fail makes the next n requests whose "METHOD /path" contains match
// answer code, doing nothing else: a 5xx as the services answer one in an
// incident (githubstatus.com), a 403 as GitHub answers a token without
// the permission ("Resource not accessible by personal access token":
// docs.github.com, "Troubleshooting the REST API"). The Actions service
// answers in its own shape (a typeName and a message); its type names for
// these are not published, and actions/scaleset reads only the status
// and the three type names it knows (errors.go).
func (s *Server) Fail(match string, code, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = append(s.faults, fault{match, code, n})
}

// Heal drops the faults Fail set that have not answered all their
// requests: the incident is over.
func (s *Server) Heal() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = nil
}

// Failed returns how many requests Fail's faults answered.
func (s *Server) Failed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

// faulty answers the requests a fault matches, and hands the rest to h.
func (s *Server) faulty(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		what := r.Method + " " + r.URL.Path
		code := 0
		s.mu.Lock()
		for i := range s.faults {
			if f := &s.faults[i]; f.n > 0 && strings.Contains(what, f.match) {
				f.n--
				code = f.code
				s.failed++
				break
			}
		}
		s.mu.Unlock()
		switch {
		case code == 0:
			h.ServeHTTP(w, r)
		case strings.HasPrefix(r.URL.Path, servicePath), strings.HasPrefix(r.URL.Path, "/_msgqueue"):
			exception(w, code, "VssServiceException", http.StatusText(code))
		case code == http.StatusForbidden:
			fail(w, code, "Resource not accessible by personal access token", "/rest/actions/self-hosted-runners")
		case code == http.StatusUnauthorized:
			// A token that is wrong, expired or revoked (docs.github.com,
			// "Troubleshooting the REST API": 401 "Bad credentials").
			fail(w, code, "Bad credentials", "/rest")
		default:
			fail(w, code, http.StatusText(code), "")
		}
	})
}
