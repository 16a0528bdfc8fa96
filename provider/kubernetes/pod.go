package kubernetes

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/strategicpatch"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/record"
)

// Labels on every pod and Secret: List finds a manager's pods by them
// after a restart, and `runfleet gc` what a crash left.
const (
	LabelManager = "runfleet.dev/manager"
	LabelPool    = "runfleet.dev/pool"
	LabelRunner  = "runfleet.dev/runner" // the runner's name, <pool>-<slot>
	labelManaged = "app.kubernetes.io/managed-by"
)

// Names of the pod's parts.
const (
	agentContainer = "runner"
	filesContainer = "files"
	filesVolume    = "runfleet-files"
	workVolume     = "work"
	agentVolume    = "agent" // the agent fetched for a stock image
	filesMount     = "/run/runfleet/files"
)

// podLabels are the labels of a runner's pod and Secret.
func podLabels(spec provider.Spec) map[string]string {
	return map[string]string{
		LabelManager: spec.Manager,
		LabelPool:    spec.Pool,
		LabelRunner:  spec.Name,
		labelManaged: "runfleet",
	}
}

// secretKeys names the Secret's keys: the agent's environment as
// env.<NAME>, its files as file.<n> in the order of their sorted paths.
func envKey(name string) string { return "env." + name }
func fileKey(i int) string      { return "file." + strconv.Itoa(i) }

// runnerSecret holds everything of the spec that may be a credential: the
// agent's files and its environment's values. The pod refers to it by
// name and key, so no value shows in the pod's spec.
func runnerSecret(name string, spec provider.Spec) *corev1.Secret {
	data := map[string][]byte{}
	for k, v := range spec.Env {
		data[envKey(k)] = []byte(v)
	}
	for i, rel := range slices.Sorted(maps.Keys(spec.Files)) {
		data[fileKey(i)] = spec.Files[rel]
	}
	immutable := true
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: podLabels(spec)},
		Type:       corev1.SecretTypeOpaque,
		Immutable:  &immutable,
		Data:       data,
	}
}

// ownedBy makes a Secret go with its pod: the garbage collector deletes
// it when the pod is deleted.
func ownedBy(s *corev1.Secret, pod *corev1.Pod) {
	s.OwnerReferences = []metav1.OwnerReference{{
		APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID,
	}}
}

// podFor builds a runner's pod, named name, from the pool's section and
// the spec; its Secret has the same name.
func (p *Provider) podFor(name string, spec provider.Spec) (*corev1.Pod, error) {
	s := p.opt.Section
	files, err := filesScript(s.Workdir, spec.Files)
	if err != nil {
		return nil, err
	}
	files = installScript(s.Install.Agent) + files
	image, res, gpus := p.shaped(spec)
	agent := corev1.Container{
		Name:            agentContainer,
		Image:           image,
		ImagePullPolicy: s.ImagePullPolicy,
		Command:         []string{spec.Command},
		Args:            spec.Args,
		WorkingDir:      s.Workdir,
		Resources:       res,
		SecurityContext: s.ContainerSecurityContext,
		VolumeMounts:    []corev1.VolumeMount{{Name: workVolume, MountPath: s.Workdir}},
	}
	for i, v := range p.opt.volumes {
		agent.VolumeMounts = append(agent.VolumeMounts, corev1.VolumeMount{Name: dataVolume(i), MountPath: v.Target, ReadOnly: v.ReadOnly})
	}
	if s.Install.Agent.URL != "" {
		agent.VolumeMounts = append(agent.VolumeMounts, agentMount)
	}
	for _, k := range slices.Sorted(maps.Keys(spec.Env)) {
		agent.Env = append(agent.Env, corev1.EnvVar{Name: k, ValueFrom: &corev1.EnvVarSource{
			SecretKeyRef: &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: name}, Key: envKey(k)},
		}})
	}
	if spec.Record != nil {
		agent.Env = append(agent.Env, nodeEnv)
	}
	if n := gpus; n > 0 {
		if agent.Resources.Limits == nil {
			agent.Resources.Limits = corev1.ResourceList{}
		}
		if _, set := agent.Resources.Limits[s.GPUResource]; !set || spec.Request.GPUs > 0 {
			agent.Resources.Limits[s.GPUResource] = *resource.NewQuantity(int64(n), resource.DecimalSI)
		}
	}
	init := p.filesContainer(spec, image, files, res)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: podLabels(spec)},
		Spec: corev1.PodSpec{
			RestartPolicy:                corev1.RestartPolicyNever,
			InitContainers:               []corev1.Container{init},
			Containers:                   []corev1.Container{agent},
			Volumes:                      p.volumes(name, spec),
			NodeSelector:                 maps.Clone(s.NodeSelector),
			Tolerations:                  slices.Clone(s.Tolerations),
			Affinity:                     s.Affinity,
			PriorityClassName:            s.PriorityClassName,
			ServiceAccountName:           s.ServiceAccountName,
			AutomountServiceAccountToken: &s.AutomountServiceAccountToken,
			SecurityContext:              podSecurity(s.SecurityContext, s.ContainerSecurityContext),
			EnableServiceLinks:           new(false), // the namespace's services are no business of a job
		},
	}
	if s.RuntimeClassName != "" {
		pod.Spec.RuntimeClassName = &s.RuntimeClassName
	}
	p.withDind(pod)
	for _, sec := range s.ImagePullSecrets {
		pod.Spec.ImagePullSecrets = append(pod.Spec.ImagePullSecrets, corev1.LocalObjectReference{Name: sec})
	}
	if d := deadline(p.opt.MaxLifetime); d > 0 {
		secs := int64((d + time.Second - 1) / time.Second)
		pod.Spec.ActiveDeadlineSeconds = &secs
	}
	return p.overlay(pod, spec)
}

