// Package kube tests the Kubernetes provider end to end on a real control
// plane with stand-in nodes: pods, adoption, eviction, failover, deploy, the
// scale benchmark.
package kube

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
