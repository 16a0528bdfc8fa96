package kubernetes

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/secret"
)

// Section is a pool's `kubernetes:` section: where its runner pods run
// and what they look like.
type Section struct {
	// Kubeconfig is the kubeconfig file to connect with. When empty, the
	// pod's own service account is used inside a cluster, and
	// $KUBECONFIG or ~/.kube/config outside one.
	Kubeconfig string `json:"kubeconfig"`
	// Context is the kubeconfig's context to use; its current context
	// when empty.
	Context string `json:"context"`
	// KubeconfigData is a kubeconfig's contents instead of a file,
	// normally "${KUBERNETES_CONFIGURATION}" (CML's variable): it holds
	// credentials, so write the reference, not the contents.
	KubeconfigData string `json:"kubeconfig_data"`
	kubeconfig     secret.String
	// InCluster uses the service account of the pod runfleet runs in,
	// whatever the environment says.
	InCluster bool `json:"in_cluster"`
	// Namespace holds the pool's pods and Secrets: the context's
	// namespace, or "default", when empty.
	Namespace string `json:"namespace"`

	// Image runs the agent: it must hold the agent, a shell (/bin/sh
	// and cp copy the runner's files into its work volume before the
	// agent starts) and whatever the jobs need.
	Image string `json:"image"`
	// ImagePullPolicy is Always, IfNotPresent or Never; Kubernetes'
	// default when empty.
	ImagePullPolicy corev1.PullPolicy `json:"image_pull_policy"`
	// ImagePullSecrets name Secrets of the namespace for a private
	// registry.
	ImagePullSecrets []string `json:"image_pull_secrets"`
	// Resources are the agent container's requests and limits. GPUs come
	// from the pool's gpus_per_runner (nvidia.com/gpu) unless written
	// here.
	Resources corev1.ResourceRequirements `json:"resources"`
	// EphemeralStorage is the agent container's request and limit of the
	// node's disk ("20Gi"): its writable layer, its logs and its work
	// directory's emptyDir count. Past the limit the kubelet evicts the
	// pod, rather than a job filling the node's disk under its other
	// pods; the request keeps the scheduler from packing runners onto a
	// node without the room.
	EphemeralStorage Storage `json:"ephemeral_storage"`
	// GPUResource is the extended resource that gpus_per_runner asks for.
	GPUResource corev1.ResourceName `json:"gpu_resource"`

	NodeSelector      map[string]string   `json:"node_selector"`
	Tolerations       []corev1.Toleration `json:"tolerations"`
	Affinity          *corev1.Affinity    `json:"affinity"`
	RuntimeClassName  string              `json:"runtime_class_name"`
	PriorityClassName string              `json:"priority_class_name"`
	// ServiceAccountName runs the pod as that account; its token is
	// mounted only when AutomountServiceAccountToken says so, since a
	// job could use it against the cluster.
	ServiceAccountName           string `json:"service_account_name"`
	AutomountServiceAccountToken bool   `json:"automount_service_account_token"`
	// SecurityContext is the pod's, with fsGroup DefaultFSGroup,
	// runAsUser DefaultRunAsUser and runAsNonRoot unless it (or
	// ContainerSecurityContext, the agent container's) sets them; a pool
	// whose image must run as root sets runAsUser: 0.
	SecurityContext          *corev1.PodSecurityContext `json:"security_context"`
	ContainerSecurityContext *corev1.SecurityContext    `json:"container_security_context"`
	// Workdir is the agent's working directory, an emptyDir of its own
	// that holds the runner's files and its jobs' checkouts.
	Workdir string `json:"workdir"`
	// WorkdirSizeLimit bounds that emptyDir ("20Gi").
	WorkdirSizeLimit string `json:"workdir_size_limit"`
	// Volumes mount datasets, read-only unless ":rw" ends the entry:
	//   pvc:<claim>:<target>[:rw]
	//   host:<path>:<target>[:rw]         (also /path:<target>)
	//   nfs:<server>:<export>:<target>[:rw]
	Volumes []string `json:"volumes"`
	// Install is what the image lacks: the forge's agent, fetched and
	// checked against its SHA-256 by the pod's init container into
	// vm.AgentDir (a stock image with curl or wget, and sha256sum).
	Install Install `json:"install"`
	// PendingTimeout is how long a pod may stay Pending, waiting for a
	// node (a cluster autoscaler adding one) or for its image, before it
	// is replaced: DefaultPendingTimeout when unset or 0.
	// Until then it holds its slot and its registration, and the pool's
	// bootstrap_timeout counts from its start.
	PendingTimeout config.Duration `json:"pending_timeout"`
	// Docker gives the pool's jobs a Docker daemon: "dind" runs one in a
	// privileged sidecar of each pod (Dind), with the agent's DOCKER_HOST
	// pointed at it; none when empty.
	Docker string `json:"docker"`
	Dind   Dind   `json:"dind"`
	// PodTemplate is merged over the pod runfleet makes (a strategic
	// merge patch of a Pod: metadata and spec), for what has no key of
	// its own here.
	PodTemplate json.RawMessage `json:"pod_template"`
}

