package kubernetes

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

func decode(t *testing.T, yaml string, gpus int) Section {
	t.Helper()
	raw, err := jsonOf(yaml)
	if err != nil {
		t.Fatal(err)
	}
	s, err := DecodeSection(raw, gpus)
	if err != nil {
		t.Fatalf("DecodeSection: %v", err)
	}
	return s
}

func jsonOf(yaml string) (json.RawMessage, error) {
	var v any
	if err := yamlUnmarshal([]byte(yaml), &v); err != nil {
		return nil, err
	}
	return json.Marshal(v)
}

// The pod carries what the section asks for, the runner's files and
// environment only by reference to its Secret, and runfleet's labels and
// restart policy whatever the template says.
func TestPodFromSection(t *testing.T) {
	s := decode(t, `
image: runner:1
resources: {requests: {cpu: "2", memory: 4Gi}, limits: {memory: 4Gi}}
node_selector: {gpu: a100}
tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
runtime_class_name: nvidia
priority_class_name: ci
service_account_name: runner
security_context: {runAsUser: 1000, fsGroup: 1000}
workdir_size_limit: 20Gi
volumes: ["pvc:datasets:/data", "host:/models:/models:rw", "nfs:nas:/export/x:/x"]
pod_template:
  metadata: {labels: {team: ml, runfleet.dev/runner: stolen}, annotations: {a: b}}
  spec: {restartPolicy: Always, hostname: fixed}
`, 2)
	p := &Provider{opt: Options{Section: s, GPUs: 2, MaxLifetime: 90 * time.Minute}}
	for _, v := range s.Volumes {
		vol, _ := ParseVolume(v)
		p.opt.volumes = append(p.opt.volumes, vol)
	}
	sp := provider.Spec{
		Name: "gpu-3", Manager: "lab", Pool: "gpu", Command: "gitea-runner", Args: []string{"daemon"},
		Env:   map[string]string{"TOKEN": "secret-value", "PATH": "/bin"},
		Files: map[string][]byte{".runner": []byte("secret-file"), "conf/runner.yaml": []byte("x")},
	}
	pod, err := p.podFor("lab-gpu-3-abcde", sp)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(pod)
	if strings.Contains(string(b), "secret-value") || strings.Contains(string(b), "secret-file") {
		t.Fatalf("the pod shows a credential: %s", b)
	}
	if pod.Labels[LabelRunner] != "gpu-3" || pod.Labels[LabelManager] != "lab" || pod.Labels[LabelPool] != "gpu" || pod.Labels["team"] != "ml" {
		t.Errorf("labels %v", pod.Labels)
	}
	ps := pod.Spec
	if ps.RestartPolicy != corev1.RestartPolicyNever || ps.Hostname != "fixed" {
		t.Errorf("restart policy %s, hostname %q", ps.RestartPolicy, ps.Hostname)
	}
	if ps.AutomountServiceAccountToken == nil || *ps.AutomountServiceAccountToken {
		t.Error("the service account token is mounted")
	}
	if ps.ActiveDeadlineSeconds == nil || *ps.ActiveDeadlineSeconds != 10800 { // 90 min, and as long again for a job taken at 90 min
		t.Errorf("activeDeadlineSeconds %v", ps.ActiveDeadlineSeconds)
	}
	if ps.RuntimeClassName == nil || *ps.RuntimeClassName != "nvidia" || ps.PriorityClassName != "ci" || ps.ServiceAccountName != "runner" ||
		ps.NodeSelector["gpu"] != "a100" || len(ps.Tolerations) != 1 || *ps.SecurityContext.RunAsUser != 1000 {
		t.Errorf("pod spec %+v", ps)
	}
	c := ps.Containers[0]
	if q := c.Resources.Limits["nvidia.com/gpu"]; q.Cmp(resource.MustParse("2")) != 0 {
		t.Errorf("gpu limit %v", q.String())
	}
	if _, ok := ps.InitContainers[0].Resources.Limits["nvidia.com/gpu"]; ok {
		t.Error("the files container asks for GPUs")
	}
	for _, e := range c.Env {
		if e.Value != "" || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef.Name != "lab-gpu-3-abcde" {
			t.Errorf("env %s is not from the runner's secret: %+v", e.Name, e)
		}
	}
	ro := map[string]bool{}
	for _, m := range c.VolumeMounts {
		ro[m.MountPath] = m.ReadOnly
	}
	if !ro["/data"] || ro["/models"] || !ro["/x"] || ro["/runner"] {
		t.Errorf("mounts read-only: %v", ro)
	}
	script := ps.InitContainers[0].Command[2]
	for _, want := range []string{"umask 077", "cp '/run/runfleet/files/0' '/runner/.runner'", "mkdir -p '/runner/conf'", "cp '/run/runfleet/files/1' '/runner/conf/runner.yaml'"} {
		if !strings.Contains(script, want) {
			t.Errorf("files script %q lacks %q", script, want)
		}
	}
	sec := runnerSecret("lab-gpu-3-abcde", sp)
	if string(sec.Data["env.TOKEN"]) != "secret-value" || string(sec.Data["file.0"]) != "secret-file" || sec.Labels[LabelRunner] != "gpu-3" {
		t.Errorf("secret %+v", sec)
	}
}