// agentMount is where the agent fetched for a stock image is.
var agentMount = corev1.VolumeMount{Name: agentVolume, MountPath: vm.AgentDir}

// filesContainer is the pod's init container: it runs script (the agent
// fetched where the image lacks it, the runner's files copied) in the
// agent's image, with the agent's resources less the GPUs.
func (p *Provider) filesContainer(spec provider.Spec, image, script string, res corev1.ResourceRequirements) corev1.Container {
	s := p.opt.Section
	c := corev1.Container{
		Name:            filesContainer,
		Image:           image,
		ImagePullPolicy: s.ImagePullPolicy,
		Command:         []string{"/bin/sh", "-c", script},
		SecurityContext: s.ContainerSecurityContext,
		// Its last lines (a failed fetch, a checksum mismatch) become
		// its status's message, for the pool's reason.
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		// The pod's requests are the larger of its init containers'
		// and the sum of the others': the same, less the GPUs, add
		// nothing and satisfy a namespace that asks for limits.
		Resources: withoutResource(res, s.GPUResource),
		VolumeMounts: []corev1.VolumeMount{
			{Name: filesVolume, MountPath: filesMount, ReadOnly: true},
			{Name: workVolume, MountPath: s.Workdir},
		},
	}
	if spec.Record != nil {
		c.Env = append(c.Env, nodeEnv)
	}
	if s.Install.Agent.URL != "" {
		c.VolumeMounts = append(c.VolumeMounts, agentMount)
	}
	return c
}

// podSecurity is the pool's pod security context with runfleet's
// defaults for what it leaves out:
//   - an fsGroup: a real kubelet writes a Secret volume's files as root,
//     readable by nobody else at mode 0400, and only a pod's fsGroup makes
//     them the group's (and adds the group to every container's): without
//     one, a runner image that runs as a user of its own (GitHub's
//     actions-runner, uid 1001) cannot read its credential. OnRootMismatch
//     spares a large writable dataset volume the kubelet's walk of every
//     file at each start; read-only ones are not walked at all.
//   - runAsNonRoot, so that a job is never root in its pod, with runAsUser
//     DefaultRunAsUser: GitHub's image names its user ("runner"), which the
//     kubelet cannot check against runAsNonRoot without a uid. A pool that
//     sets runAsUser 0 (in either context) is a root pool, and asked for it.
func podSecurity(sc *corev1.PodSecurityContext, csc *corev1.SecurityContext) *corev1.PodSecurityContext {
	out := &corev1.PodSecurityContext{}
	if sc != nil {
		out = sc.DeepCopy()
	}
	if out.FSGroup == nil {
		out.FSGroup = new(int64(DefaultFSGroup))
	}
	if out.FSGroupChangePolicy == nil {
		out.FSGroupChangePolicy = new(corev1.FSGroupChangeOnRootMismatch)
	}
	user := out.RunAsUser
	if csc != nil && csc.RunAsUser != nil {
		user = csc.RunAsUser
	}
	if user == nil {
		out.RunAsUser = new(int64(DefaultRunAsUser))
	}
	if out.RunAsNonRoot == nil && (csc == nil || csc.RunAsNonRoot == nil) {
		out.RunAsNonRoot = new(user == nil || *user != 0)
	}
	return out
}

