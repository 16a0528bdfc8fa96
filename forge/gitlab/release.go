package gitlab

import "github.com/runfleet/runfleet/fetch"

// AgentRelease is gitlab-runner as `runfleet runner` fetches it for a
// host or a stock cloud image without one: v18.6.0, the version of
// images/gitlab-runner, from GitLab's download bucket, where each
// release's binaries/ sit beside release.sha256, the list `sha256sum -c`
// reads (docs.gitlab.com/runner/install/linux-manually). runfleet pins
// no digest for it: the list is read from the same place first, and the
// binary must match it (--agent-sha256 pins one instead).
var AgentRelease = fetch.Release{
	Name: "gitlab-runner", Version: "18.6.0",
	URL:  "https://gitlab-runner-downloads.s3.amazonaws.com/v{version}",
	File: "binaries/gitlab-runner-linux-{arch}",
	Arch: map[string]string{"amd64": "amd64", "arm64": "arm64"},
	Sums: "release.sha256", Program: "gitlab-runner",
}

// AgentImage is GitLab's own runner image (gitlab-runner's dockerfiles/
// runner/ubuntu, published to Docker Hub as gitlab/gitlab-runner:v<version>):
// gitlab-runner in PATH, with bash and git for the shell executor
// (forge.AgentImager).
func (driver) AgentImage() string { return "gitlab/gitlab-runner:v" + AgentRelease.Version }

// AgentRelease makes gitlab-runner fetchable (forge.AgentReleaser).
func (driver) AgentRelease() fetch.Release { return AgentRelease }
