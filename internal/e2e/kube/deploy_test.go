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
	if cfg.LeaderElection == nil || !cfg.LeaderElection.InCluster || cfg.LeaderElection.Identity != "runfleet-abc" || cfg.Pools[0].Provider != "kubernetes" ||
		!strings.Contains(string(cfg.Pools[0].Section), `"namespace":"`+harness.KubeRunnerNamespace+`"`) {
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
// a manager needs, in its namespace (its Lease) and in its runners' (their
// pods and Secrets), and nothing more: no pod or Secret of its own
// namespace, no Secret's value.
func checkLeastRBAC(ctx context.Context, t *testing.T, account string) {
	t.Helper()
	sa := "system:serviceaccount:" + harness.KubeNamespace + ":" + account
	const mine, runners = harness.KubeNamespace, harness.KubeRunnerNamespace
	for _, c := range []struct {
		ns, group, resource, sub, verb string
		allowed                        bool
	}{
		{runners, "", "pods", "", "create", true}, {runners, "", "pods", "", "watch", true}, {runners, "", "pods", "", "delete", true},
		{runners, "", "pods", "log", "get", true}, {runners, "", "secrets", "", "create", true}, {runners, "", "secrets", "", "delete", true},
		{runners, "", "events", "", "create", true},
		{mine, "coordination.k8s.io", "leases", "", "update", true}, {mine, "", "events", "", "create", true},
		{runners, "", "secrets", "", "get", false}, {runners, "", "secrets", "", "watch", false}, {runners, "", "pods", "", "update", false},
		{runners, "", "pods", "exec", "create", false}, {runners, "coordination.k8s.io", "leases", "", "update", false},
		{mine, "", "pods", "", "create", false}, {mine, "", "secrets", "", "create", false}, {mine, "", "secrets", "", "list", false},
		{mine, "", "configmaps", "", "update", false}, {mine, "apps", "deployments", "", "create", false},
		{mine, "", "serviceaccounts", "token", "create", false},
		{"default", "", "pods", "", "create", false},
		// Nodes: get alone, for a record's node system.
		{"", "", "nodes", "", "get", true}, {"", "", "nodes", "", "list", false}, {"", "", "nodes", "", "watch", false},
		{"", "", "nodes", "", "update", false}, {"", "", "nodes", "proxy", "get", false},
	} {
		r, err := harness.KubeCP.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
			User: sa, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + harness.KubeNamespace},
			ResourceAttributes: &authzv1.ResourceAttributes{Namespace: c.ns, Group: c.group, Resource: c.resource, Subresource: c.sub, Verb: c.verb},
		}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Allowed != c.allowed {
			t.Errorf("%s: %s %s/%s %s: allowed %v, want %v", c.ns, c.verb, c.resource, c.sub, c.group, r.Status.Allowed, c.allowed)
		}
	}
}
