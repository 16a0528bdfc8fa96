// Package e2e holds no code: its subpackages test runfleet end to end, one
// package per area (gitea, manager, github, gitlab, azure, docker, kube,
// aws, chaos, chaoscloud), so that `go test ./...` runs the areas side by side.
// A package whose tests use Gitea starts its own and, where its tests need
// them, its own Docker engine with fake GPUs or Kubernetes control plane;
// what they share is in internal/testbed/harness.
package e2e
