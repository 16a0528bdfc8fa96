// Package harness is what the end-to-end tests under internal/e2e share: a
// Fleet (one test's repository on the package's Gitea, its config, state
// directory and `runfleet serve` process, with its own manager id, and so
// its own Docker labels and pod selector in the package's namespace), the
// checks a user would make on it (every job on a fresh runner, no token
// where it must not be, nothing left after a drain), and the peers' set-up:
// Gitea and gitea-runner from peers, the GitHub, GitLab and EC2 stand-ins,
// a private Docker engine with fake GPUs, a Kubernetes control plane. Each
// test package calls Main from its TestMain; the peers start on the first
// test that needs them.
package harness
