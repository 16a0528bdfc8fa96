package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/kubeclient"
	"github.com/runfleet/runfleet/provider"
	kube "github.com/runfleet/runfleet/provider/kubernetes"
	"github.com/runfleet/runfleet/record"
)

// A pool of 2 pods runs an 8-job matrix: each job on its own registration
// in its own pod, none seeing what an earlier job wrote, the dataset
// read-only. Afterwards 2 idle pods; after SIGTERM no pod, Secret or
// registration; the forge token in no pod spec, Secret or log.
func TestKubePodsRunJobs(t *testing.T) {
	img := harness.NeedKube(t)
	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "hello.txt"), []byte("dataset-content\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(data, 0o777)
	f := harness.NewFleet(t, "kpods", harness.FleetOptions{Size: 2, Kube: harness.KubeSection(img, fmt.Sprintf("      volumes: [\"%s:/data\"]\n", data))})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	pods := f.Pods()
	if len(pods) != 2 {
		t.Fatalf("%d pods, want 2", len(pods))
	}
	p := pods[0]
	if p.Spec.RestartPolicy != corev1.RestartPolicyNever || p.Labels[kube.LabelManager] != "e2e-kpods" || p.Labels[kube.LabelPool] != "kpods" ||
		!regexp.MustCompile(`^kpods-[12]$`).MatchString(p.Labels[kube.LabelRunner]) {
		t.Errorf("pod %s: restart policy %s, labels %v", p.Name, p.Spec.RestartPolicy, p.Labels)
	}

	f.Push(harness.Matrix("kpods", 8, harness.FreshJob+"\n"+harness.RecordJob))
	jobs := f.WaitJobs(8, 4*time.Minute)
	f.CheckFresh(jobs, regexp.MustCompile(`host=(e2e-kpods-kpods-\d+-[a-z0-9]{5})`), data)
	f.CheckRecords(jobs, func(printed, kept record.Record) {
		m, k := printed.Machine, kept.Machine
		if m.Node != harness.KubeNode || m.Image != img || len(m.Datasets) != 1 || !m.Datasets[0].ReadOnly || printed.Provider != "kubernetes" ||
			k.Node != m.Node || !strings.HasPrefix(k.ID, "e2e-kpods-"+printed.Runner+"-") || !strings.HasPrefix(k.ImageDigest, "sha256:") {
			t.Errorf("pod records: the job's %+v, the history's %+v", m, k)
		}
		// The node's system, as its kubelet reports it.
		if s := kept.System; s == nil || s.OS == "" || s.Kernel == "" || s.Runtime == "" || s.CPUs == 0 || s.MemoryMiB == 0 {
			t.Errorf("the history's record of %s keeps no system of node %s: %+v", kept.Runner, k.Node, s)
		}
	})
	harness.Eventually(t, time.Minute, "2 idle registrations, 2 pods", func() bool {
		return len(f.Runners()) == 2 && f.IdleOnline() == 2 && f.LivePods() == 2 && len(f.Pods()) == 2
	})
	f.CheckNoTokenInCluster()
	if b, _ := os.ReadFile(f.LogPath); strings.Contains(string(b), harness.Gitea.Token) {
		t.Error("the manager's log shows the forge token")
	}
	f.StopLeavesNothing()
}

// A pod may take a job just before the pool replaces it for its age
// (max_lifetime), or after, while no manager is up to replace it; the
// job must not die with it. TestChaosKube lost jobs that way while a
// pod's activeDeadlineSeconds was max_lifetime itself (the runner is
// killed 10 s after its deadline, its grace period): here every job runs
// for longer than both, so a deadline that short fails them all.
func TestKubeJobOutlivesMaxLifetime(t *testing.T) {
	img := harness.NeedKube(t)
	f := harness.NewFleet(t, "klife", harness.FleetOptions{Size: 1, Max: 2, Extra: "    max_lifetime: 3s\n", Kube: harness.KubeSection(img, "")})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "an idle runner", func() bool { return f.IdleOnline() >= 1 })
	f.Push(harness.Matrix("klife", 2, "sleep 16\necho done"))
	harness.CheckJobs(t, f.WaitJobs(2, 3*time.Minute))
	f.StopLeavesNothing()
}

