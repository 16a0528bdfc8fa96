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

// beside marks a test that may run beside the others so marked, once the
// rest have run one at a time: each has a fleet, a manager and Slurm jobs
// of its own, and none of them takes the cluster's GPUs, stops its
// controller or node, preempts, or reads what other users' jobs leave
// (the run_as test does; so do the crash, outage, preemption and GPU
// tests, and the late job's, whose timing is its point). They wait on
// Slurm's own clock (PERIODIC_TIMEOUT, MinJobAge, a job's time limit)
// more than they work: one at a time, they took 5.5 minutes of the
// package's 15.
func beside(t *testing.T) { t.Parallel() }