// A file outside the work directory is refused.
func TestFilesOutsideWorkdir(t *testing.T) {
	for _, bad := range []string{"../x", "/etc/passwd", ".", ""} {
		if _, err := filesScript("/runner", map[string][]byte{bad: nil}); err == nil {
			t.Errorf("file %q accepted", bad)
		}
	}
}

func TestSectionErrors(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{`{}`, "kubernetes.image: is required"},
		{`{image: x, volumes: ["data:/data"]}`, "kubernetes.volumes[0]"},
		{`{image: x, volumes: ["pvc:Bad_Name:/data"]}`, "is not a claim name"},
		{`{image: x, volumes: ["host:rel:/data"]}`, "must be absolute"},
		{`{image: x, image_pull_policy: sometimes}`, "kubernetes.image_pull_policy"},
		{`{image: x, namespace: Not_OK}`, "kubernetes.namespace"},
		{`{image: x, in_cluster: true, kubeconfig: /k}`, "kubernetes.in_cluster"},
		{`{image: x, pod_template: {spec: {nodeSelectr: {a: b}}}}`, "kubernetes.pod_template"},
		{`{image: x, workdir: rel}`, "kubernetes.workdir"},
		// A template keeps what carries the runner's credential.
		{`{image: x, pod_template: {spec: {volumes: [{name: runfleet-files, emptyDir: {}}]}}}`, `"runfleet-files" is runfleet's`},
		{`{image: x, pod_template: {spec: {volumes: [{$patch: replace}]}}}`, `kubernetes.pod_template: spec.volumes`},
		{`{image: x, pod_template: {spec: {initContainers: [{name: files, command: ["true"]}]}}}`, "spec.initContainers"},
		{`{image: x, pod_template: {spec: {containers: [{name: runner, env: [{$patch: replace}]}]}}}`, "env: RUNNER_TOKEN is the agent's"},
		{`{image: x, pod_template: {spec: {containers: [{name: runner, env: [{name: RUNNER_TOKEN, value: mine}]}]}}}`, "env: RUNNER_TOKEN"},
		{`{image: x, pod_template: {spec: {containers: [{name: runner, volumeMounts: [{$patch: replace}]}]}}}`, "volumeMounts"},
		{`{image: x, pod_template: {spec: {containers: [{$patch: replace}]}}}`, `"runner" runs the agent`},
		{`{image: x, workdir_size_limit: lots}`, "kubernetes.workdir_size_limit"},
		{`{image: x, ephemeral_storage: {limit: lots}}`, "kubernetes.ephemeral_storage.limit"},
		{`{image: x, ephemeral_storage: {request: 50Gi, limit: 20Gi}}`, "kubernetes.ephemeral_storage.request: 50Gi is more than the limit"},
		{`{image: x, tolerations: [{key: a, operatr: Exists}]}`, "kubernetes.tolerations"},
		{`{image: x, colour: blue}`, "kubernetes.colour: unknown field"},
	} {
		raw, err := jsonOf(tc.yaml)
		if err != nil {
			t.Fatal(err)
		}
		_, err = DecodeSection(raw, 0)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
	raw, _ := jsonOf(`{image: x}`)
	if _, err := DecodeSection(raw, -1); err == nil || !strings.Contains(err.Error(), "gpus_per_runner") {
		t.Errorf("gpus_per_runner all: %v", err)
	}
}

