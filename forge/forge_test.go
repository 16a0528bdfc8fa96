package forge_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
)

// A connection's budget lets its burst through, then holds every further
// call until a token comes; a call whose context ends first is never sent.
func TestBudgetedHoldsCallsPastTheBudget(t *testing.T) {
	var served atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served.Add(1) }))
	defer srv.Close()
	var sent atomic.Int64
	// Three calls at once, then one an hour.
	c := &http.Client{Transport: forge.Budgeted(forge.CountCalls(nil, &sent), rate.NewLimiter(rate.Every(time.Hour), 3))}
	failed := 0
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL, nil)
		resp, err := c.Do(req)
		cancel()
		if err != nil {
			failed++
			continue
		}
		resp.Body.Close()
	}
	if served.Load() != 3 || failed != 2 {
		t.Fatalf("served %d, held %d; want the burst of 3 served and 2 held", served.Load(), failed)
	}
	if sent.Load() != 3 {
		t.Fatalf("counted %d calls sent, want 3", sent.Load())
	}
}