// Storage is a request and a limit of ephemeral storage.
type Storage struct {
	Request string `json:"request"`
	Limit   string `json:"limit"`
}

// Install is a pod's install section.
type Install struct {
	Agent vm.Download `json:"agent"`
}

// Defaults of the section.
const (
	DefaultWorkdir = "/runner"
	// DefaultPendingTimeout leaves a GPU node minutes to be added and a
	// CUDA image of gigabytes minutes to be pulled, several times over.
	DefaultPendingTimeout = 30 * time.Minute
	DefaultGPUResource    = corev1.ResourceName("nvidia.com/gpu")
	// DefaultFSGroup is the pods' fsGroup unless security_context sets
	// one: the group of the runner user in GitHub's actions-runner image
	// and in images/ (any group would do: the kubelet adds it to every
	// container's groups).
	DefaultFSGroup = 1001
	// DefaultRunAsUser is the pods' user unless a security context sets
	// one: the runner user of GitHub's actions-runner image and of
	// images/. Pods run with runAsNonRoot unless a pool asks for uid 0.
	DefaultRunAsUser = 1001
)

// Volume is one dataset volume of the pool.
type Volume struct {
	Kind     string // pvc, host or nfs
	Source   string // the claim, the host path, or the NFS export
	Server   string // the NFS server
	Target   string
	ReadOnly bool
}

// DecodeSection reads a pool's kubernetes section strictly, fills in the
// defaults and checks it, returning every problem found, each naming its
// field relative to the pool ("kubernetes.volumes[0]: ...").
// gpusPerRunner is the pool's gpus_per_runner.
func DecodeSection(raw json.RawMessage, gpusPerRunner int) (Section, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return Section{}, errors.New("kubernetes: is required with provider kubernetes (at least kubernetes.image)")
	}
	if raw = bytes.TrimSpace(raw); raw[0] != '{' {
		return Section{}, errors.New("kubernetes: must be a mapping")
	}
	var s Section
	errs := []error{config.Within("kubernetes", config.DecodeSection(raw, &s))}
	if s.Workdir == "" {
		s.Workdir = DefaultWorkdir
	}
	if s.KubeconfigData != "" {
		data, err := config.Expand(s.KubeconfigData)
		if err != nil {
			errs = append(errs, fmt.Errorf("kubernetes.kubeconfig_data: %w", err))
		}
		s.kubeconfig = secret.String(data)
	}
	if s.GPUResource == "" {
		s.GPUResource = DefaultGPUResource
	}
	if err := s.PendingTimeout.Check(); err != nil {
		errs = append(errs, fmt.Errorf("kubernetes.pending_timeout: %w", err))
	}
	if s.PendingTimeout.Duration <= 0 {
		s.PendingTimeout = config.D(DefaultPendingTimeout)
	}
	errs = append(errs, config.Within("kubernetes", errors.Join(s.validate()...)))
	if gpusPerRunner < 0 {
		errs = append(errs, errors.New("gpus_per_runner: must be a number of GPUs for kubernetes pods (the scheduler picks them), not all"))
	}
	return s, errors.Join(errs...)
}