func TestParseVolume(t *testing.T) {
	for in, want := range map[string]Volume{
		"/data:/data":             {Kind: "host", Source: "/data", Target: "/data", ReadOnly: true},
		"/data:/data:rw":          {Kind: "host", Source: "/data", Target: "/data"},
		"pvc:sets:/d:ro":          {Kind: "pvc", Source: "sets", Target: "/d", ReadOnly: true},
		"nfs:10.0.0.2:/exp:/n:rw": {Kind: "nfs", Server: "10.0.0.2", Source: "/exp", Target: "/n"},
	} {
		got, err := ParseVolume(in)
		if err != nil || got != want {
			t.Errorf("%s: %+v %v, want %+v", in, got, err, want)
		}
	}
}

// CML's --cloud=kubernetes options make a section: the machine type's
// resources and GPU, the node selector, and the kubeconfig by reference.
func TestCMLSection(t *testing.T) {
	raw, ok, err := driver{}.CMLSection(provider.CMLOptions{
		Cloud:        map[string]string{"cloud": "kubernetes", "cloud-type": "m+v100", "cloud-image": "runner:cuda"},
		NodeSelector: map[string]string{"zone": "a", "disk": "ssd", "accelerator": "infer"},
		Getenv: func(k string) (string, bool) {
			if k == "KUBERNETES_CONFIGURATION" {
				return "apiVersion: v1\nkind: Config\n", true
			}
			return "", false
		},
	})
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	if strings.Contains(string(raw), "apiVersion") {
		t.Fatalf("the section holds the kubeconfig itself: %s", raw)
	}
	var s Section
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatal(err)
	}
	gpu := s.Resources.Limits[DefaultGPUResource]
	if s.Image != "runner:cuda" || s.NodeSelector["zone"] != "a" || s.NodeSelector["disk"] != "ssd" || s.NodeSelector["accelerator"] != "nvidia-tesla-v100" ||
		gpu.Value() != 1 || s.Resources.Requests.Cpu().Value() != 8 || s.KubeconfigData != "${KUBERNETES_CONFIGURATION}" {
		t.Errorf("section %+v", s)
	}
	raw, _, err = driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "kubernetes", "cloud-image": "x",
		"cloud-type": "4-16000+nvidia-tesla-t4*2", "cloud-hdd-size": "50"}})
	s = Section{}
	if err != nil || json.Unmarshal(raw, &s) != nil {
		t.Fatal(err)
	}
	gpu = s.Resources.Limits[DefaultGPUResource]
	if mem := s.Resources.Requests[corev1.ResourceMemory]; gpu.Value() != 2 || mem.Value() != 16000e6 || s.NodeSelector["accelerator"] != "nvidia-tesla-t4" || s.WorkdirSizeLimit != "50G" {
		t.Errorf("custom type: %+v", s)
	}
	// CML's default selector, accelerator=infer, is nothing without a
	// GPU; a value of infer is the GPU's model under any key.
	raw, _, _ = driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "kubernetes", "cloud-image": "x", "cloud-type": "m"}})
	s = Section{}
	if json.Unmarshal(raw, &s); len(s.NodeSelector) != 0 {
		t.Errorf("a pod without GPUs selects nodes %v", s.NodeSelector)
	}
	raw, _, _ = driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "kubernetes", "cloud-image": "x", "cloud-type": "m", "cloud-gpu": "k80"},
		NodeSelector: map[string]string{"gpu": "infer", "pool": "ml"}})
	s = Section{}
	if json.Unmarshal(raw, &s); len(s.NodeSelector) != 2 || s.NodeSelector["gpu"] != "nvidia-tesla-k80" || s.NodeSelector["pool"] != "ml" {
		t.Errorf("gpu=infer pool=ml with m+k80 selects %v", s.NodeSelector)
	}
	if _, _, err := (driver{}).CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "kubernetes", "cloud-image": "x", "cloud-type": "huge"}}); err == nil {
		t.Error("an unknown machine type was taken")
	}
	if _, ok, _ := (driver{}).CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "aws"}}); ok {
		t.Error("--cloud=aws taken for kubernetes")
	}
}

