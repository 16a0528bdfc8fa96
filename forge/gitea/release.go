package gitea

import "github.com/runfleet/runfleet/fetch"

// AgentRelease is gitea-runner (formerly act_runner) as `runfleet runner`
// fetches it for a host or a stock cloud image without one: v1.0.8, the
// version the tests run, from dl.gitea.com, where each binary has a
// <file>.sha256 beside it (gitea/runner's Makefile, release-check).
// runfleet pins no digest for it: that list is read from the same place
// first, and the binary must match it (--agent-sha256 pins one instead).
var AgentRelease = fetch.Release{
	Name: "gitea-runner", Version: "1.0.8",
	URL:  "https://dl.gitea.com/gitea-runner/{version}",
	File: "gitea-runner-{version}-linux-{arch}",
	Arch: map[string]string{"amd64": "amd64", "arm64": "arm64"},
	Sums: "{file}.sha256", Program: "gitea-runner",
}

// AgentRelease makes gitea-runner fetchable (forge.AgentReleaser).
func (driver) AgentRelease() fetch.Release { return AgentRelease }
