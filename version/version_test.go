package version

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestResolve(t *testing.T) {
	vcs := []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.time", Value: "2026-11-26T08:00:00Z"}}
	for _, c := range []struct {
		name    string
		v, c, d string
		bi      *debug.BuildInfo
		want    Info
	}{
		{"ldflags win", "v1.2.0", "abc", "2026-11-26", &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-x"}, Settings: vcs}, Info{Version: "v1.2.0", Commit: "abc", Date: "2026-11-26"}},
		{"go install @version", "", "", "", &debug.BuildInfo{Main: debug.Module{Version: "v1.3.0"}}, Info{Version: "v1.3.0"}},
		{"a checkout's pseudo-version", "", "", "", &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261126080000-0123456789ab"}, Settings: vcs},
			Info{Version: "v0.0.0-20261126080000-0123456789ab", Commit: "0123456789abcdef0123", Date: "2026-11-26T08:00:00Z"}},
		{"go run", "", "", "", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: append(vcs, debug.BuildSetting{Key: "vcs.modified", Value: "true"})},
			Info{Version: "dev-0123456789ab+dirty", Commit: "0123456789abcdef0123", Date: "2026-11-26T08:00:00Z"}},
		{"nothing", "", "", "", nil, Info{Version: "dev"}},
	} {
		got := resolve(c.v, c.c, c.d, c.bi)
		got.Go = ""
		if got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
	s := Info{Version: "v1.2.0", Commit: "0123456789abcdef", Date: "2026-11-26T08:00:00Z", Go: "go1.26.0"}.String()
	if s != "runfleet v1.2.0 (commit 0123456789ab, built 2026-11-26T08:00:00Z, go1.26.0)" || !strings.HasPrefix(Get().String(), "runfleet ") {
		t.Errorf("String() = %q", s)
	}
}