// Without --cloud-image, a pod runs the forge's own runner image where
// it publishes one, else CML's image (its GPU variant for GPU types) with
// the agent fetched and checked as the pod starts; a forge with neither
// needs --cloud-image.
func TestCMLSectionDefaultImage(t *testing.T) {
	stock := &provider.Stock{AgentURL: "https://dl.example/gitea-runner-1.0.8-linux-amd64", AgentSHA256: strings.Repeat("ab", 32)}
	for _, tc := range []struct {
		name       string
		typ, image string
		o          provider.CMLOptions
		want       string
		install    bool
	}{
		{"forge image", "m", "", provider.CMLOptions{AgentImage: "ghcr.io/actions/actions-runner:2.337.0"}, "ghcr.io/actions/actions-runner:2.337.0", false},
		{"given image wins", "m", "mine:1", provider.CMLOptions{AgentImage: "ghcr.io/actions/actions-runner:2.337.0"}, "mine:1", false},
		{"stock", "m", "", provider.CMLOptions{Stock: stock}, StockImage, true},
		{"stock gpu", "m+v100", "", provider.CMLOptions{Stock: stock}, StockGPUImage, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.o.Cloud = map[string]string{"cloud": "kubernetes", "cloud-type": tc.typ}
			if tc.image != "" {
				tc.o.Cloud["cloud-image"] = tc.image
			}
			raw, _, err := driver{}.CMLSection(tc.o)
			if err != nil {
				t.Fatal(err)
			}
			s, err := DecodeSection(raw, 0)
			if err != nil {
				t.Fatal(err)
			}
			if s.Image != tc.want || (s.Install.Agent.URL != "") != tc.install {
				t.Errorf("image %q, install %+v; want %q, install %v", s.Image, s.Install, tc.want, tc.install)
			}
			if tc.install && (s.Install.Agent.URL != stock.AgentURL || s.Install.Agent.SHA256 != stock.AgentSHA256) {
				t.Errorf("install %+v", s.Install)
			}
		})
	}
	_, _, err := driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "kubernetes"}})
	if err == nil || !strings.Contains(err.Error(), "--cloud-image: is required") {
		t.Errorf("no image, no agent to fetch: %v", err)
	}
}

// The init container of a stock image fetches the agent into its own
// volume, checks it before anything else, and fails saying what failed;
// the agent container sees the volume where the pool's agent path points.
func TestPodInstallsAgentSpec(t *testing.T) {
	s := Section{Image: StockImage, Workdir: DefaultWorkdir, GPUResource: DefaultGPUResource,
		Install: Install{Agent: vm.Download{URL: "https://dl.example/v1/gitea-runner-1.0.8-linux-amd64", SHA256: strings.Repeat("ab", 32)}}}
	p := &Provider{opt: Options{Section: s}}
	pod, err := p.podFor("cpu-1", provider.Spec{Name: "cpu-1", Command: vm.AgentDir + "/gitea-runner-1.0.8-linux-amd64", Files: map[string][]byte{".runner": []byte("{}")}})
	if err != nil {
		t.Fatal(err)
	}
	init := pod.Spec.InitContainers[0]
	script := init.Command[2]
	for _, want := range []string{"sha256sum", strings.Repeat("ab", 32), "checksum mismatch", "chmod 0755 '" + vm.AgentDir + "/gitea-runner-1.0.8-linux-amd64'"} {
		if !strings.Contains(script, want) {
			t.Errorf("init script lacks %q:\n%s", want, script)
		}
	}
	if strings.Index(script, "sha256sum") > strings.Index(script, "cp ") {
		t.Errorf("the files are copied before the agent is checked:\n%s", script)
	}
	if init.TerminationMessagePolicy != corev1.TerminationMessageFallbackToLogsOnError {
		t.Errorf("init container's termination message policy %q", init.TerminationMessagePolicy)
	}
	mounted := func(c corev1.Container) bool {
		return slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == agentVolume && m.MountPath == vm.AgentDir })
	}
	if !mounted(init) || !mounted(pod.Spec.Containers[0]) {
		t.Errorf("the agent's volume is not mounted at %s in both containers", vm.AgentDir)
	}
	if g := pod.Spec.SecurityContext.FSGroup; g == nil || *g != DefaultFSGroup {
		t.Errorf("fsGroup %v", g)
	}
	// A pool's own fsGroup stays.
	p.opt.Section.SecurityContext = &corev1.PodSecurityContext{FSGroup: new(int64(123))}
	pod, _ = p.podFor("cpu-2", provider.Spec{Name: "cpu-2", Command: "x"})
	if g := pod.Spec.SecurityContext.FSGroup; *g != 123 || *p.opt.Section.SecurityContext.FSGroup != 123 {
		t.Errorf("fsGroup %v", *g)
	}
}

