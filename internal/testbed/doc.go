// Package testbed holds no code: its subpackages are what runfleet's tests
// run against, never part of the product. peers builds and starts real
// programs (Gitea, gitea-runner, a Kubernetes control plane); ghsim, glsim,
// azsim, bbsim and ec2sim stand in for GitHub, GitLab, Azure DevOps,
// Bitbucket and EC2, each following its published API (and, for
// Bitbucket's runners, Atlassian's autoscaler); kubenode stands in for a
// kubelet; stall for a peer that never answers; harness is the end-to-end tests' shared fleet; demo is
// `make demo`. No product package imports any of them (TestProductImportsNoTestbed).
package testbed