// Kill -9 the manager while two jobs run in pods: a restarted manager
// adopts the pods by label (the jobs finish in them), removes a pod
// without a registration and a registration without a pod, and brings the
// pool back to 2 idle pods without a duplicate.
func TestKubeCrashAdopts(t *testing.T) {
	img := harness.NeedKube(t)
	f := harness.NewFleet(t, "kcrash", harness.FleetOptions{Size: 2, Max: 3, Kube: harness.KubeSection(img, "")})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("kcrash", 2, "sleep 15\necho done"))
	f.WaitInProgress(2)
	f.Kill9()
	before := map[string]string{} // pod uid -> runner
	for _, p := range f.Pods() {
		if p.Status.Phase == corev1.PodRunning {
			before[string(p.UID)] = p.Labels[kube.LabelRunner]
		}
	}
	if len(before) < 2 {
		t.Fatalf("pods ended with the manager: %v", before)
	}

	// What a crash could leave: a pod of this manager without a
	// registration, and a registration without a pod.
	cs, err := kubeclient.New(harness.KubeCP.Config)
	if err != nil {
		t.Fatal(err)
	}
	prov, err := kube.New(kube.Options{Client: cs, Namespace: harness.KubeRunnerNamespace, Manager: "e2e-kcrash", Pool: "kcrash",
		Section: kube.Section{Image: img, Workdir: "/runner", NodeSelector: map[string]string{harness.KubeNodeLabel: "docker"}}})
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
	drv := f.Driver()
	stray, err := drv.Register(context.Background(), forge.RunnerRequest{Name: "kcrash-7", Labels: []string{"kcrash"}})
	if err != nil {
		t.Fatal(err)
	}

	f.Start()
	jobs := f.WaitJobs(2, 2*time.Minute)
	harness.CheckJobs(t, jobs)
	maxSeen := 0
	harness.Eventually(t, time.Minute, "the pool back at 2 idle pods, no orphan, no duplicate", func() bool {
		live := map[string]int{}
		for _, p := range f.Pods() {
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
		for _, r := range f.Runners() {
			if r.ID == stray.RunnerID {
				return false
			}
		}
		for _, p := range f.Pods() {
			if string(p.UID) == orphan.ID {
				return false
			}
		}
		return len(f.Runners()) == 2 && f.IdleOnline() == 2 && n == 2 && len(f.Pods()) == 2
	})
	if maxSeen > 3 {
		t.Errorf("saw %d live runner pods, more than max 3", maxSeen)
	}
	// The busy pods were adopted: each job ran on its first pod.
	for _, j := range jobs {
		logs, _, _ := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, j.ID)
		if !strings.Contains(string(logs), "done") {
			t.Errorf("job %s did not finish its script:\n%s", j.Name, logs)
		}
	}
	f.StopLeavesNothing()
}

// A pod that no node can take stays Pending, with the scheduler's reason
// in `runfleet status`, on the status page and in the log: it holds its
// slot and its registration well past bootstrap_timeout (a cluster
// autoscaler takes minutes to add a GPU node), and once a node that fits
// appears, it runs the job queued meanwhile, with one registration in
// all. bootstrap_timeout is 15s here so that waiting 45 s, three times
// over, stands for the 5 minutes a node takes (with the default 2m, the
// wait would have to last 6 minutes); pending_timeout keeps its default.
// 15 s, not less: once the node appears, the pod's start and its agent's
// registration took more than 4 s on two cores at a load of 12 (a cold
// CI run), and the runner was then rightly retired as slow to come up.
func TestKubePendingWaitsForANode(t *testing.T) {
	img := harness.NeedKube(t)
	top, _, page := harness.Listeners(t)
	late := "runfleet.dev/late-" + strconv.Itoa(os.Getpid())
	f := harness.NewFleet(t, "kpend", harness.FleetOptions{Size: 1, Max: 1, Top: top, Kube: "      kubeconfig: " + harness.KubeconfigPath + "\n" +
		"      namespace: " + harness.KubeRunnerNamespace + "\n      image: " + img + "\n      node_selector: {" + harness.KubeNodeLabel + ": docker, " + late + ": \"yes\"}\n"})
	b, _ := os.ReadFile(f.Config)
	os.WriteFile(f.Config, []byte(strings.Replace(string(b), "bootstrap_timeout: 1m", "bootstrap_timeout: 15s", 1)), 0o600)
	f.Start()
	var first string
	harness.Eventually(t, time.Minute, "a pending pod with the scheduler's reason in status", func() bool {
		pods := f.Pods()
		if len(pods) != 1 {
			return false
		}
		first = string(pods[0].UID)
		for _, r := range f.Status().Pools[0].Runners {
			if strings.Contains(r.Reason, "Unschedulable") {
				return true
			}
		}
		return false
	})
	st := f.StatusTable()
	if !strings.Contains(st, "Unschedulable") {
		t.Errorf("status table lacks the reason:\n%s", st)
	}
	if html := harness.HTTPGet(t, page+"/"); !strings.Contains(html, "Unschedulable") {
		t.Errorf("status page lacks the reason")
	}
	f.Push(harness.Matrix("kpend", 1, "echo done"))
	time.Sleep(45 * time.Second)
	pods := f.Pods()
	if len(pods) != 1 || string(pods[0].UID) != first || f.LogCount("runner started") != 1 {
		t.Fatalf("after 45 s Pending: %d pods (first %s), %d runners started; want the first pod alone", len(pods), first, f.LogCount("runner started"))
	}
	// A node that fits appears.
	ctx := context.Background()
	label := func(v *string) {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{late: v}}})
		if _, err := harness.KubeCP.Client.CoreV1().Nodes().Patch(ctx, harness.KubeNode, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	yes := "yes"
	label(&yes)
	t.Cleanup(func() { label(nil) })
	appeared := time.Now()
	jobs := f.WaitJobs(1, 3*time.Minute)
	if jobs[0].Conclusion != "success" {
		t.Fatalf("job %s: %s", jobs[0].Name, jobs[0].Conclusion)
	}
	t.Logf("the job ran %s after the node appeared, on the pod Pending since the start", time.Since(appeared).Round(100*time.Millisecond))
	// The pod that ran it is the first one, with the first registration.
	if lines := harness.LogLines(f.LogPath, "runner removed"); len(lines) > 0 && strings.Contains(strings.Join(lines, "\n"), "not online after") {
		t.Errorf("a pending runner was retired at bootstrap_timeout: %v", lines)
	}
	if n := f.LogCount("runner started"); n > 2 { // the first, and its slot's refill after the job
		t.Errorf("%d runners started: the pending one was replaced", n)
	}
	t.Logf("status while pending:\n%s", st)
	f.StopLeavesNothing()
}