// A template may add to the pod (a sidecar, a volume, an init container
// after runfleet's, an environment variable of its own) and change what
// is not the credential's.
func TestTemplateAddsToThePod(t *testing.T) {
	s := decode(t, `
image: runner:1
pod_template:
  spec:
    volumes: [{name: cache, emptyDir: {}}]
    initContainers: [{name: warm, image: busybox, command: ["true"]}]
    containers:
    - {name: runner, env: [{name: MY_VAR, value: "1"}], volumeMounts: [{name: cache, mountPath: /cache}]}
    - {name: sidecar, image: busybox}
`, 0)
	p := &Provider{opt: Options{Section: s}}
	pod, err := p.podFor("m-r-1", provider.Spec{Name: "r-1", Command: "agent", Env: map[string]string{"TOKEN": "t"}, Files: map[string][]byte{".runner": []byte("x")}})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(pod.Spec.Containers); n != 2 || pod.Spec.InitContainers[0].Name != filesContainer || len(pod.Spec.InitContainers) != 2 {
		t.Errorf("containers %d, init %v", n, pod.Spec.InitContainers)
	}
	// Checked again with the agent's own variables, when a runner is made.
	raw, _ := jsonOf(`{image: x, pod_template: {spec: {containers: [{name: runner, env: [{name: GITEA_TOKEN, value: mine}]}]}}}`)
	s, err = DecodeSection(raw, 0)
	if err != nil {
		t.Fatal(err)
	}
	p = &Provider{opt: Options{Section: s}}
	_, err = p.podFor("m-r-1", provider.Spec{Name: "r-1", Command: "agent", Env: map[string]string{"GITEA_TOKEN": "t"}})
	if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "GITEA_TOKEN") {
		t.Errorf("a template replacing the agent's variable: %v", err)
	}
}

// ephemeral_storage becomes the agent container's request and limit; the
// init container asks the same, which adds nothing to the pod's.
func TestEphemeralStorage(t *testing.T) {
	s := decode(t, "{image: r, ephemeral_storage: {request: 20Gi, limit: 20Gi}}", 0)
	p := &Provider{opt: Options{Section: s}}
	pod, err := p.podFor("m-r-1", provider.Spec{Name: "r-1", Command: "agent"})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []corev1.Container{pod.Spec.Containers[0], pod.Spec.InitContainers[0]} {
		r, l := c.Resources.Requests[corev1.ResourceEphemeralStorage], c.Resources.Limits[corev1.ResourceEphemeralStorage]
		if r.String() != "20Gi" || l.String() != "20Gi" {
			t.Errorf("%s: ephemeral-storage request %s, limit %s", c.Name, r.String(), l.String())
		}
	}
}

