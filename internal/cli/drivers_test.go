package cli

import (
	"go/build/constraint"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// Each driver's file links it in a plain build, under its own tag, and
// beside any other driver's tag, and in no build that names other drivers'
// tags alone; leader election (elect.go) comes with the kubernetes driver.
func TestDriverFiles(t *testing.T) {
	files, err := filepath.Glob("driver_*.go")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, "elect.go")
	exprs := map[string]constraint.Expr{} // by the tag that should build it
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly|parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		var expr constraint.Expr
		for _, c := range f.Comments[0].List {
			if constraint.IsGoBuild(c.Text) {
				if expr, err = constraint.Parse(c.Text); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
			}
		}
		if expr == nil {
			t.Fatalf("%s: no //go:build line", name)
		}
		if name == "elect.go" {
			exprs["elect"] = expr
			continue
		}
		tag := strings.TrimSuffix(strings.TrimPrefix(name, "driver_"), ".go")
		var d builtDriver
		for _, a := range allDrivers {
			if a.makeName() == tag {
				d = a
			}
		}
		if d.tag == "" {
			t.Errorf("%s: no driver in allDrivers has the tag *_%s", name, tag)
			continue
		}
		want := "github.com/runfleet/runfleet/" + d.kind + "/" + tag
		if len(f.Imports) != 1 || f.Imports[0].Path.Value != strconv.Quote(want) {
			t.Errorf("%s: imports something else than %s alone", name, want)
		}
		exprs[d.tag] = expr
	}
	if len(exprs) != len(allDrivers)+1 {
		t.Errorf("%d driver files for %d drivers in allDrivers", len(exprs)-1, len(allDrivers))
	}
	builds := func(e constraint.Expr, tags ...string) bool {
		return e.Eval(func(tag string) bool {
			for _, t := range tags {
				if t == tag {
					return true
				}
			}
			return tag == "linux" || tag == "amd64" || tag == "nvml"
		})
	}
	for key, e := range exprs {
		own := key
		if key == "elect" {
			own = "provider_kubernetes"
		}
		if !builds(e) {
			t.Errorf("%s: not in a build without driver tags", key)
		}
		for _, d := range allDrivers {
			if got, want := builds(e, d.tag), d.tag == own; got != want {
				t.Errorf("%s: built with -tags %s alone: %v, want %v", key, d.tag, got, want)
			}
			if !builds(e, d.tag, own) {
				t.Errorf("%s: not built with -tags '%s %s'", key, d.tag, own)
			}
		}
	}
}

// This build, with every driver, lists them all: the table's names are
// the ones the drivers register.
func TestEveryDriverBuilt(t *testing.T) {
	for _, d := range allDrivers {
		if !d.built() {
			t.Errorf("%s %s is not registered in a plain build", d.kind, d.name)
		}
	}
	forges, providers := builtDrivers()
	if strings.Join(forges, " ") != strings.Join(forge.Types(), " ") || strings.Join(providers, " ") != strings.Join(provider.Names(), " ") {
		t.Errorf("built drivers %v %v, registered %v %v", forges, providers, forge.Types(), provider.Names())
	}
}

// A config that names a driver this build lacks is refused with the tags
// that build it in, whichever field names it; a typo is still a typo.
func TestLeftOutDriverRefused(t *testing.T) {
	// What init tells the registries of a build without these two.
	forge.LeaveOut("test-forge", howToBuild([]builtDriver{{"forge", "gitea", "forge_gitea"}, {"forge", "test-forge", "forge_testforge"}}))
	provider.LeaveOut("test-cloud", howToBuild([]builtDriver{{"provider", "process", "provider_process"}, {"provider", "test-cloud", "provider_testcloud"}}))
	const how = `build with -tags 'forge_gitea forge_testforge' (make build DRIVERS="gitea testforge"), or run a release binary that has it (docs/builds.md)`
	for _, c := range []struct{ yaml, want string }{
		{"forges:\n  - {name: f, type: test-forge, url: http://f, token: t}\npools:\n  - {name: p, forge: f, labels: [x]}\n",
			`forges[0].type: forge type "test-forge" is not in this build of runfleet: ` + how},
		{"forges:\n  - {name: f, type: gitea, url: http://f, token: t}\npools:\n  - {name: p, forge: f, labels: [x], provider: test-cloud}\n",
			`pools[0].provider: provider "test-cloud" is not in this build of runfleet: build with -tags 'provider_process provider_testcloud'`},
		{"forges:\n  - {name: f, type: gitea, url: http://f, token: t}\npools:\n  - {name: p, forge: f, labels: [x], test-cloud: {zone: a}}\n",
			`pools[0].test-cloud: provider "test-cloud" is not in this build of runfleet: build with -tags 'provider_process provider_testcloud'`},
		{"forges:\n  - {name: f, type: gitae, url: http://f, token: t}\npools:\n  - {name: p, forge: f, labels: [x]}\n",
			`forges[0].type: unknown forge type "gitae" (known: `},
	} {
		_, err := config.Parse([]byte("id: t\n" + c.yaml))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v\nwant %s", c.yaml, err, c.want)
		}
	}
}

// docs/builds.md names every driver's tag, and the Makefile's lists of
// forges and providers (make build DRIVERS=...) are the table's.
func TestBuildDocsNameEveryTag(t *testing.T) {
	b, err := os.ReadFile("../../docs/builds.md")
	if err != nil {
		t.Fatal(err)
	}
	mk, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	lists := map[string][]string{}
	for line := range strings.SplitSeq(string(mk), "\n") {
		for _, v := range []string{"FORGES", "PROVIDERS"} {
			if rest, ok := strings.CutPrefix(line, v+" = "); ok {
				lists[v] = strings.Fields(rest)
			}
		}
	}
	want := map[string][]string{}
	for _, d := range allDrivers {
		if !strings.Contains(string(b), "`"+d.tag+"`") {
			t.Errorf("docs/builds.md does not name %s's tag `%s`", d.name, d.tag)
		}
		k := map[string]string{"forge": "FORGES", "provider": "PROVIDERS"}[d.kind]
		want[k] = append(want[k], d.makeName())
	}
	for k, names := range want {
		if strings.Join(lists[k], " ") != strings.Join(names, " ") {
			t.Errorf("the Makefile's %s are %v, want %v", k, lists[k], names)
		}
	}
}

// The binary calls Kubernetes through kubeclient's clients: none of
// client-go's packages that register every API group's types at start
// (the typed clientset and its scheme, the informer factory, leader
// election's resource locks: some 20 MiB resident, docs/builds.md) may
// come back, even through another import.
func TestNoClientsetLinked(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list: skipped with -short")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/runfleet/runfleet/cmd/runfleet").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	api := 0
	for _, pkg := range strings.Fields(string(out)) {
		switch {
		case pkg == "k8s.io/client-go/kubernetes/scheme", strings.HasPrefix(pkg, "k8s.io/client-go/kubernetes/typed/"),
			strings.HasPrefix(pkg, "k8s.io/client-go/informers"), strings.HasPrefix(pkg, "k8s.io/client-go/tools/leaderelection"):
			t.Errorf("runfleet links %s", pkg)
		case strings.HasPrefix(pkg, "k8s.io/api/"):
			api++
		}
	}
	if api > 2 {
		t.Errorf("runfleet links %d of k8s.io/api's groups, want core/v1 and coordination/v1 alone", api)
	}
}
