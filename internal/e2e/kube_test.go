package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	k8s "k8s.io/client-go/kubernetes"

	"github.com/runfleet/runfleet/forge"
	giteadrv "github.com/runfleet/runfleet/forge/gitea"
	"github.com/runfleet/runfleet/provider"
	kube "github.com/runfleet/runfleet/provider/kubernetes"
)

// A pool of 2 pods runs an 8-job matrix: each job on its own registration
// in its own pod, none seeing what an earlier job wrote, the dataset
// read-only. Afterwards 2 idle pods; after SIGTERM no pod, Secret or
// registration; the forge token in no pod spec, Secret or log.
func TestKubePodsRunJobs(t *testing.T) {
	img := needKube(t)
	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "hello.txt"), []byte("dataset-content\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(data, 0o777)
	f := newFleet(t, "kpods", fleetOptions{Size: 2, Kube: kubeSection(img, fmt.Sprintf("      volumes: [\"%s:/data\"]\n", data))})
	f.start()
	eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.idleOnline() == 2 })
	pods := f.pods()
	if len(pods) != 2 {
		t.Fatalf("%d pods, want 2", len(pods))
	}
	p := pods[0]
	if p.Spec.RestartPolicy != corev1.RestartPolicyNever || p.Labels[kube.LabelManager] != "e2e-kpods" || p.Labels[kube.LabelPool] != "kpods" ||
		!regexp.MustCompile(`^kpods-[12]$`).MatchString(p.Labels[kube.LabelRunner]) {
		t.Errorf("pod %s: restart policy %s, labels %v", p.Name, p.Spec.RestartPolicy, p.Labels)
	}

	f.push(matrix("kpods", 8, `echo "pod=$(hostname)"
test ! -e /tmp/left-by-earlier-job
test ! -e "$HOME/left-by-earlier-job"
touch /tmp/left-by-earlier-job "$HOME/left-by-earlier-job"
cat /data/hello.txt
if touch /data/written-by-job 2>/dev/null; then echo "dataset is writable"; exit 1; fi
echo "dataset is read-only"`))
	jobs := f.waitJobs(8, 4*time.Minute)
	regs, podsSeen := map[int64]string{}, map[string]string{}
	podRE := regexp.MustCompile(`pod=(e2e-kpods-kpods-\d+-[a-z0-9]{5})`)
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
		if prev, dup := regs[j.RunnerID]; dup {
			t.Errorf("jobs %s and %s ran on the same registration %d", prev, j.Name, j.RunnerID)
		}
		regs[j.RunnerID] = j.Name
		logs, _, err := f.client().GetRepoActionJobLogs(gitea.User, f.repo, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		m := podRE.FindStringSubmatch(string(logs))
		if m == nil || !strings.Contains(string(logs), "dataset-content") || !strings.Contains(string(logs), "dataset is read-only") {
			t.Errorf("job %s log lacks its pod, the dataset or the read-only check:\n%s", j.Name, logs)
			continue
		}
		if prev, dup := podsSeen[m[1]]; dup {
			t.Errorf("jobs %s and %s ran in the same pod %s", prev, j.Name, m[1])
		}
		podsSeen[m[1]] = j.Name
	}
	t.Logf("8 jobs ran on %d registrations in %d distinct pods", len(regs), len(podsSeen))
	if len(regs) != 8 || len(podsSeen) != 8 {
		t.Errorf("8 jobs on %d registrations in %d pods, want 8 and 8", len(regs), len(podsSeen))
	}
	if _, err := os.Stat(filepath.Join(data, "written-by-job")); err == nil {
		t.Error("a job wrote to the dataset")
	}
	eventually(t, time.Minute, "2 idle registrations, 2 pods", func() bool {
		return len(f.runners()) == 2 && f.idleOnline() == 2 && f.livePods() == 2 && len(f.pods()) == 2
	})
	f.checkNoTokenInCluster()
	if b, _ := os.ReadFile(f.logPath); strings.Contains(string(b), gitea.Token) {
		t.Error("the manager's log shows the forge token")
	}
	f.stopLeavesNothing()
}

// Kill -9 the manager while two jobs run in pods: a restarted manager
// adopts the pods by label (the jobs finish in them), removes a pod
// without a registration and a registration without a pod, and brings the
// pool back to 2 idle pods without a duplicate.
func TestKubeCrashAdopts(t *testing.T) {
	img := needKube(t)
	f := newFleet(t, "kcrash", fleetOptions{Size: 2, Max: 3, Kube: kubeSection(img, "")})
	f.start()
	eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.idleOnline() == 2 })
	f.push(matrix("kcrash", 2, "sleep 15\necho done"))
	f.waitInProgress(2)
	f.kill9()
	before := map[string]string{} // pod uid -> runner
	for _, p := range f.pods() {
		if p.Status.Phase == corev1.PodRunning {
			before[string(p.UID)] = p.Labels[kube.LabelRunner]
		}
	}
	if len(before) < 2 {
		t.Fatalf("pods ended with the manager: %v", before)
	}

	// What a crash could leave: a pod of this manager without a
	// registration, and a registration without a pod.
	cs, err := k8s.NewForConfig(kubeCP.Config)
	if err != nil {
		t.Fatal(err)
	}
	prov, err := kube.New(kube.Options{Client: cs, Namespace: kubeNamespace, Manager: "e2e-kcrash", Pool: "kcrash",
		Section: kube.Section{Image: img, Workdir: "/runner", NodeSelector: map[string]string{kubeNodeLabel: "docker"}}})
	if err != nil {
		t.Fatal(err)
	}
	orphan, err := prov.Create(context.Background(), provider.Spec{
		Name: "kcrash-9", Manager: "e2e-kcrash", Pool: "kcrash", Command: "sleep", Args: []string{"600"},
	})
	prov.Close()
	if err != nil {
		t.Fatal(err)
	}
	drv := giteadrv.New(giteadrv.Config{URL: gitea.URL, Token: gitea.Token,
		Scope: giteadrv.Scope{Kind: "repo", Owner: gitea.User, Repo: f.repo}})
	stray, err := drv.Register(context.Background(), forge.RunnerRequest{Name: "kcrash-7", Labels: []string{"kcrash"}})
	if err != nil {
		t.Fatal(err)
	}

	f.start()
	jobs := f.waitJobs(2, 2*time.Minute)
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	maxSeen := 0
	eventually(t, time.Minute, "the pool back at 2 idle pods, no orphan, no duplicate", func() bool {
		live := map[string]int{}
		for _, p := range f.pods() {
			if p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed && string(p.UID) != orphan.ID {
				live[p.Labels[kube.LabelRunner]]++
			}
		}
		n := 0
		for runner, c := range live {
			if c > 1 {
				t.Errorf("%d live pods for %s", c, runner)
			}
			n += c
		}
		maxSeen = max(maxSeen, n)
		for _, r := range f.runners() {
			if r.ID == stray.RunnerID {
				return false
			}
		}
		for _, p := range f.pods() {
			if string(p.UID) == orphan.ID {
				return false
			}
		}
		return len(f.runners()) == 2 && f.idleOnline() == 2 && n == 2 && len(f.pods()) == 2
	})
	if maxSeen > 3 {
		t.Errorf("saw %d live runner pods, more than max 3", maxSeen)
	}
	// The busy pods were adopted: each job ran on its first pod.
	for _, j := range jobs {
		logs, _, _ := f.client().GetRepoActionJobLogs(gitea.User, f.repo, j.ID)
		if !strings.Contains(string(logs), "done") {
			t.Errorf("job %s did not finish its script:\n%s", j.Name, logs)
		}
	}
	f.stopLeavesNothing()
}