// Runner pods run as a user, never root, unless the pool asks for root
// with runAsUser 0; a pool's own user and group stay.
func TestPodRunsAsNonRoot(t *testing.T) {
	for _, tc := range []struct {
		name    string
		pod     *corev1.PodSecurityContext
		ctr     *corev1.SecurityContext
		user    int64
		nonRoot bool
	}{
		{"default", nil, nil, DefaultRunAsUser, true},
		{"own user", &corev1.PodSecurityContext{RunAsUser: new(int64(1000))}, nil, 1000, true},
		{"root pool", &corev1.PodSecurityContext{RunAsUser: new(int64(0))}, nil, 0, false},
		{"root container", nil, &corev1.SecurityContext{RunAsUser: new(int64(0))}, -1, false},
	} {
		got := podSecurity(tc.pod, tc.ctr)
		user := int64(-1)
		if got.RunAsUser != nil {
			user = *got.RunAsUser
		}
		if user != tc.user || got.RunAsNonRoot == nil || *got.RunAsNonRoot != tc.nonRoot {
			t.Errorf("%s: runAsUser %d, runAsNonRoot %v", tc.name, user, got.RunAsNonRoot)
		}
		if *got.FSGroup != DefaultFSGroup {
			t.Errorf("%s: fsGroup %d", tc.name, *got.FSGroup)
		}
	}
}

func yamlUnmarshal(b []byte, v any) error { return yaml.Unmarshal(b, v) }

// A pod's state and reason, as the pool sees them, for the shapes a
// kubelet and the scheduler give a pod.
func TestStateAndReason(t *testing.T) {
	now := metav1.Now()
	waiting := func(reason, msg string) corev1.ContainerStatus {
		return corev1.ContainerStatus{Name: agentContainer, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason, Message: msg}}}
	}
	for _, tc := range []struct {
		name       string
		pod        corev1.Pod
		state      provider.State
		reason     string
		disruption bool
	}{
		{"unscheduled", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable", Message: "0/3 nodes are available"}}}},
			provider.StateCreated, "Unschedulable: 0/3 nodes are available", false},
		{"image pull", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{
			waiting("ImagePullBackOff", `Back-off pulling image "runner:9"`)}}},
			provider.StateCreated, `ImagePullBackOff: Back-off pulling image "runner:9"`, false},
		{"init image pull", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodPending, InitContainerStatuses: []corev1.ContainerStatus{
			waiting("ErrImagePull", "not found")}}},
			provider.StateCreated, "ErrImagePull: not found", false},
		{"creating", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{
			waiting("ContainerCreating", "")}}}, provider.StateCreated, "ContainerCreating", false},
		{"running", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodRunning}}, provider.StateRunning, "", false},
		{"succeeded", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodSucceeded}}, provider.StateExited, "", false},
		{"evicted by the node", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodFailed, Reason: "Evicted", Message: "The node was low on resource: memory."}},
			provider.StateExited, "Evicted: The node was low on resource: memory.", true},
		{"deadline", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodFailed, Reason: "DeadlineExceeded"}}, provider.StateExited, "DeadlineExceeded", false},
		{"preempted", corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}, Status: corev1.PodStatus{Phase: corev1.PodRunning,
			Conditions: []corev1.PodCondition{{Type: corev1.DisruptionTarget, Status: corev1.ConditionTrue, Reason: "PreemptionByScheduler", Message: "high"}}}},
			provider.StateExited, "", true},
		{"deleted by someone", corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}, Status: corev1.PodStatus{Phase: corev1.PodRunning}},
			provider.StateExited, "", true},
	} {
		if got := stateOf(&tc.pod); got != tc.state {
			t.Errorf("%s: state %s, want %s", tc.name, got, tc.state)
		}
		if got := reasonOf(&tc.pod); got != tc.reason {
			t.Errorf("%s: reason %q, want %q", tc.name, got, tc.reason)
		}
		if _, got := disruption(&tc.pod); got != tc.disruption {
			t.Errorf("%s: disruption %v, want %v", tc.name, got, tc.disruption)
		}
	}
}

