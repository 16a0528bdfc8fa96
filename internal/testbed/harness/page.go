package harness

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Chromium returns Debian's headless browser; the test is skipped without
// it, and fails in CI, where .ci/run installs it.
func Chromium(t *testing.T) string {
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

func Headless(t *testing.T, bin string, args ...string) string {
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

// RewriteFile edits the config file before the manager starts.
func (f *Fleet) RewriteFile(old, new string) {
	f.T.Helper()
	b, err := os.ReadFile(f.Config)
	if err != nil || !strings.Contains(string(b), old) {
		f.T.Fatalf("config lacks %q: %v", old, err)
	}
	if err := os.WriteFile(f.Config, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		f.T.Fatal(err)
	}
}
