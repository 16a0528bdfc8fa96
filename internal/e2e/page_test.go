package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// chromium returns Debian's headless browser; the test is skipped without
// it, and fails in CI, where .ci/run installs it.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium is required in CI (apt-get install chromium)")
	}
	t.Skip("needs chromium")
	return ""
}

func headless(t *testing.T, bin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// No sandbox: tests run as root, which Chromium's sandbox refuses.
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--user-data-dir=" + t.TempDir()}
	out, err := exec.CommandContext(ctx, bin, append(base, args...)...).Output()
	if err != nil {
		t.Fatalf("chromium %v: %v", args, err)
	}
	return string(out)
}

// TestStatusPageInChromium loads the status page in headless Chromium
// while a job runs: the page shows the pool, the busy runner and its job,
// and a screenshot is taken (kept where RUNFLEET_SCREENSHOT says).
func TestStatusPageInChromium(t *testing.T) {
	bin := chromium(t)
	f, base := scaleFleet(t, "page", true, false)
	f.rewriteFile("size: 0\n", "size: 1\n")
	f.start()
	eventually(t, time.Minute, "1 idle runner", func() bool { return f.idleOnline() == 1 })
	f.push(matrix("page", 1, "echo training\nsleep 12"))
	f.waitInProgress(1)

	var dom string
	eventually(t, 30*time.Second, "the page to show the busy runner and its job", func() bool {
		dom = headless(t, bin, "--dump-dom", base+"/")
		return strings.Contains(dom, `class="state busy"`) && strings.Contains(dom, "job (1)")
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
	headless(t, bin, "--screenshot="+shot, "--window-size=1100,720", "--hide-scrollbars", base+"/")
	if st, err := os.Stat(shot); err != nil || st.Size() < 5000 {
		t.Fatalf("screenshot %s: %v", shot, err)
	}
	t.Logf("status page screenshot: %s", shot)
	f.waitJobs(1, time.Minute)
	f.stopLeavesNothing()
}

// rewriteFile edits the config file before the manager starts.
func (f *fleet) rewriteFile(old, new string) {
	f.t.Helper()
	b, err := os.ReadFile(f.config)
	if err != nil || !strings.Contains(string(b), old) {
		f.t.Fatalf("config lacks %q: %v", old, err)
	}
	if err := os.WriteFile(f.config, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		f.t.Fatal(err)
	}
}
