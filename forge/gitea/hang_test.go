package gitea

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/testbed/stall"
)

// A Gitea that accepts connections and never answers cannot hold a pass:
// every call the pool makes ends, with an error, at the call's deadline.
func TestHangingForgeTimesOut(t *testing.T) {
	d := New(Config{
		URL: "http://" + stall.Listen(t), Token: "t",
		Scope:       Scope{Kind: "repo", Owner: "a", Repo: "b"},
		CallTimeout: 300 * time.Millisecond,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	calls := map[string]func(context.Context) error{
		"list runners": func(ctx context.Context) error { _, err := d.Runners(ctx); return err },
		"list jobs":    func(ctx context.Context) error { _, err := d.Jobs(ctx, forge.JobQueued); return err },
		"register": func(ctx context.Context) error {
			_, err := d.Register(ctx, forge.RunnerRequest{Name: "p-1", Labels: []string{"gpu"}})
			return err
		},
		"remove runner": func(ctx context.Context) error { return d.RemoveRunner(ctx, 7) },
	}
	for name, call := range calls {
		t.Run(name, func(t *testing.T) {
			done := make(chan error, 1)
			start := time.Now()
			go func() { done <- call(context.Background()) }()
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("a forge that never answers gave an answer")
				}
				t.Logf("failed after %s: %v", time.Since(start).Round(time.Millisecond), err)
			case <-time.After(10 * time.Second):
				t.Fatal("a call to a forge that never answers did not end")
			}
		})
	}
}