func (s *Section) validate() []error {
	var errs []error
	add := func(field, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...)))
	}
	if s.Image == "" {
		add("image", "is required")
	}
	if s.InCluster && (s.Kubeconfig != "" || s.Context != "" || s.KubeconfigData != "") {
		add("in_cluster", "is set with kubeconfig, kubeconfig_data or context; keep one")
	}
	if s.Kubeconfig != "" && s.KubeconfigData != "" {
		add("kubeconfig_data", "is set with kubeconfig; keep one")
	}
	if s.Namespace != "" {
		for _, m := range validation.IsDNS1123Label(s.Namespace) {
			add("namespace", "%q: %s", s.Namespace, m)
		}
	}
	switch s.ImagePullPolicy {
	case "", corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
	default:
		add("image_pull_policy", "%q must be Always, IfNotPresent or Never", s.ImagePullPolicy)
	}
	if !path.IsAbs(s.Workdir) {
		add("workdir", "%q must be an absolute path", s.Workdir)
	}
	if s.WorkdirSizeLimit != "" {
		if _, err := resource.ParseQuantity(s.WorkdirSizeLimit); err != nil {
			add("workdir_size_limit", "%q is not a quantity", s.WorkdirSizeLimit)
		}
	}
	for field, q := range map[string]string{"request": s.EphemeralStorage.Request, "limit": s.EphemeralStorage.Limit} {
		if _, err := resource.ParseQuantity(q); q != "" && err != nil {
			add("ephemeral_storage."+field, "%q is not a quantity (\"20Gi\")", q)
		}
	}
	if r, l := s.EphemeralStorage.Request, s.EphemeralStorage.Limit; r != "" && l != "" {
		rq, err1 := resource.ParseQuantity(r)
		lq, err2 := resource.ParseQuantity(l)
		if err1 == nil && err2 == nil && rq.Cmp(lq) > 0 {
			add("ephemeral_storage.request", "%s is more than the limit %s", r, l)
		}
	}
	for k, v := range s.NodeSelector {
		for _, m := range validation.IsQualifiedName(k) {
			add("node_selector."+k, "%s", m)
		}
		for _, m := range validation.IsValidLabelValue(v) {
			add("node_selector."+k, "%q: %s", v, m)
		}
	}
	for i, v := range s.Volumes {
		if _, err := ParseVolume(v); err != nil {
			add(fmt.Sprintf("volumes[%d]", i), "%v", err)
		}
	}
	if err := (vm.Install{Agent: s.Install.Agent}).Check(); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, s.checkDind()...)
	if len(s.PodTemplate) > 0 && string(s.PodTemplate) != "null" {
		if err := s.checkTemplate(); err != nil {
			add("pod_template", "%v", err)
		}
	}
	return errs
}

// ParseVolume reads one entry of volumes.
func ParseVolume(s string) (Volume, error) {
	v := Volume{ReadOnly: true}
	parts := strings.Split(s, ":")
	if n := len(parts); n > 2 && (parts[n-1] == "rw" || parts[n-1] == "ro") {
		v.ReadOnly = parts[n-1] == "ro"
		parts = parts[:n-1]
	}
	switch {
	case len(parts) == 2 && strings.HasPrefix(parts[0], "/"):
		v.Kind, v.Source, v.Target = "host", parts[0], parts[1]
	case len(parts) == 3 && (parts[0] == "pvc" || parts[0] == "host"):
		v.Kind, v.Source, v.Target = parts[0], parts[1], parts[2]
	case len(parts) == 4 && parts[0] == "nfs":
		v.Kind, v.Server, v.Source, v.Target = "nfs", parts[1], parts[2], parts[3]
	default:
		return v, fmt.Errorf("%q is not pvc:<claim>:<target>, host:<path>:<target>, /<path>:<target> or nfs:<server>:<export>:<target> (with :rw to write)", s)
	}
	switch {
	case v.Source == "" || (v.Kind == "nfs" && v.Server == ""):
		return v, fmt.Errorf("%q has an empty source", s)
	case !path.IsAbs(v.Target):
		return v, fmt.Errorf("%q: the target %q must be an absolute path", s, v.Target)
	case v.Kind != "pvc" && !path.IsAbs(v.Source):
		return v, fmt.Errorf("%q: the path %q must be absolute", s, v.Source)
	case v.Kind == "pvc" && len(validation.IsDNS1123Subdomain(v.Source)) > 0:
		return v, fmt.Errorf("%q: %q is not a claim name", s, v.Source)
	}
	return v, nil
}

// checkTemplate checks that the overlay merges over a pod and leaves a
// pod (keys a Pod does not have are named), and that it keeps what
// carries the runner's credential, on a pod made for a runner with files
// and an environment. The agent's own variables are known only when a
// runner is made, and checked then too.
func (s Section) checkTemplate() error {
	raw := s.PodTemplate
	var probe map[string]json.RawMessage
	if err := json.Unmarshal(raw, &probe); err != nil {
		return fmt.Errorf("must be a mapping: %v", err)
	}
	merged, err := strategicpatch.StrategicMergePatch([]byte(`{}`), raw, corev1.Pod{})
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(merged))
	dec.DisallowUnknownFields()
	var pod corev1.Pod
	if err := dec.Decode(&pod); err != nil {
		return fmt.Errorf("is not a pod: %v", err)
	}
	s.PodTemplate = nil
	p := &Provider{opt: Options{Section: s}}
	base, err := p.podFor("probe", provider.Spec{Name: "probe", Command: "agent",
		Env: map[string]string{"RUNNER_TOKEN": "x"}, Files: map[string][]byte{".runner": nil}})
	if err != nil {
		return nil // the section's own errors are reported by validate
	}
	out, err := mergeTemplate(base, raw)
	if err != nil {
		return err
	}
	return kept(base, out)
}
