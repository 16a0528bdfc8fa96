// Package slurm runs pools of Slurm batch jobs on the real Gitea and a real
// Slurm (Debian's slurmctld and slurmd on this host, two fake GPUs as
// gres), their managers run as an ordinary user; its chaos test is here
// too, so that no other package's Slurm shares the host.
package slurm

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
