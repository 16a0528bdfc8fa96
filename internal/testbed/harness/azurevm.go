package harness

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/provider/azure"
)

// ARMImage is the stand-in's image (a marketplace URN) for the instance
// image.
const ARMImage = "runfleet:e2e-instance:runner:1.0.0"

// NeedARM starts an Azure stand-in whose VMs boot the instance image as
// containers on the local engine. Without Docker the test is skipped, or
// fails in CI. Its VMs' Scheduled Events answer 3 s after their first
// call, not Azure's up to two minutes (armsim's default, 90 s), which
// every runner's agent waits for before it starts: a test's fleets would
// each start a minute and a half late. NeedARMAsAzure keeps the default.
func NeedARM(t testing.TB) *armsim.Server {
	t.Helper()
	return needARM(t, armsim.Options{EventsDelay: 3 * time.Second})
}

// NeedARMAsAzure is NeedARM with Scheduled Events as slow to enable as
// Azure may be (armsim's default).
func NeedARMAsAzure(t testing.TB) *armsim.Server {
	t.Helper()
	return needARM(t, armsim.Options{})
}

func needARM(t testing.TB, o armsim.Options) *armsim.Server {
	t.Helper()
	image := needInstanceImage(t) // DockerCli too
	o.Docker = DockerCli
	sim, err := armsim.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(ARMImage, image)
	return sim
}

// AzureVMSection is a pool's provider and azure section on the
// stand-in.
func AzureVMSection(sim *armsim.Server, extra string) string {
	if !strings.Contains(extra, "poll_interval:") {
		extra = "      poll_interval: 2s\n" + extra
	}
	if !strings.Contains(extra, "locations:") {
		extra = "      locations: [eastus]\n" + extra
	}
	if !strings.Contains(extra, "vm_sizes:") {
		extra = "      vm_sizes: [Standard_D4s_v5]\n" + extra
	}
	subnets := "      subnets:\n"
	for _, l := range armsim.Locations {
		subnets += "        " + l + ": " + armsim.SubnetID(l) + "\n"
	}
	return "    provider: azure\n    azure:\n      endpoint: " + sim.URL + "\n      retail_prices_url: " + sim.URL + "/api/retail/prices\n      resource_group: " + armsim.Group +
		"\n      image: " + ARMImage + "\n" + subnets + extra
}

// LiveAzureVMs counts the VMs not deleted and not stopped.
func (f *Fleet) LiveAzureVMs() int {
	n := 0
	for _, v := range f.ARM.VMs() {
		if v.Deleted.IsZero() && v.Power != "stopped" && v.Provisioning != "Failed" {
			n++
		}
	}
	return n
}

// AzureLeavesNothing checks that every VM, NIC, public address and disk
// was deleted and every VM's container is gone.
func (f *Fleet) AzureLeavesNothing() {
	f.T.Helper()
	Eventually(f.T, time.Minute, "every VM, NIC, public address and disk deleted", func() bool {
		for _, v := range f.ARM.VMs() {
			if v.Deleted.IsZero() {
				return false
			}
		}
		return len(f.ARM.Leftovers()) == 0
	})
	if DockerCli == nil {
		return
	}
	for _, v := range f.ARM.VMs() {
		_, err := DockerCli.ContainerInspect(context.Background(), "armsim-"+v.Group+"-"+v.Name, client.ContainerInspectOptions{})
		if !cerrdefs.IsNotFound(err) {
			f.T.Errorf("VM %s's container is still there (%v)", v.Name, err)
		}
	}
}

// CheckNoSecretOnAzure looks for the forge token and the service
// principal's secret in every VM's custom data and tags, and, inside
// every running one, in every process's environment and arguments and in
// every file.
func (f *Fleet) CheckNoSecretOnAzure() {
	t := f.T
	t.Helper()
	secrets := []string{Gitea.Token, f.ARM.Secret()}
	checked := 0
	for _, v := range f.ARM.VMs() {
		var public bytes.Buffer
		public.WriteString(v.CustomData)
		for k, val := range v.Tags {
			public.WriteString(k + "=" + val + "\n")
		}
		for _, s := range secrets {
			if strings.Contains(public.String(), s) {
				t.Errorf("VM %s's custom data or tags hold a long-lived secret", v.Name)
			}
		}
		if !v.Deleted.IsZero() || v.Power != "running" {
			continue
		}
		checkInside(t, "VM "+v.Name, "armsim-"+v.Group+"-"+v.Name, secrets...)
		checked++
	}
	if checked == 0 {
		t.Error("no running VM to check")
	}
	t.Logf("checked %d VMs (custom data, tags, processes, files): no long-lived secret", checked)
}

// AzureHandoff is what a pool needs for its VMs to claim their assignment
// from the manager: the manager's webhook listener on Docker's bridge,
// where the VMs' containers reach it (Top), and the pool's handoff_url and
// the stand-in's root as Microsoft's (for AzureVMSection's extra).
func AzureHandoff(t testing.TB, sim *armsim.Server) (top, section string) {
	t.Helper()
	addr := bridgeListen(t)
	return "listen: " + addr + "\n", "      handoff_url: http://" + addr + "\n      attested_roots: " + sim.AttestedRoots() + "\n"
}

// CheckCredentialClaimedOnceAzure checks the handoff of a pool with
// handoff_url on its running VMs (checkClaimed), a job step's second claim
// made with attested data from the VM's metadata service.
func (f *Fleet) CheckCredentialClaimedOnceAzure(workdir string) {
	f.T.Helper()
	if f.ARM.Attestations() == 0 {
		f.T.Fatal("no VM asked for its attested data: none claimed its assignment")
	}
	checked := 0
	for _, v := range f.ARM.VMs() {
		if !v.Deleted.IsZero() || v.Power != "running" {
			continue
		}
		checkClaimed(f.T, "VM "+v.Name, "armsim-"+v.Group+"-"+v.Name, workdir, v.CustomData, v.CustomData, f.ARM.IMDSHandler(v.Name),
			func(ctx context.Context, md, aud string) (string, error) {
				return getMetadata(ctx, md, "metadata/attested/document?api-version="+azure.AttestedVersion+"&nonce="+azure.Nonce(aud), "Metadata", "true")
			})
		checked++
	}
	if checked == 0 {
		f.T.Fatal("no running VM to look inside")
	}
	f.T.Logf("checked %d VMs: each runner's credential in no custom data or process, a second claim refused (%d attested documents asked for)", checked, f.ARM.Attestations())
}
