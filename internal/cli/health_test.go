package cli

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"
)

// health exits 0 for a healthy manager, 1 for an unhealthy or absent one:
// what a container's health check reads.
func TestHealth(t *testing.T) {
	healthy := true
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" {
			http.NotFound(w, r)
			return
		}
		if !healthy {
			http.Error(w, "unhealthy", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	}))
	defer srv.Close()
	var out, errb bytes.Buffer
	if code := Main([]string{"health", "--url", srv.URL + "/healthz"}, &out, &errb); code != 0 || out.String() != "ok\n" {
		t.Errorf("healthy: exit %d, %q %q", code, out.String(), errb.String())
	}
	healthy = false
	if code := Main([]string{"health", "--url", srv.URL + "/healthz"}, &out, &errb); code != ExitFailure {
		t.Errorf("unhealthy: exit %d", code)
	}
	srv.Close()
	t.Setenv("RUNFLEET_HEALTH_URL", srv.URL+"/healthz")
	if code := Main([]string{"health"}, &out, &errb); code != ExitFailure {
		t.Errorf("no manager: exit %d", code)
	}
}
