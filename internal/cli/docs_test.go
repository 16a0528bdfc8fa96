package cli

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// The sections every driver's page has: a user looks for each by name.
var forgeSections = []string{"## What it needs", "## Token and permissions", "## A complete config", "## When it goes wrong", "## Limits"}
var providerSections = []string{"## What it needs", "## Permissions", "## A complete config", "## When it goes wrong", "## Limits"}

// Every registered driver has its page in docs/, with the sections a user
// looks for and a complete config that serve takes as written; the README
// links every page. A new driver without a page fails here.
func TestEveryDriverHasADocsPage(t *testing.T) {
	readme := read(t, "../../README.md")
	for _, typ := range forge.Types() {
		checkPage(t, readme, "forges/"+typ+".md", forgeSections, func(cfg *config.Config) bool {
			return slices.ContainsFunc(cfg.Forges, func(f config.Forge) bool { return f.Type == typ })
		})
	}
	for _, name := range provider.Names() {
		checkPage(t, readme, "providers/"+name+".md", providerSections, func(cfg *config.Config) bool {
			return slices.ContainsFunc(cfg.Pools, func(p config.Pool) bool { return p.Provider == name })
		})
	}
	for _, page := range []string{"security.md", "cml.md"} {
		if !strings.Contains(readme, "](docs/"+page+")") {
			t.Errorf("the README does not link docs/%s", page)
		}
	}
}

// The option table of docs/cml.md is the flag set's: its first column
// names every option of `cml runner launch` (each spelling), and nothing
// else; runfleet's own options are in its second column with none in the
// first.
func TestCMLPageTable(t *testing.T) {
	page := read(t, "../../docs/cml.md")
	_, table, _ := strings.Cut(page, "\n## Each option\n")
	table, _, _ = strings.Cut(table, "\n## ")
	flag := regexp.MustCompile("`--([a-z0-9_-]+)")
	inCML, inRunfleet := map[string]bool{}, map[string]bool{}
	for _, line := range strings.Split(table, "\n") {
		cells := strings.Split(line, " | ")
		if !strings.HasPrefix(line, "| ") || len(cells) < 3 {
			continue
		}
		for _, m := range flag.FindAllStringSubmatch(cells[0], -1) {
			inCML[m[1]] = true
		}
		for _, m := range flag.FindAllStringSubmatch(cells[1], -1) {
			inRunfleet[m[1]] = true
		}
	}
	want := map[string]bool{}
	for _, o := range cmlOptions {
		for _, n := range append([]string{o.name}, o.aliases...) {
			if o.runfleet {
				if !inRunfleet[n] {
					t.Errorf("docs/cml.md: runfleet's --%s is not in the table", n)
				}
				continue
			}
			want[n] = true
			if !inCML[n] {
				t.Errorf("docs/cml.md: CML's --%s is not in the table", n)
			}
		}
	}
	for n := range inCML {
		if !want[n] {
			t.Errorf("docs/cml.md: --%s is listed as CML's, and `cml runner launch` has no such option", n)
		}
	}
}

var varRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)

func checkPage(t *testing.T, readme, page string, sections []string, ofDriver func(*config.Config) bool) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("../../docs", page))
	if err != nil {
		t.Errorf("no docs page for a registered driver: %v", err)
		return
	}
	doc := string(b)
	for _, s := range sections {
		if !strings.Contains(doc, "\n"+s+"\n") {
			t.Errorf("docs/%s has no %q section", page, s)
		}
	}
	if !strings.Contains(readme, "](docs/"+page+")") {
		t.Errorf("the README does not link docs/%s", page)
	}
	_, after, _ := strings.Cut(doc, "\n## A complete config\n")
	_, block, ok := strings.Cut(after, "```yaml\n")
	block, _, ok2 := strings.Cut(block, "```")
	if !ok || !ok2 {
		t.Errorf("docs/%s: no yaml block under its complete config", page)
		return
	}
	for _, m := range varRef.FindAllStringSubmatch(block, -1) {
		t.Setenv(m[1], "a-value-of-at-least-16-characters")
	}
	cfg, err := config.Parse([]byte(block))
	if err != nil {
		t.Errorf("docs/%s: its complete config is refused: %v", page, err)
		return
	}
	if !ofDriver(cfg) {
		t.Errorf("docs/%s: its complete config does not use the driver", page)
	}
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
