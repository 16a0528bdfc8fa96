package harness

import (
	"bytes"
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/gcesim"
)

// GCEImage is the stand-in's source image for the instance image.
const GCEImage = "projects/" + gcesim.Project + "/global/images/runfleet-e2e"

// NeedGCE starts a Compute Engine stand-in whose instances boot the
// instance image as containers on the local engine. Without Docker the
// test is skipped, or fails in CI.
func NeedGCE(t testing.TB) *gcesim.Server {
	t.Helper()
	image := needInstanceImage(t)
	sim, err := gcesim.New(gcesim.Options{Docker: DockerCli})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(GCEImage, image)
	return sim
}

// GCPSection is a pool's provider and gcp section on the stand-in.
func GCPSection(sim *gcesim.Server, extra string) string {
	if !strings.Contains(extra, "poll_interval:") {
		extra = "      poll_interval: 2s\n" + extra
	}
	if !strings.Contains(extra, "zones:") {
		extra = "      zones: [us-central1-a]\n" + extra
	}
	if !strings.Contains(extra, "machine_types:") {
		extra = "      machine_types: [n1-standard-4]\n" + extra
	}
	return "    provider: gcp\n    gcp:\n      endpoint: " + sim.URL + "\n      billing_endpoint: " + sim.URL + "\n      image: " + GCEImage + "\n" + extra
}

// GCPEnv is the manager's Google environment: the stand-in's service
// account key in CML's variable, no other credentials.
func GCPEnv(sim *gcesim.Server) []string {
	return []string{"GOOGLE_APPLICATION_CREDENTIALS_DATA=" + string(sim.Credentials()), "GOOGLE_APPLICATION_CREDENTIALS=", "CLOUDSDK_CONFIG=/nonexistent", "GCE_METADATA_HOST=127.0.0.1:1"}
}

// LiveGCE counts the instances not deleted and not stopped.
func (f *Fleet) LiveGCE() int {
	n := 0
	for _, in := range f.GCE.Instances() {
		if in.Deleted.IsZero() && in.Status != "TERMINATED" {
			n++
		}
	}
	return n
}

// GCELeavesNothing checks that every instance and disk was deleted and
// every instance's container is gone.
func (f *Fleet) GCELeavesNothing() {
	f.T.Helper()
	Eventually(f.T, time.Minute, "every instance and disk deleted", func() bool {
		for _, in := range f.GCE.Instances() {
			if in.Deleted.IsZero() {
				return false
			}
		}
		return len(f.GCE.Disks()) == 0
	})
	if DockerCli == nil {
		return // instances that boot nothing
	}
	for _, in := range f.GCE.Instances() {
		_, err := DockerCli.ContainerInspect(context.Background(), "gcesim-"+in.Zone+"-"+in.Name, client.ContainerInspectOptions{})
		if !cerrdefs.IsNotFound(err) {
			f.T.Errorf("instance %s's container is still there (%v)", in.Name, err)
		}
	}
}

// CheckNoSecretOnGCE looks for the forge token and the service account's
// key in every instance's metadata and labels, and, inside every running
// one, in every process's environment and arguments and in every file.
func (f *Fleet) CheckNoSecretOnGCE() {
	t := f.T
	t.Helper()
	key := f.GCE.Credentials()
	secrets := []string{Gitea.Token, f.GCE.PrivateKeyID(), string(key[bytes.Index(key, []byte("MII")):][:64])}
	checked := 0
	for _, in := range f.GCE.Instances() {
		var public bytes.Buffer
		for k, v := range in.Metadata {
			public.WriteString(k + "=" + v + "\n")
		}
		for k, v := range in.Labels {
			public.WriteString(k + "=" + v + "\n")
		}
		for _, s := range secrets {
			if strings.Contains(public.String(), s) {
				t.Errorf("instance %s's metadata or labels hold a long-lived secret", in.Name)
			}
		}
		if !in.Deleted.IsZero() || in.Status != "RUNNING" {
			continue
		}
		checkInside(t, "instance "+in.Name, "gcesim-"+in.Zone+"-"+in.Name, secrets...)
		checked++
	}
	if checked == 0 {
		t.Error("no running instance to check")
	}
	t.Logf("checked %d instances (metadata, labels, processes, files): no long-lived secret", checked)
}

// GCPHandoff is what a pool needs for its instances to claim their
// assignment from the manager: the manager's webhook listener on Docker's
// bridge, where the instances' containers reach it (Top), and the pool's
// service account, handoff_url and the stand-in's keys as Google's (for
// GCPSection's extra).
func GCPHandoff(t testing.TB, sim *gcesim.Server) (top, section string) {
	t.Helper()
	addr := bridgeListen(t)
	return "listen: " + addr + "\n", "      service_account: runner@" + gcesim.Project + ".iam.gserviceaccount.com\n" +
		"      handoff_url: http://" + addr + "\n      identity_certs: " + sim.CertsURL() + "\n"
}

// CheckCredentialClaimedOnce checks the handoff of a pool with
// handoff_url on its running instances (checkClaimed), a job step's second
// claim made with an identity token from the instance's metadata server.
func (f *Fleet) CheckCredentialClaimedOnce(workdir string) {
	f.T.Helper()
	if f.GCE.Identities() == 0 {
		f.T.Fatal("no instance asked for its identity token: none claimed its assignment")
	}
	checked := 0
	for _, in := range f.GCE.Instances() {
		if !in.Deleted.IsZero() || in.Status != "RUNNING" {
			continue
		}
		var public strings.Builder
		for k, v := range in.Metadata {
			public.WriteString(k + "=" + v + "\n")
		}
		checkClaimed(f.T, "instance "+in.Name, "gcesim-"+in.Zone+"-"+in.Name, workdir, public.String(), in.Metadata["startup-script"],
			f.GCE.MetadataHandler(in.Name), func(ctx context.Context, md, aud string) (string, error) {
				return getMetadata(ctx, md, "computeMetadata/v1/instance/service-accounts/default/identity?format=full&audience="+url.QueryEscape(aud), "Metadata-Flavor", "Google")
			})
		checked++
	}
	if checked == 0 {
		f.T.Fatal("no running instance to look inside")
	}
	f.T.Logf("checked %d instances: each runner's credential in no metadata or process, a second claim refused (%d identity tokens asked for)", checked, f.GCE.Identities())
}