// deadline is the pod's activeDeadlineSeconds for a pool's max_lifetime:
// the last resort, which holds also when the manager is gone. The pool
// replaces idle pods at max_lifetime, so a pod may take a job just before
// then; that job gets as long again, and at least an hour, before the
// kubelet kills it.
func deadline(maxLifetime time.Duration) time.Duration {
	if maxLifetime <= 0 {
		return 0
	}
	return maxLifetime + max(maxLifetime, time.Hour)
}

func dataVolume(i int) string { return "data-" + strconv.Itoa(i) }

// isDataVolume says whether a volume is one of the pool's datasets.
func isDataVolume(name string) bool { return strings.HasPrefix(name, "data-") }

// volumes are the pod's: its work directory, its files (from its
// Secret, the agent may read them only), and the pool's datasets.
func (p *Provider) volumes(name string, spec provider.Spec) []corev1.Volume {
	s := p.opt.Section
	work := &corev1.EmptyDirVolumeSource{}
	if s.WorkdirSizeLimit != "" {
		q := resource.MustParse(s.WorkdirSizeLimit) // checked by DecodeSection
		work.SizeLimit = &q
	}
	mode := int32(0o400)
	var items []corev1.KeyToPath
	for i := range len(spec.Files) {
		items = append(items, corev1.KeyToPath{Key: fileKey(i), Path: strconv.Itoa(i)})
	}
	vols := []corev1.Volume{
		{Name: workVolume, VolumeSource: corev1.VolumeSource{EmptyDir: work}},
		{Name: filesVolume, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName: name, Items: items, DefaultMode: &mode,
		}}},
	}
	if s.Install.Agent.URL != "" {
		vols = append(vols, corev1.Volume{Name: agentVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
	}
	for i, v := range p.opt.volumes {
		var src corev1.VolumeSource
		switch v.Kind {
		case "pvc":
			src.PersistentVolumeClaim = &corev1.PersistentVolumeClaimVolumeSource{ClaimName: v.Source, ReadOnly: v.ReadOnly}
		case "nfs":
			src.NFS = &corev1.NFSVolumeSource{Server: v.Server, Path: v.Source, ReadOnly: v.ReadOnly}
		default:
			src.HostPath = &corev1.HostPathVolumeSource{Path: v.Source}
		}
		vols = append(vols, corev1.Volume{Name: dataVolume(i), VolumeSource: src})
	}
	return vols
}

// filesScript is the init container's script: it copies the runner's
// files from the read-only Secret volume into the writable work
// directory (agents rewrite their registration file), readable and
// writable by the agent's user only.
func filesScript(workdir string, files map[string][]byte) (string, error) {
	var b strings.Builder
	b.WriteString("set -e; umask 077")
	for i, rel := range slices.Sorted(maps.Keys(files)) {
		clean := path.Clean(rel)
		if rel == "" || path.IsAbs(rel) || clean == "." || clean == ".." || strings.HasPrefix(clean, "../") {
			return "", fmt.Errorf("file %q is not inside the working directory", rel)
		}
		dst, src := path.Join(workdir, clean), path.Join(filesMount, strconv.Itoa(i))
		fmt.Fprintf(&b, "; mkdir -p %s", quote(path.Dir(dst)))
		if rel == record.File {
			// The node the pod landed on, known only now (RUNFLEET_NODE,
			// from the downward API).
			fmt.Fprintf(&b, "; sed \"s/%s/$RUNFLEET_NODE/\" %s > %s || cp %[2]s %[3]s", record.NodeMark, quote(src), quote(dst))
		} else {
			fmt.Fprintf(&b, "; cp %s %s", quote(src), quote(dst))
		}
		fmt.Fprintf(&b, "; chmod 600 %s", quote(dst))
	}
	return b.String(), nil
}

// installScript is the init container's first lines where the image
// lacks the agent: the file fetched (curl, or wget where there is no curl)
// into the agent's volume, its SHA-256 checked, then unpacked (a tarball)
// or made a program. A failure ends the init container with a line that
// says what failed, which its status carries to the pool.
func installScript(d vm.Download) string {
	if d.URL == "" {
		return ""
	}
	var b strings.Builder
	dl := path.Join(vm.AgentDir, ".download")
	fail := func(msg string) string { return "{ echo " + quote(msg) + " >&2; exit 1; }" }
	fmt.Fprintf(&b, "{ curl -fsSL --retry 5 --retry-connrefused -o %[1]s %[2]s 2>/dev/null || wget -q -O %[1]s %[2]s; } || %[3]s; ",
		dl, quote(d.URL), fail("could not fetch the agent from "+d.URL))
	fmt.Fprintf(&b, "[ \"$(sha256sum %s | cut -d' ' -f1)\" = %s ] || %s; ", dl, d.SHA256,
		fail("the agent from "+d.URL+": its SHA-256 is not "+d.SHA256+" (checksum mismatch)"))
	if strings.HasSuffix(d.URL, ".tar.gz") || strings.HasSuffix(d.URL, ".tgz") {
		fmt.Fprintf(&b, "tar -xzf %s -C %s && rm %[1]s || %s; ", dl, vm.AgentDir, fail("could not unpack the agent"))
	} else {
		fmt.Fprintf(&b, "mv %s %s && chmod 0755 %[2]s || %s; ", dl, quote(path.Join(vm.AgentDir, path.Base(d.URL))), fail("could not install the agent"))
	}
	return b.String()
}

// nodeEnv gives a container the node its pod runs on.
var nodeEnv = corev1.EnvVar{Name: "RUNFLEET_NODE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}}

// withRecord fills a runner's record with what its pod is given (image,
// limits, datasets) and adds it to the spec's files and environment; the
// file names the node once the pod has one.
func (p *Provider) withRecord(spec provider.Spec) provider.Spec {
	if spec.Record == nil {
		return spec
	}
	s := p.opt.Section
	image, res, _ := p.shaped(spec)
	m := &spec.Record.Machine
	m.Image = image
	if q, ok := res.Limits[corev1.ResourceCPU]; ok {
		m.CPUs = q.String()
	}
	if q, ok := res.Limits[corev1.ResourceMemory]; ok {
		m.Memory = q.String()
	}
	m.Datasets = nil
	for _, v := range p.opt.volumes {
		m.Datasets = append(m.Datasets, record.Mount{Source: v.Kind + ":" + v.Source, Target: v.Target, ReadOnly: v.ReadOnly})
	}
	return spec.WithRecordOnNode(s.Workdir)
}

// quote quotes a string for sh.
func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func withoutResource(r corev1.ResourceRequirements, name corev1.ResourceName) corev1.ResourceRequirements {
	out := *r.DeepCopy()
	delete(out.Limits, name)
	delete(out.Requests, name)
	return out
}

// overlay merges the pool's pod_template over the pod, then restores what
// runfleet relies on: its name, labels and restart policy. A template that
// would drop or change the runner's credential (its Secret volume, the
// init container that copies it, the agent's mounts of runfleet's volumes,
// the agent's environment) is refused (kept): the docs promise that
// runfleet keeps them, and a pod without them starts a runner that never
// registers, or one holding what it should not.
func (p *Provider) overlay(pod *corev1.Pod, spec provider.Spec) (*corev1.Pod, error) {
	tmpl := p.opt.Section.PodTemplate
	if len(tmpl) == 0 || string(tmpl) == "null" {
		return pod, nil
	}
	out, err := mergeTemplate(pod, tmpl)
	if err != nil {
		return nil, fmt.Errorf("kubernetes.pod_template: %w", err)
	}
	if err := kept(pod, out); err != nil {
		return nil, fmt.Errorf("%w: kubernetes.pod_template: %w", provider.ErrRejected, err)
	}
	// The merge puts the template's init containers first; the
	// runner's files are copied before any of them runs.
	if i := slices.IndexFunc(out.Spec.InitContainers, func(c corev1.Container) bool { return c.Name == filesContainer }); i > 0 {
		files := out.Spec.InitContainers[i]
		out.Spec.InitContainers = slices.Insert(slices.Delete(out.Spec.InitContainers, i, i+1), 0, files)
	}
	out.Name, out.Namespace, out.GenerateName = pod.Name, "", ""
	if out.Labels == nil {
		out.Labels = map[string]string{}
	}
	maps.Copy(out.Labels, podLabels(spec))
	out.Spec.RestartPolicy = corev1.RestartPolicyNever
	return out, nil
}

// mergeTemplate is a strategic merge of tmpl over pod.
func mergeTemplate(pod *corev1.Pod, tmpl json.RawMessage) (*corev1.Pod, error) {
	orig, err := json.Marshal(pod)
	if err != nil {
		return nil, err
	}
	merged, err := strategicpatch.StrategicMergePatch(orig, tmpl, corev1.Pod{})
	if err != nil {
		return nil, err
	}
	var out corev1.Pod
	if err := json.Unmarshal(merged, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// kept says what of runfleet's pod a merged template dropped or changed,
// of what carries or guards the runner's credential.
func kept(pod, merged *corev1.Pod) error {
	for _, v := range pod.Spec.Volumes {
		i := slices.IndexFunc(merged.Spec.Volumes, func(m corev1.Volume) bool { return m.Name == v.Name })
		if v.Name != filesVolume && v.Name != workVolume && v.Name != agentVolume && v.Name != dindSocket {
			continue
		}
		if i < 0 || !equality.Semantic.DeepEqual(v, merged.Spec.Volumes[i]) {
			return fmt.Errorf("spec.volumes: %q is runfleet's (the runner's credential, work directory, agent or Docker socket) and may not be replaced or removed", v.Name)
		}
	}
	for _, c := range pod.Spec.InitContainers {
		if !slices.ContainsFunc(merged.Spec.InitContainers, func(m corev1.Container) bool { return equality.Semantic.DeepEqual(m, c) }) {
			what := "copies the runner's credential"
			if c.Name == dindContainer {
				what = "runs the jobs' Docker daemon"
			}
			return fmt.Errorf("spec.initContainers: %q %s and may not be changed or removed", c.Name, what)
		}
	}
	agent := pod.Spec.Containers[0]
	i := slices.IndexFunc(merged.Spec.Containers, func(c corev1.Container) bool { return c.Name == agentContainer })
	if i < 0 {
		return fmt.Errorf("spec.containers: %q runs the agent and may not be removed", agentContainer)
	}
	got := merged.Spec.Containers[i]
	for _, m := range agent.VolumeMounts {
		if !slices.ContainsFunc(got.VolumeMounts, func(g corev1.VolumeMount) bool { return equality.Semantic.DeepEqual(g, m) }) {
			return fmt.Errorf("spec.containers[%s].volumeMounts: the mount of %q at %s may not be changed or removed", agentContainer, m.Name, m.MountPath)
		}
	}
	for _, e := range agent.Env {
		if !slices.ContainsFunc(got.Env, func(g corev1.EnvVar) bool { return equality.Semantic.DeepEqual(g, e) }) {
			return fmt.Errorf("spec.containers[%s].env: %s is the agent's (its credential, its node or its Docker) and may not be changed or removed", agentContainer, e.Name)
		}
	}
	return nil
}

// shaped is a runner's image, resources and GPUs: the pool's, or what its
// job asked for (a dynamic pool), as the container's limits and requests.
func (p *Provider) shaped(spec provider.Spec) (string, corev1.ResourceRequirements, int) {
	s, req := p.opt.Section, spec.Request
	res := *s.Resources.DeepCopy()
	set := func(name corev1.ResourceName, q resource.Quantity) {
		if res.Limits == nil {
			res.Limits = corev1.ResourceList{}
		}
		if res.Requests == nil {
			res.Requests = corev1.ResourceList{}
		}
		res.Limits[name], res.Requests[name] = q, q
	}
	for _, e := range []struct {
		q    string
		list *corev1.ResourceList
	}{{s.EphemeralStorage.Request, &res.Requests}, {s.EphemeralStorage.Limit, &res.Limits}} {
		q, list := e.q, e.list
		if q == "" {
			continue
		}
		if *list == nil {
			*list = corev1.ResourceList{}
		}
		(*list)[corev1.ResourceEphemeralStorage] = resource.MustParse(q) // checked by DecodeSection
	}
	if req.CPUs > 0 {
		set(corev1.ResourceCPU, *resource.NewMilliQuantity(int64(req.CPUs*1000), resource.DecimalSI))
	}
	if req.Memory > 0 {
		set(corev1.ResourceMemory, *resource.NewQuantity(req.Memory, resource.BinarySI))
	}
	return cmp.Or(req.Image, s.Image), res, cmp.Or(req.GPUs, p.opt.GPUs)
}

// Honours says what a job of a dynamic pool may ask its pod to be: its
// image, CPU and memory (limits and requests) and its GPUs (the pool's GPU
// resource).
func (p *Provider) Honours() []string {
	return []string{dynamic.KeyGPUs, dynamic.KeyCPU, dynamic.KeyMem, dynamic.KeyImage}
}
