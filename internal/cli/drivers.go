package cli

import (
	"fmt"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// The drivers runfleet has. Each is linked by its own file here,
// driver_<tag's name>.go, a blank import behind a build constraint: the
// driver's tag, or no driver tag at all. So a plain build has every
// driver, and `go build -tags 'forge_github provider_docker'` (make build
// DRIVERS="github docker") links those two and none of the others' code
// or SDKs, whose package inits alone cost a manager megabytes. A new
// driver is added to this table and gets its file, whose constraint names
// every tag (TestDriverFiles checks them), and nothing else changes
// outside its own package.
var allDrivers = []builtDriver{
	{"forge", "azure-pipelines", "forge_azurepipelines"},
	{"forge", "bitbucket", "forge_bitbucket"},
	{"forge", "gitea", "forge_gitea"},
	{"forge", "github", "forge_github"},
	{"forge", "gitlab", "forge_gitlab"},
	{"provider", "aws", "provider_aws"},
	{"provider", "azure", "provider_azure"},
	{"provider", "docker", "provider_docker"},
	{"provider", "gcp", "provider_gcp"},
	{"provider", "kubernetes", "provider_kubernetes"},
	{"provider", "process", "provider_process"},
	{"provider", "slurm", "provider_slurm"},
}

// builtDriver is a driver runfleet has: its kind, the name it registers
// (a forge's type, a pool's provider) and its build tag.
type builtDriver struct {
	kind, name, tag string
}

// built reports whether this binary has the driver.
func (d builtDriver) built() bool {
	if d.kind == "forge" {
		_, ok := forge.Lookup(d.name)
		return ok
	}
	_, ok := provider.Lookup(d.name)
	return ok
}

// makeName is the driver's name in make build's DRIVERS: its tag's.
func (d builtDriver) makeName() string {
	_, name, _ := strings.Cut(d.tag, "_")
	return name
}

// The drivers this binary was built without are told to the registries,
// with how to build one in, so that a config naming one is refused with
// that rather than as a driver that does not exist.
func init() {
	var with []builtDriver
	for _, d := range allDrivers {
		if d.built() {
			with = append(with, d)
		}
	}
	for _, d := range allDrivers {
		if d.built() {
			continue
		}
		how := howToBuild(append(slices.Clone(with), d))
		if d.kind == "forge" {
			forge.LeaveOut(d.name, how)
		} else {
			provider.LeaveOut(d.name, how)
		}
	}
}

// howToBuild says how to build runfleet with these drivers: this build's
// and the one it lacks.
func howToBuild(ds []builtDriver) string {
	var tags, names []string
	for _, d := range ds {
		tags, names = append(tags, d.tag), append(names, d.makeName())
	}
	slices.Sort(tags)
	slices.Sort(names)
	return fmt.Sprintf("build with -tags '%s' (make build DRIVERS=%q), or run a release binary that has it (docs/builds.md)",
		strings.Join(tags, " "), strings.Join(names, " "))
}

// builtDrivers lists this binary's drivers, for runfleet version.
func builtDrivers() (forges, providers []string) {
	for _, d := range allDrivers {
		switch {
		case !d.built():
		case d.kind == "forge":
			forges = append(forges, d.name)
		default:
			providers = append(providers, d.name)
		}
	}
	return forges, providers
}

// driversLine is runfleet version's line of drivers.
func driversLine() string {
	forges, providers := builtDrivers()
	return fmt.Sprintf("forges: %s; providers: %s", strings.Join(forges, ", "), strings.Join(providers, ", "))
}
