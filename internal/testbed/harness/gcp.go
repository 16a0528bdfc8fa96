package harness

import (
	"bytes"
	"context"
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
	return "    provider: gcp\n    gcp:\n      endpoint: " + sim.URL + "\n      image: " + GCEImage + "\n" + extra
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
