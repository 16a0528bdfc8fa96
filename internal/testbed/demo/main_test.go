package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// TestDemo runs what `make demo` runs, smaller: every job succeeds, each on
// a runner of its own.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end test: skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	_, err := peers.RunnerBinary(ctx, t.Output())
	if err == nil {
		_, err = peers.GiteaBinary(ctx, t.Output())
	}
	peers.Need(t, "Gitea and gitea-runner", err)

	var out bytes.Buffer
	if err := runDemo(ctx, &out, 3, 2, false, 3*time.Minute); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	t.Log(out.String())
	if !strings.Contains(out.String(), "3 of 3 jobs succeeded") || !strings.Contains(out.String(), "on 3 distinct runners") {
		t.Fatalf("want 3 of 3 jobs succeeded on 3 distinct runners:\n%s", out.String())
	}
}