// A pod evicted while its runner runs a job is a lost machine: the pool
// reports the job lost, a replacement starts, the job is re-run once and
// passes, and nothing is left of the evicted pod or its registration.
func TestKubeEvictedPodIsLost(t *testing.T) {
	img := harness.NeedKube(t)
	f := harness.NewFleet(t, "kevict", harness.FleetOptions{Size: 1, Max: 2, Kube: harness.KubeSection(img, "")})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	// The first attempt runs long enough to be evicted mid-job; its
	// re-run (Gitea's run_attempt, services/actions/context.go) need not.
	f.Push(harness.Matrix("kevict", 1, "if [ \"${GITHUB_RUN_ATTEMPT:-1}\" -gt 1 ]; then echo re-run; else sleep 60; fi\necho done"))
	f.WaitInProgress(1)
	var victimReg int64
	for _, r := range f.Status().Pools[0].Runners {
		if r.State == "busy" {
			victimReg = r.RunnerID
		}
	}
	var victim corev1.Pod
	for _, p := range f.Pods() {
		if p.Status.Phase == corev1.PodRunning {
			victim = p
		}
	}
	evicted := time.Now()
	err := harness.KubeCP.Client.CoreV1().Pods(harness.KubeRunnerNamespace).EvictV1(context.Background(), &policyv1.Eviction{
		ObjectMeta: metav1.ObjectMeta{Name: victim.Name, Namespace: harness.KubeRunnerNamespace},
	})
	if err != nil {
		t.Fatal(err)
	}
	// Seen terminating (by a listing that knew of the job, or one that
	// lagged behind it), or, by a pass that came once the pod had ended
	// or gone (a loaded machine), dead or vanished: each is the job
	// reported lost.
	lost := []string{"taken back while it runs a job", "taken back; its runner's job", "died while running a job", "vanished while it ran a job"}
	harness.Eventually(t, time.Minute, "the job reported lost", func() bool { return len(harness.LogLines(f.LogPath, lost...)) > 0 })
	t.Logf("job reported lost %s after the eviction: %s", time.Since(evicted).Round(100*time.Millisecond),
		strings.Join(harness.LogLines(f.LogPath, lost...), ""))
	harness.Eventually(t, time.Minute, "a replacement idle, the evicted pod gone", func() bool {
		for _, p := range f.Pods() {
			if p.UID == victim.UID {
				return false
			}
		}
		return f.IdleOnline() == 1 && f.LivePods() == 1
	})
	// Gitea fails the job once its runner has been silent for its zombie
	// timeout, and then lets the registration go; the manager re-runs the
	// run's failed jobs once the run has ended.
	harness.Eventually(t, 3*time.Minute, "the lost registration removed once Gitea let go of the job", func() bool {
		for _, r := range f.Runners() {
			if r.ID == victimReg {
				return false
			}
		}
		return true
	})
	if n := len(harness.LogLines(f.LogPath, "asking again later")); n > 8 {
		t.Errorf("the removal of the lost registration was asked %d times", n)
	}
	// The user's view: the job re-run once, on another runner, and passed
	// (and the drain below has no job to wait for).
	harness.Eventually(t, 4*time.Minute, "the evicted job re-run and passed on another runner", func() bool {
		jobs := f.Jobs()
		return len(jobs) == 1 && jobs[0].Status == "completed" && jobs[0].Conclusion == "success" && jobs[0].RunnerID != victimReg
	})
	if n := len(harness.LogLines(f.LogPath, "re-ran the failed jobs of a run whose runner was lost")); n != 1 {
		t.Errorf("the job was re-run %d times, want once", n)
	}
	f.StopLeavesNothing()
}

