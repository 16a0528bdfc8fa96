package forge

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestHoldTransport: a request refused with 429 waits for the hold its
// answer set and is sent again, body and all; the retries are bounded; a
// hold longer than the call may wait fails the call at once.
func TestHoldTransport(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b := make([]byte, 4)
		k, _ := r.Body.Read(b)
		if string(b[:k]) != "body" {
			t.Errorf("attempt %d sent body %q", n.Load()+1, b[:k])
		}
		if n.Add(1) <= 2 {
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer srv.Close()
	var h Hold
	note := func(resp *http.Response) bool {
		if resp.StatusCode == http.StatusTooManyRequests {
			h.Set(50 * time.Millisecond)
			return true
		}
		return false
	}
	hc := &http.Client{Transport: HoldTransport(nil, &h, 3, note)}
	start := time.Now()
	resp, err := hc.Post(srv.URL, "text/plain", strings.NewReader("body"))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%v %v", resp, err)
	}
	resp.Body.Close()
	if n.Load() != 3 || h.Waits() != 2 || time.Since(start) < 100*time.Millisecond {
		t.Errorf("%d attempts, %d waits in %s; want 3 and 2, after two holds", n.Load(), h.Waits(), time.Since(start))
	}
	n.Store(-10) // 429s from now on
	hc = &http.Client{Transport: HoldTransport(nil, &h, 1, note)}
	resp, err = hc.Post(srv.URL, "text/plain", strings.NewReader("body"))
	if err != nil || resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("after its retries: %v %v, want the 429", resp, err)
	}
	resp.Body.Close()
	h.Set(time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	start = time.Now()
	if _, err := hc.Do(req); err == nil || !strings.Contains(err.Error(), "longer than the call may wait") || time.Since(start) > 500*time.Millisecond {
		t.Errorf("a hold past the deadline: %v after %s", err, time.Since(start))
	}
}
