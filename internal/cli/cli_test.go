package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// Every command that prints a report takes -o the same way: table (the
// default) or json (and csv, where rows are what it prints: jobs).
// version took text, and gc had none.
func TestOutputFlagIsTheSameEverywhere(t *testing.T) {
	var walk func(c *cobra.Command)
	seen := 0
	walk = func(c *cobra.Command) {
		if f := c.Flags().Lookup("output"); f != nil {
			seen++
			if f.Shorthand != "o" || f.DefValue != "table" || !strings.Contains(f.Usage, "table or json") && !strings.Contains(f.Usage, "table, json or csv") {
				t.Errorf("%s: -o is -%s, default %q, %q", c.CommandPath(), f.Shorthand, f.DefValue, f.Usage)
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(New())
	for _, name := range []string{"status", "jobs", "gpus", "gc", "version"} {
		if c, _, err := New().Find([]string{name}); err != nil || c.Flags().Lookup("output") == nil {
			t.Errorf("%s has no -o", name)
		}
	}
	if seen < 5 {
		t.Errorf("%d commands with -o", seen)
	}
}

// runfleet --version says what runfleet version says.
func TestVersionFlag(t *testing.T) {
	var a, b bytes.Buffer
	if Main([]string{"--version"}, &a, &a) != 0 || Main([]string{"version"}, &b, &b) != 0 || a.String() != b.String() || !strings.HasPrefix(a.String(), "runfleet ") {
		t.Errorf("--version %q, version %q", a.String(), b.String())
	}
}
