package gitea

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// docs/forges/gitea.md's least scope holds: a token with write:repository
// alone runs a repository's pool (jobs, drain, nothing left); one with
// read:repository starts nothing, and the log says why, in Gitea's words.
func TestLeastTokenScope(t *testing.T) {
	harness.Need(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	least, err := harness.Gitea.ScopedToken(ctx, "runfleet-least", "write:repository")
	if err != nil {
		t.Fatal(err)
	}
	f := harness.NewFleet(t, "scopes", harness.FleetOptions{Size: 1})
	f.Env = append(f.Env, "E2E_GITEA_TOKEN="+least) // in place of the admin's all-scopes token
	f.Start()
	f.Push(harness.Matrix("scopes", 2, "echo ran"))
	for _, j := range f.WaitJobs(2, 2*time.Minute) {
		if j.Conclusion != "success" {
			t.Errorf("job %d: %s", j.ID, j.Conclusion)
		}
	}
	f.StopLeavesNothing()
	t.Logf("a write:repository token: 2 jobs, drained, nothing left")

	readOnly, err := harness.Gitea.ScopedToken(ctx, "runfleet-read", "read:repository")
	if err != nil {
		t.Fatal(err)
	}
	g := harness.NewFleet(t, "scopesro", harness.FleetOptions{Size: 1})
	g.Env = append(g.Env, "E2E_GITEA_TOKEN="+readOnly)
	g.Start()
	harness.Eventually(t, time.Minute, "the refusal in the log", func() bool { return g.LogHas("write:repository") })
	lines := harness.LogLines(g.LogPath, "write:repository")
	t.Logf("a read:repository token: %s", strings.TrimSpace(lines[0]))
	if len(g.Runners()) != 0 || g.LiveRunners() != 0 {
		t.Errorf("a runner started with a read-only token")
	}
	if err := g.Stop(time.Minute); err != nil {
		t.Fatal(err)
	}
}
