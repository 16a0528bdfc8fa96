package kube

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	authzv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// deploy/kubernetes applies to a real apiserver as it is; its config is
// one runfleet takes; and its service account may do what a manager needs
// (every Kubernetes end-to-end test acts as it) and nothing more.
func TestDeployManifests(t *testing.T) {
	harness.NeedKube(t)
	ctx := context.Background()
	dir := filepath.Join(harness.RepoRoot(), "deploy", "kubernetes")
	files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if len(files) < 4 {
		t.Fatalf("deploy/kubernetes has %d manifests", len(files))
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := harness.KubeCP.Apply(ctx, b); err != nil {
			t.Fatalf("%s: %v", filepath.Base(f), err)
		}
	}
	d, err := harness.KubeCP.Client.AppsV1().Deployments(harness.KubeNamespace).Get(ctx, "runfleet", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if *d.Spec.Replicas != 2 || d.Spec.Template.Spec.ServiceAccountName != "runfleet" {
		t.Errorf("deployment: %d replicas, service account %q", *d.Spec.Replicas, d.Spec.Template.Spec.ServiceAccountName)
	}
	// Only the leader is ready: the Service sends webhooks to it alone.
	if rp := d.Spec.Template.Spec.Containers[0].ReadinessProbe; rp == nil || rp.Exec == nil || !strings.HasSuffix(rp.Exec.Command[len(rp.Exec.Command)-1], "/readyz") {
		t.Errorf("no readiness probe on /readyz: %+v", rp)
	}
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		if e.Value != "" {
			t.Errorf("env %s has a literal value in the pod spec", e.Name)
		}
	}

	cm, err := harness.KubeCP.Client.CoreV1().ConfigMaps(harness.KubeNamespace).Get(ctx, "runfleet", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("POD_NAME", "runfleet-abc")
	t.Setenv("FORGE_TOKEN", "token-from-the-secret")
	cfg, err := config.Parse([]byte(cm.Data["fleet.yaml"]))
	if err != nil {
		t.Fatalf("the ConfigMap's fleet.yaml: %v", err)
	}
	if cfg.LeaderElection == nil || !cfg.LeaderElection.InCluster || cfg.LeaderElection.Identity != "runfleet-abc" || cfg.Pools[0].Provider != "kubernetes" {
		t.Errorf("config: %+v", cfg)
	}
	// The history lives on the claim both replicas mount, not on a pod's
	// own emptyDir: a failover loses none of it.
	onClaim := false
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.PersistentVolumeClaim == nil {
			continue
		}
		if _, err := harness.KubeCP.Client.CoreV1().PersistentVolumeClaims(harness.KubeNamespace).Get(ctx, v.PersistentVolumeClaim.ClaimName, metav1.GetOptions{}); err != nil {
			t.Errorf("volume %s: %v", v.Name, err)
		}
		for _, m := range d.Spec.Template.Spec.Containers[0].VolumeMounts {
			if m.Name == v.Name && strings.HasPrefix(cfg.History.Path, m.MountPath+"/") {
				onClaim = true
			}
		}
	}
	if !onClaim {
		t.Errorf("history.path %s is on no PersistentVolumeClaim the replicas mount", cfg.History.Path)
	}

	checkLeastRBAC(ctx, t, "runfleet")
}

// checkLeastRBAC asks the apiserver what the service account may do: what
// a manager needs in its namespace, and nothing more.
func checkLeastRBAC(ctx context.Context, t *testing.T, account string) {
	t.Helper()
	sa := "system:serviceaccount:" + harness.KubeNamespace + ":" + account
	for _, c := range []struct {
		group, resource, sub, verb string
		allowed                    bool
	}{
		{"", "pods", "", "create", true}, {"", "pods", "", "watch", true}, {"", "pods", "", "delete", true},
		{"", "pods", "log", "get", true}, {"", "secrets", "", "create", true}, {"", "secrets", "", "delete", true},
		{"coordination.k8s.io", "leases", "", "update", true}, {"", "events", "", "create", true},
		{"", "secrets", "", "get", false}, {"", "secrets", "", "watch", false}, {"", "pods", "", "update", false},
		{"", "pods", "exec", "create", false}, {"", "configmaps", "", "update", false},
		{"apps", "deployments", "", "create", false}, {"", "serviceaccounts", "token", "create", false},
	} {
		r, err := harness.KubeCP.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
			User: sa, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + harness.KubeNamespace},
			ResourceAttributes: &authzv1.ResourceAttributes{Namespace: harness.KubeNamespace, Group: c.group, Resource: c.resource, Subresource: c.sub, Verb: c.verb},
		}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Allowed != c.allowed {
			t.Errorf("%s %s/%s %s: allowed %v, want %v", c.verb, c.resource, c.sub, c.group, r.Status.Allowed, c.allowed)
		}
	}
	// Nothing cluster-wide, nor in another namespace.
	r, err := harness.KubeCP.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
		User: sa, ResourceAttributes: &authzv1.ResourceAttributes{Namespace: "default", Resource: "pods", Verb: "create"},
	}}, metav1.CreateOptions{})
	if err != nil || r.Status.Allowed {
		t.Errorf("creating pods in default: %v %v", r.Status.Allowed, err)
	}
}
