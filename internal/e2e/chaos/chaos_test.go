package chaos

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestChaosProcess and TestChaosDocker kill -9 the manager at random
// moments while bursts of jobs run on the real Gitea, restarting it after
// a random pause; now and then they stop it gracefully instead
// (SIGTERM, which removes idle runners while jobs are being handed out).
// Every job must succeed on a runner of its own, no runner name may be
// registered twice at once, and after the final drain nothing is left:
// registrations, processes, containers, working directories, records. They
// share this package so that no two run at once: each keeps a machine's two
// cores busy. The pools of CML's clouds (pods, instances) have theirs in
// internal/e2e/chaoscloud, so that the two halves run side by side.
func TestChaosProcess(t *testing.T) {
	f := harness.NewFleet(t, "chaosproc", harness.ChaosOptions(""))
	harness.RunChaos(t, f)
}

// TestChaosDocker found that a manager killed between creating a container
// and starting it left a start that the engine carried out after the next
// manager had listed the container as exited: that manager removed it as
// its agent took a job, and the job was lost. Such a container is now
// listed as created, a runner coming up.
func TestChaosDocker(t *testing.T) {
	img := harness.NeedDocker(t)
	f := harness.NewFleet(t, "chaosdock", harness.ChaosOptions("      image: "+img+"\n"))
	harness.RunChaos(t, f)
}
