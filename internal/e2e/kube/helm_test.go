package kube

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// deploy/helm/runfleet lints clean with Helm's --strict, renders, and
// applies to a real apiserver: two replicas with leader election, the
// config from values (taken by runfleet as it is), the history on a
// claim both replicas mount, the forge token from a Secret, and the least
// RBAC, the same as deploy/kubernetes'.
func TestHelmChart(t *testing.T) {
	harness.NeedKube(t)
	ctx := context.Background()
	helm, err := peers.HelmBinary(ctx, os.Stderr)
	peers.Need(t, "helm "+peers.HelmVersion, err)
	chart := filepath.Join(harness.RepoRoot(), "deploy", "helm", "runfleet")

	lint, err := exec.CommandContext(ctx, helm, "lint", "--strict", chart).CombinedOutput()
	if err != nil || strings.Contains(string(lint), "[WARNING]") || strings.Contains(string(lint), "[ERROR]") {
		t.Fatalf("helm lint --strict: %v\n%s", err, lint)
	}
	t.Logf("helm lint --strict: %s", strings.TrimSpace(string(lint)))
	manifest, err := exec.CommandContext(ctx, helm, "template", "rfchart", chart, "--namespace", harness.KubeNamespace,
		"--set", "image.tag=e2e", "--set", "service.statusPort=9180").Output()
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	t.Logf("helm template: %d objects", strings.Count(string(manifest), "\nkind: "))
	if err := harness.KubeCP.Apply(ctx, manifest); err != nil {
		t.Fatal(err)
	}

	const name = "rfchart-runfleet"
	d, err := harness.KubeCP.Client.AppsV1().Deployments(harness.KubeNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod := d.Spec.Template.Spec
	c := pod.Containers[0]
	if *d.Spec.Replicas != 2 || pod.ServiceAccountName != name || c.Image != "runfleet/runfleet:e2e" {
		t.Errorf("deployment: %d replicas, service account %q, image %q", *d.Spec.Replicas, pod.ServiceAccountName, c.Image)
	}
	// Only the leader is ready: the Service sends webhooks to it alone.
	if rp := c.ReadinessProbe; rp == nil || rp.Exec == nil || !strings.HasSuffix(rp.Exec.Command[len(rp.Exec.Command)-1], "/readyz") {
		t.Errorf("no readiness probe on /readyz: %+v", rp)
	}
	if pod.SecurityContext == nil || pod.SecurityContext.RunAsNonRoot == nil || !*pod.SecurityContext.RunAsNonRoot || c.LivenessProbe == nil {
		t.Error("the pod may run as root, or has no liveness probe on /healthz")
	}
	for _, e := range c.Env {
		if e.Value != "" {
			t.Errorf("env %s has a literal value in the pod spec", e.Name)
		}
	}
	cm, err := harness.KubeCP.Client.CoreV1().ConfigMaps(harness.KubeNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("POD_NAME", name+"-abc")
	t.Setenv("FORGE_TOKEN", "token-from-the-secret")
	cfg, err := config.Parse([]byte(cm.Data["fleet.yaml"]))
	if err != nil {
		t.Fatalf("the chart's fleet.yaml: %v\n%s", err, cm.Data["fleet.yaml"])
	}
	if cfg.LeaderElection == nil || !cfg.LeaderElection.InCluster || cfg.LeaderElection.Identity != name+"-abc" {
		t.Errorf("leader election: %+v", cfg.LeaderElection)
	}
	// The runner pods go to their own namespace.
	if !strings.Contains(string(cfg.Pools[0].Section), `"namespace":"`+harness.KubeRunnerNamespace+`"`) {
		t.Errorf("the pool's pods are not in %s: %s", harness.KubeRunnerNamespace, cfg.Pools[0].Section)
	}
	onClaim := false
	for _, v := range pod.Volumes {
		if v.PersistentVolumeClaim == nil {
			continue
		}
		if _, err := harness.KubeCP.Client.CoreV1().PersistentVolumeClaims(harness.KubeNamespace).Get(ctx, v.PersistentVolumeClaim.ClaimName, metav1.GetOptions{}); err != nil {
			t.Errorf("volume %s: %v", v.Name, err)
		}
		for _, m := range c.VolumeMounts {
			if m.Name == v.Name && strings.HasPrefix(cfg.History.Path, m.MountPath+"/") {
				onClaim = true
			}
		}
	}
	if !onClaim {
		t.Errorf("history.path %s is on no claim the replicas mount", cfg.History.Path)
	}
	checkLeastRBAC(ctx, t, name)
}
