// Package version says which runfleet this is: the release version, the
// commit and the build date, from the linker flags of `make build` and
// `make release`, or else from what the Go toolchain stamps in the binary
// (`go install .../cmd/runfleet@v1.2.0`, or a build from a git checkout).
package version

import (
	"cmp"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
)

// Set by the linker: -X github.com/runfleet/runfleet/version.version=v1.2.0
// (and commit, date).
var version, commit, date string

// Info is this binary's version.
type Info struct {
	Version string `json:"version"`
	Commit  string `json:"commit,omitempty"`
	Date    string `json:"date,omitempty"` // of the build, or of the commit
	Go      string `json:"go"`
}

// Get returns the binary's version, read once: clients ask for it in
// every request's User-Agent.
func Get() Info { return get() }

var get = sync.OnceValue(func() Info {
	bi, _ := debug.ReadBuildInfo()
	return resolve(version, commit, date, bi)
})

// resolve prefers what the linker set, then the build information; a build
// that says nothing is "dev".
func resolve(v, c, d string, bi *debug.BuildInfo) Info {
	info := Info{Version: v, Commit: c, Date: d, Go: runtime.Version()}
	if bi == nil {
		info.Version = cmp.Or(info.Version, "dev")
		return info
	}
	if info.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		info.Version = bi.Main.Version // go install ...@v1.2.0, or a checkout's pseudo-version
	}
	modified := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Commit = cmp.Or(info.Commit, s.Value)
		case "vcs.time":
			info.Date = cmp.Or(info.Date, s.Value)
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if info.Version == "" {
		info.Version = "dev"
		if info.Commit != "" {
			info.Version = "dev-" + info.Commit[:min(12, len(info.Commit))]
		}
	}
	if modified && !strings.HasSuffix(info.Version, "+dirty") && !strings.HasSuffix(info.Version, "-dirty") {
		info.Version += "+dirty"
	}
	return info
}

// String is the one line `runfleet version` prints.
func (i Info) String() string {
	var b strings.Builder
	b.WriteString("runfleet " + i.Version)
	var rest []string
	if i.Commit != "" {
		rest = append(rest, "commit "+i.Commit[:min(12, len(i.Commit))])
	}
	if i.Date != "" {
		rest = append(rest, "built "+i.Date)
	}
	rest = append(rest, i.Go)
	b.WriteString(" (" + strings.Join(rest, ", ") + ")")
	return b.String()
}

// UserAgent is what runfleet calls itself to forges and clouds:
// runfleet/<version>, so that their operators can tell its requests, and
// which release sent them, from other clients'.
func UserAgent() string { return "runfleet/" + Get().Version }