// A Pending pod that waits on its cluster holds its slot (queued) until
// pending_timeout; one the kubelet will never run is refused at once, in
// the kubelet's words; one that ran counts from its start.
func TestPendingPod(t *testing.T) {
	now := time.Now()
	ago := func(d time.Duration) metav1.Time { return metav1.NewTime(now.Add(-d)) }
	scheduled := func(d time.Duration) []corev1.PodCondition {
		return []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: ago(d)}}
	}
	waiting := func(reason, msg string) []corev1.ContainerStatus {
		return []corev1.ContainerStatus{{Name: agentContainer, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason, Message: msg}}}}
	}
	const notFound = `failed to pull and unpack image "docker.io/team/runner:9": failed to resolve reference "docker.io/team/runner:9": docker.io/team/runner:9: not found`
	const noHost = `failed to pull and unpack image "reg.example/runner:9": failed to resolve reference "reg.example/runner:9": failed to do request: Head "https://reg.example/v2/runner/manifests/9": dial tcp: lookup reg.example: i/o timeout`
	p := &Provider{opt: Options{Section: Section{PendingTimeout: config.D(30 * time.Minute)}}}
	for _, tc := range []struct {
		name    string
		age     time.Duration
		status  corev1.PodStatus
		queued  bool
		refused string
		reason  string
		started bool
	}{
		{"for a node", 20 * time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable", Message: "0/4 nodes have nvidia.com/gpu"}}},
			true, "", "Unschedulable: 0/4 nodes have nvidia.com/gpu", false},
		{"for a node too long", 31 * time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable", Message: "0/4 nodes"}}},
			false, "", "Pending longer than pending_timeout 30m0s: Unschedulable: 0/4 nodes", false},
		{"pulling", 10 * time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(9 * time.Minute),
			ContainerStatuses: waiting("ContainerCreating", "")}, true, "", "ContainerCreating", false},
		{"not created yet", time.Second, corev1.PodStatus{}, true, "", "", false},
		{"no such image", time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(time.Minute),
			ContainerStatuses: waiting("ErrImagePull", notFound)}, false, "runner ErrImagePull: " + notFound, "", false},
		{"back-off on no such image", time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(time.Minute),
			ContainerStatuses: waiting("ImagePullBackOff", `Back-off pulling image "team/runner:9": ErrImagePull: `+notFound)}, false, "not found", "", false},
		{"registry unreachable a while", 5 * time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(5 * time.Minute),
			ContainerStatuses: waiting("ImagePullBackOff", noHost)}, true, "", "ImagePullBackOff", false},
		{"registry unreachable too long", 11 * time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(11 * time.Minute),
			ContainerStatuses: waiting("ErrImagePull", noHost)}, false, "failing for over 10m0s", "", false},
		{"invalid name", time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(time.Minute),
			ContainerStatuses: waiting("InvalidImageName", `Failed to apply default image tag "Team/Runner": couldn't parse image name`)}, false, "InvalidImageName", "", false},
		{"root image", time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(time.Minute),
			ContainerStatuses: waiting("CreateContainerConfigError", `container has runAsNonRoot and image will run as root (pod: "a_b(c)", container: files)`)},
			false, "runAsUser: 0", "", false},
		{"secret on its way", 5 * time.Second, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(5 * time.Second),
			ContainerStatuses: waiting("CreateContainerConfigError", `secret "m-r-1-abcde" not found`)}, true, "", "CreateContainerConfigError", false},
		{"copying files", 40 * time.Minute, corev1.PodStatus{Phase: corev1.PodPending, Conditions: scheduled(39 * time.Minute),
			InitContainerStatuses: []corev1.ContainerStatus{{Name: filesContainer, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: ago(time.Second)}}}}},
			false, "", "", true},
	} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{CreationTimestamp: ago(tc.age)}, Status: tc.status}
		in := p.instance(pod)
		if in.Queued != tc.queued || !strings.Contains(in.Refused, tc.refused) || (tc.refused == "") != (in.Refused == "") ||
			!strings.Contains(in.Reason, tc.reason) || in.Started.IsZero() == tc.started {
			t.Errorf("%s: queued %v, refused %q, reason %q, started %v", tc.name, in.Queued, in.Refused, in.Reason, in.Started)
		}
	}
}

// A pod that takes a job just before max_lifetime keeps it: the kubelet's
// deadline leaves that job as long again, at least an hour.
func TestDeadlineLeavesAJobTime(t *testing.T) {
	for _, c := range []struct{ life, want time.Duration }{
		{0, 0},
		{4 * time.Second, time.Hour + 4*time.Second},
		{time.Hour, 2 * time.Hour},
		{12 * time.Hour, 24 * time.Hour},
	} {
		if got := deadline(c.life); got != c.want {
			t.Errorf("deadline(%s) = %s, want %s", c.life, got, c.want)
		}
	}
}
