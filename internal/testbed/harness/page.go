package harness

import (
	"context"
	"html"
	"os"
	"os/exec"
	"regexp"
	"strconv"
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
	cmd := exec.CommandContext(ctx, bin, append(base, args...)...)
	// Chromium's helpers hold its output open after it is killed: wait
	// for them no longer than this.
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.Output()
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

// Drawn is one chart of the status page as drawn: its first time, the
// step between times, and each series' values.
type Drawn struct {
	From   time.Time
	Step   time.Duration
	Series map[string][]string
}

var chartOpenRE = regexp.MustCompile(`<svg class="chart" viewBox="[^"]*" role="img" aria-label="([^"]*)" data-from="([^"]*)" data-step="([^"]*)"`)
var seriesRE = regexp.MustCompile(`data-series="([^"]+)" data-values="([^"]*)"`)

// Charts reads the charts of a pool's section of the page (all of the
// page's for pool ""), by title, in the order drawn.
func Charts(t testing.TB, page, pool string) map[string][]Drawn {
	t.Helper()
	if pool != "" {
		i := strings.Index(page, `id="pool-`+pool+`"`)
		if i < 0 {
			t.Fatalf("the page has no pool %s", pool)
		}
		page = page[i:]
		if j := strings.Index(page, "</section>"); j >= 0 {
			page = page[:j]
		}
	}
	out := map[string][]Drawn{}
	for _, loc := range chartOpenRE.FindAllStringSubmatchIndex(page, -1) {
		m := func(k int) string { return page[loc[2*k]:loc[2*k+1]] }
		d := Drawn{Series: map[string][]string{}}
		d.From, _ = time.Parse(time.RFC3339, m(2))
		if s, err := strconv.ParseFloat(m(3), 64); err == nil {
			d.Step = time.Duration(s * float64(time.Second))
		}
		body := page[loc[1]:]
		body = body[:strings.Index(body, "</svg>")]
		for _, s := range seriesRE.FindAllStringSubmatch(body, -1) {
			d.Series[s[1]] = strings.Fields(s[2])
		}
		out[html.UnescapeString(m(1))] = append(out[html.UnescapeString(m(1))], d)
	}
	return out
}
