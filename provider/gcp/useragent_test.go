package gcp

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/runfleet/runfleet/version"
)

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// Compute Engine's operators see runfleet and its release ahead of the
// client library's name; the caller's request is left as it was.
func TestRequestsNameRunfleet(t *testing.T) {
	var got string
	m := &meter{limits: NewLimits(), base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		got = r.UserAgent()
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: r}, nil
	})}
	req := httptest.NewRequest(http.MethodGet, "https://compute.googleapis.com/compute/v1/projects/p/zones/z/instances", nil)
	req.Header.Set("User-Agent", "gcloud-golang/0.1")
	if _, err := m.RoundTrip(req); err != nil {
		t.Fatal(err)
	}
	if want := version.UserAgent() + " gcloud-golang/0.1"; got != want {
		t.Errorf("User-Agent %q, want %q", got, want)
	}
	if req.UserAgent() != "gcloud-golang/0.1" {
		t.Errorf("the caller's request changed: %q", req.UserAgent())
	}
}
