package chaos

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestChaosProcess, TestChaosDocker and TestChaosKube kill -9 the manager
// at random moments while bursts of jobs run on the real Gitea, restarting
// it after a random pause; now and then they stop it gracefully instead
// (SIGTERM, which removes idle runners while jobs are being handed out).
// Every job must succeed on a runner of its own, no runner name may be
// registered twice at once, and after the final drain nothing is left:
// registrations, processes, containers, working directories, records. They
// share this package so that no two run at once: each keeps a machine's two
// cores busy. A provider added later adds itself here.
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

// TestChaosKube is the same for a pool of pods: a manager killed between
// creating a pod and its Secret, or while pods end and are deleted, leaves
// nothing that the next one does not adopt or remove.
func TestChaosKube(t *testing.T) {
	img := harness.NeedKube(t)
	opt := harness.ChaosOptions("")
	opt.Kube = harness.KubeSection(img, "")
	f := harness.NewFleet(t, "chaoskube", opt)
	harness.RunChaos(t, f)
}

// TestChaosAWS is the same for a pool of EC2 instances on the stand-in,
// without the recycling by max_lifetime, which an instance enforces on
// itself as its deadline (a job past it is killed): a manager killed
// between RunInstances and the first describe that lists the instance, or
// while instances end, leaves nothing the next one does not adopt by its
// tags or terminate. It found instances powering themselves off at the
// pool's idle timeout just as Gitea handed them a job, which was lost: an
// instance now waits a minute longer than the manager (aws.IdleGrace).
func TestChaosAWS(t *testing.T) {
	sim := harness.NeedEC2(t)
	opt := harness.ChaosOptions("")
	opt.Extra = "    idle_timeout: 3s\n"
	opt.EC2, opt.AWS = sim, "      instance_types: [t3.medium]\n      spot: true\n      poll_interval: 1s\n"
	f := harness.NewFleet(t, "chaosaws", opt)
	harness.RunChaos(t, f)
}