// `runfleet runner --cloud=kubernetes --single`, as CML's users call it,
// with no --cloud-image: the cluster from KUBERNETES_CONFIGURATION (a
// kubeconfig's contents), the node from --cloud-kubernetes-node-selector
// (also as cml.dev's ref/runner.md writes it: "disktype=ssd", then with
// "ram=huge", and "gpu=infer" with a k80; kwok's node has none of these
// labels), and GitHub's own runner
// image, which runs as its user runner (uid 1001) and has run.sh in its
// home. One job runs in a pod, and nothing is left: no pod, no Secret, no
// registration; the token in no pod.
func TestRunnerCloudKubernetes(t *testing.T) {
	img := harness.NeedGitHubImage(t)
	harness.NeedKube(t)
	kc, err := os.ReadFile(harness.KubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	// No registry can be reached here: GitHub's image is the stand-in
	// runner as that image has it, under the name runfleet pulls.
	gh, _ := forge.Lookup("github")
	published := gh.(forge.AgentImager).AgentImage()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	runSh := []byte("#!/bin/sh\n# actions/runner's run.sh, here the stand-in runner.\nexec /bin/github-runner \"$@\"\n")
	if _, err := peers.UserImage(ctx, harness.DockerCli, img, published, "1001:1001", peers.ImageFile{Path: "home/runner/run.sh", Data: runSh, Mode: 0o755}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { harness.DockerCli.ImageRemove(context.Background(), published, client.ImageRemoveOptions{}) })
	for i, tc := range []struct {
		name string
		sel  []string
	}{
		{"test-node", []string{"--cloud-kubernetes-node-selector", harness.KubeNodeLabel + "=docker"}},
		{"ref disktype", []string{`--cloud-kubernetes-node-selector="disktype=ssd"`}},
		{"ref disktype and ram", []string{`--cloud-kubernetes-node-selector="disktype=ssd"`, `--cloud-kubernetes-node-selector="ram=huge"`}},
		// "..." in ref/runner.md: the GPU configuration infer reads.
		{"ref gpu infer", []string{`--cloud-kubernetes-node-selector="gpu=infer"`, "--cloud-gpu=k80"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runnerInPod(t, fmt.Sprintf("acme/kcml%d", i), published, string(kc), tc.sel)
		})
	}
}

// runnerInPod runs `runfleet runner --cloud=kubernetes --single` for repo
// with the node selector options sel, as a shell would pass them (the
// quotes of ref/runner.md's lines removed), and checks its one job.
func runnerInPod(t *testing.T, repo, image, kc string, sel []string) {
	sim := harness.NewCloudRunnerSim(t, repo)
	args := []string{"runner", "--driver", "github", "--repo", sim.URL + "/" + repo, "--single", "--labels", "cml", "--cloud", "kubernetes"}
	want := map[string]string{}
	for _, a := range sel {
		a = strings.ReplaceAll(a, `"`, "")
		args = append(args, a)
		if k, v, ok := strings.Cut(strings.TrimPrefix(a, "--cloud-kubernetes-node-selector="), "="); ok && !strings.HasPrefix(k, "--") {
			if v == "infer" {
				v = "nvidia-tesla-k80" // the model of --cloud-gpu=k80
			}
			want[k] = v
		}
	}
	cmd, out := harness.StartRunner(t, []string{"KUBERNETES_CONFIGURATION=" + kc}, args...)
	managed := metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=runfleet"}
	harness.Eventually(t, time.Minute, "the runner's pod", func() bool {
		l, _ := harness.KubeCP.Client.CoreV1().Pods(harness.KubeRunnerNamespace).List(context.Background(), managed)
		for _, p := range l.Items {
			b, _ := json.Marshal(p)
			if strings.Contains(string(b), harness.GHToken) || strings.Contains(string(b), kc) {
				t.Errorf("pod %s shows the token or the kubeconfig", p.Name)
			}
			if im := p.Spec.Containers[0].Image; im != image {
				t.Errorf("pod %s runs %s, not GitHub's image %s", p.Name, im, image)
			}
			for k, v := range want {
				if p.Spec.NodeSelector[k] != v {
					t.Errorf("pod %s selects nodes %v, without %s=%s", p.Name, p.Spec.NodeSelector, k, v)
				}
			}
		}
		return len(l.Items) == 1
	})
	sim.Queue(repo, ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "cml"}, Script: "echo trained-in-a-pod as $(id -u); hostname"})
	took := harness.WaitExit(t, cmd, 2*time.Minute)
	jobs := sim.Jobs()
	if len(jobs) != 1 || jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained-in-a-pod as 1001") {
		t.Fatalf("jobs = %+v", jobs)
	}
	if strings.Contains(out.String(), harness.GHToken) || strings.Contains(out.String(), "client-certificate-data") {
		t.Error("the token or the kubeconfig reached the runner's log")
	}
	if r := sim.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	harness.Eventually(t, time.Minute, "no pod or Secret left", func() bool {
		p, _ := harness.KubeCP.Client.CoreV1().Pods(harness.KubeRunnerNamespace).List(context.Background(), managed)
		s, _ := harness.KubeCP.Client.CoreV1().Secrets(harness.KubeRunnerNamespace).List(context.Background(), managed)
		return len(p.Items)+len(s.Items) == 0
	})
	t.Logf("--cloud=kubernetes --single: job %s in pod %q, exited %s after the job was queued, nothing left",
		jobs[0].Conclusion, strings.TrimSpace(harness.LastLine(jobs[0].Output)), took.Round(100*time.Millisecond))
}

