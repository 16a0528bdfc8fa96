// Package azure tests the Azure Pipelines driver end to end against the
// Azure DevOps simulator and the stand-in agent: pools of processes and of
// containers, the seed's GPU setup, crashes and kill -9 at random moments,
// scaling from zero, agents that would take a second job, `runfleet runner`.
package azure

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
