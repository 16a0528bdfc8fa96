package gitea

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestStatusPageInChromium loads the status page in headless Chromium
// while a job runs: the page shows the pool, the busy runner and its job,
// and a screenshot is taken (kept where RUNFLEET_SCREENSHOT says).
func TestStatusPageInChromium(t *testing.T) {
	bin := harness.Chromium(t)
	f, base := harness.ScaleFleet(t, "page", true, false)
	f.RewriteFile("size: 0\n", "size: 1\n")
	f.Start()
	harness.Eventually(t, time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("page", 1, "echo training\nsleep 12"))
	f.WaitInProgress(1)

	var dom string
	harness.Eventually(t, 30*time.Second, "the page to show the busy runner and its job", func() bool {
		dom = harness.Headless(t, bin, "--dump-dom", base+"/")
		return strings.Contains(dom, `class="state busy"`) && strings.Contains(dom, "job (1)") && strings.Contains(dom, "in_progress")
	})
	for _, want := range []string{"runfleet · e2e-page", `id="pool-page"`, "size 1, max 4", "Recent jobs", "in_progress", `http-equiv="refresh"`} {
		if !strings.Contains(dom, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	shot := os.Getenv("RUNFLEET_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(t.TempDir(), "status.png")
	}
	harness.Headless(t, bin, "--screenshot="+shot, "--window-size=1100,720", "--hide-scrollbars", base+"/")
	if st, err := os.Stat(shot); err != nil || st.Size() < 5000 {
		t.Fatalf("screenshot %s: %v", shot, err)
	}
	t.Logf("status page screenshot: %s", shot)
	f.WaitJobs(1, time.Minute)
	f.StopLeavesNothing()
}