// A pod whose image its registry does not have is refused at once: the
// pool halts with the kubelet's words on the status page and in
// `runfleet status`, and makes no second pod or registration. One whose
// registry cannot be reached waits (Pending, ErrImagePull then
// ImagePullBackOff in status) as the kubelet retries.
func TestKubeBadImageHalts(t *testing.T) {
	harness.NeedKube(t)
	top, _, page := harness.Listeners(t)
	f := harness.NewFleet(t, "kpull", harness.FleetOptions{Size: 2, Top: top, Kube: harness.KubeSection("runfleet-test/not-there:1", "")})
	f.Start()
	start := time.Now()
	harness.Eventually(t, time.Minute, "the pool halted with the kubelet's reason", func() bool {
		b := f.Status().Pools[0].Backoff
		return b != nil && b.Halted && strings.Contains(b.Reason, "repository does not exist")
	})
	t.Logf("halted %s after start: %s", time.Since(start).Round(100*time.Millisecond), f.Status().Pools[0].Backoff.Reason)
	if html := harness.HTTPGet(t, page+"/"); !strings.Contains(html, "repository does not exist") {
		t.Errorf("status page lacks the reason")
	}
	if st := f.StatusTable(); !strings.Contains(st, "not starting runners") {
		t.Errorf("status table lacks the halt:\n%s", st)
	}
	harness.Eventually(t, time.Minute, "the refused pods gone", func() bool { return f.LivePods() == 0 })
	time.Sleep(5 * time.Second)
	if n := f.LogCount("runner started"); n != 2 || f.LivePods() != 0 || len(f.Runners()) != 0 {
		t.Errorf("%d runners started, %d pods, %d registrations: want the first two, then none", n, f.LivePods(), len(f.Runners()))
	}
	f.StopLeavesNothing()

	g := harness.NewFleet(t, "kreg", harness.FleetOptions{Size: 1, Kube: harness.KubeSection("registry.invalid/runner:1", "")})
	g.Start()
	harness.Eventually(t, time.Minute, "the pull failure in status", func() bool {
		for _, r := range g.Status().Pools[0].Runners {
			if strings.Contains(r.Reason, "ImagePullBackOff") {
				t.Logf("status: %s %s: %s", r.Name, r.State, r.Reason)
				return true
			}
		}
		return false
	})
	if b := g.Status().Pools[0].Backoff; b != nil && b.Halted {
		t.Errorf("halted on a registry that may come back: %s", b.Reason)
	}
	g.StopLeavesNothing()
}
