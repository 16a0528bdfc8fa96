package testbed

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/runfleet/runfleet"

// TestProductImportsNoTestbed checks the import graph: the runfleet binary
// and every product package are built without any test-bed package, so
// nothing that only serves tests ships.
func TestProductImportsNoTestbed(t *testing.T) {
	testOnly := func(pkg string) bool {
		return strings.HasPrefix(pkg, module+"/internal/testbed") || strings.HasPrefix(pkg, module+"/internal/e2e")
	}
	// Deps is what `go list -deps` lists, less the package itself.
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{join .Deps " "}}`, module+"/...").Output()
	if err != nil {
		t.Fatalf("go list %s/...: %v", module, err)
	}
	products, binDeps := 0, 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if testOnly(f[0]) {
			continue
		}
		products++
		if f[0] == module+"/cmd/runfleet" {
			binDeps = len(f) - 1
		}
		for _, d := range f[1:] {
			if testOnly(d) {
				t.Errorf("product package %s imports test-bed package %s", f[0], d)
			}
		}
	}
	t.Logf("cmd/runfleet: %d packages; %d product packages checked", binDeps, products)
	if binDeps < 100 || products < 10 {
		t.Fatalf("cmd/runfleet has %d dependencies and the module %d product packages; want the whole graph", binDeps, products)
	}
}
