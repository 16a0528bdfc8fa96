package chaoscloud

import (
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// TestChaosKube and TestChaosAWS are internal/e2e/chaos's test for the
// pools of CML's clouds (--cloud=kubernetes, --cloud=aws), in a package of
// their own so that no two of them run at once, while the host providers'
// run beside them. A cloud provider added later adds itself here.
//
// TestChaosKube: a pool of pods, where a manager killed between
// creating a pod and its Secret, or while pods end and are deleted, leaves
// nothing that the next one does not adopt or remove. Its idle pods are
// recycled every 30 s, not 10: a pod takes longer to come up than a
// process or a container (scheduler, node, Secret, container), and with
// the packages beside it starting at once it took over 10 s, so a pool
// recycling at 10 s never had its 4 runners ready together.
func TestChaosKube(t *testing.T) {
	img := harness.NeedKube(t)
	opt := harness.ChaosOptions("")
	opt.Extra = "    idle_timeout: 3s\n    max_lifetime: 30s\n"
	opt.Kube = harness.KubeSection(img, "")
	f := harness.NewFleet(t, "chaoskube", opt)
	harness.RunChaos(t, f)
}

// TestChaosAWS: a pool of EC2 instances on the stand-in,
// without the recycling by max_lifetime, which an instance enforces on
// itself as its deadline (a job past it is killed): a manager killed
// between RunInstances and the first describe that lists the instance, or
// while instances end, leaves nothing the next one does not adopt by its
// tags or terminate. It found instances powering themselves off at the
// pool's idle timeout just as Gitea handed them a job, which was lost: an
// instance now waits a minute longer than the manager (vm.IdleGrace).
func TestChaosAWS(t *testing.T) {
	sim := harness.NeedEC2(t)
	opt := harness.ChaosOptions("")
	opt.Extra = "    idle_timeout: 3s\n"
	opt.EC2, opt.AWS = sim, "      instance_types: [t3.medium]\n      spot: true\n      poll_interval: 1s\n"
	f := harness.NewFleet(t, "chaosaws", opt)
	harness.RunChaos(t, f)
}

// TestChaosGCP: a pool of Compute Engine instances on the stand-in, as
// TestChaosAWS: a manager killed between an insert and the listing that
// shows it, or while instances stop, leaves nothing the next one does not
// adopt by its labels or delete, disks included.
func TestChaosGCP(t *testing.T) {
	sim := harness.NeedGCE(t)
	opt := harness.ChaosOptions("")
	opt.Extra = "    idle_timeout: 3s\n"
	opt.GCE, opt.GCP = sim, "      spot: true\n      poll_interval: 1s\n"
	f := harness.NewFleet(t, "chaosgcp", opt)
	harness.RunChaos(t, f)
}

// TestChaosAzureVM: a pool of Azure VMs on the stand-in, as
// TestChaosAWS: a manager killed while a VM is made (its operation
// polled) or while VMs stop leaves nothing the next one does not adopt by
// its tags or delete, NICs, addresses and disks included.
func TestChaosAzureVM(t *testing.T) {
	sim := harness.NeedARM(t)
	opt := harness.ChaosOptions("")
	opt.Extra = "    idle_timeout: 3s\n"
	opt.ARM, opt.Azure = sim, "      spot: true\n      poll_interval: 1s\n"
	f := harness.NewFleet(t, "chaosazvm", opt)
	harness.RunChaos(t, f)
}
