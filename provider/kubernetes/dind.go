package kubernetes

import (
	"cmp"
	"fmt"
	"path"
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// DockerDind is the docker key's value that gives each runner pod a
// Docker daemon of its own.
const DockerDind = "dind"

// DefaultDindImage runs the daemon: Docker's official image. Docker 28,
// not 29: 29 refuses clients older than API 1.44 (Docker 25), which
// runner images still ship.
const DefaultDindImage = "docker:28-dind"

// Dind is a pool's dind section: the sidecar that runs the jobs' Docker
// daemon when docker is "dind".
type Dind struct {
	// Image runs dockerd: DefaultDindImage when empty. Its entrypoint
	// is given `dockerd --host=unix:///var/run/docker.sock --group=GID`
	// and it must have the docker CLI, which its startup probe runs.
	Image string `json:"image"`
	// SharedPaths are directories of the agent that its jobs' containers
	// mount by path (GitHub's runner mounts its _work directory into a
	// job's `container:`): an emptyDir at the same path in the agent and
	// the daemon, as the work directory and the datasets are.
	SharedPaths []string `json:"shared_paths"`
	// StorageSizeLimit bounds the daemon's storage, an emptyDir of its
	// own ("50Gi").
	StorageSizeLimit string `json:"storage_size_limit"`
}

// Names of the sidecar's parts.
const (
	dindContainer = "dind"
	dindSocket    = "dind-sock"
	dindStorage   = "dind-storage"
	// dindSocketDir holds the daemon's socket at the path agents and
	// job containers expect: GitHub's runner and gitea-runner mount
	// /var/run/docker.sock into a job's containers, from the daemon's
	// filesystem.
	dindSocketDir = "/var/run"
	dockerHost    = "unix:///var/run/docker.sock"
)

func sharedVolume(i int) string { return "dind-shared-" + strconv.Itoa(i) }

// checkDind checks the docker and dind keys.
func (s *Section) checkDind() []error {
	var errs []error
	add := func(field, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...)))
	}
	d := s.Dind
	switch s.Docker {
	case "", DockerDind:
	default:
		add("docker", "%q is not a Docker mode: \"dind\", or leave it out for none", s.Docker)
	}
	if s.Docker != DockerDind && (d.Image != "" || len(d.SharedPaths) > 0 || d.StorageSizeLimit != "") {
		add("dind", "is set but docker is not \"dind\"")
	}
	if d.StorageSizeLimit != "" {
		if _, err := resource.ParseQuantity(d.StorageSizeLimit); err != nil {
			add("dind.storage_size_limit", "%q is not a quantity (\"50Gi\")", d.StorageSizeLimit)
		}
	}
	for i, p := range d.SharedPaths {
		field := fmt.Sprintf("dind.shared_paths[%d]", i)
		switch c := path.Clean(p); {
		case !path.IsAbs(p):
			add(field, "%q must be an absolute path", p)
		case c == "/" || c == dindSocketDir || c == "/run" || c == "/var/lib/docker":
			add(field, "%q is the daemon's own or the root", p)
		case c == path.Clean(s.Workdir):
			add(field, "%q is the work directory, which is shared already", p)
		case slices.Contains(d.SharedPaths[:i], p):
			add(field, "%q is listed twice", p)
		}
	}
	return errs
}

// withDind adds the jobs' Docker daemon to a runner's pod: a native
// sidecar (an init container that restarts Always, Kubernetes 1.29 and
// later) that the kubelet starts before the agent, holds until its
// startup probe answers, and stops once the agent has ended, so that the
// pod ends with its agent. It runs privileged, as root: dockerd needs
// both. It shares with the agent the socket's directory, and at the same
// paths the work directory, the datasets (read-only as the agent has
// them) and the shared paths, since the daemon resolves a job's bind
// mounts in its own filesystem. The credential's volume is not its.
func (p *Provider) withDind(pod *corev1.Pod) {
	s := p.opt.Section
	if s.Docker != DockerDind {
		return
	}
	storage := &corev1.EmptyDirVolumeSource{}
	if s.Dind.StorageSizeLimit != "" {
		q := resource.MustParse(s.Dind.StorageSizeLimit) // checked by DecodeSection
		storage.SizeLimit = &q
	}
	pod.Spec.Volumes = append(pod.Spec.Volumes,
		corev1.Volume{Name: dindSocket, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
		corev1.Volume{Name: dindStorage, VolumeSource: corev1.VolumeSource{EmptyDir: storage}})
	shared := []corev1.VolumeMount{{Name: dindSocket, MountPath: dindSocketDir}}
	for i, dir := range s.Dind.SharedPaths {
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: sharedVolume(i), VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
		shared = append(shared, corev1.VolumeMount{Name: sharedVolume(i), MountPath: dir})
	}
	agent := &pod.Spec.Containers[0]
	agent.VolumeMounts = append(agent.VolumeMounts, shared...)
	agent.Env = append(agent.Env, corev1.EnvVar{Name: "DOCKER_HOST", Value: dockerHost})

	mounts := append(slices.Clone(shared), corev1.VolumeMount{Name: dindStorage, MountPath: "/var/lib/docker"})
	for _, m := range agent.VolumeMounts {
		if m.Name == workVolume || isDataVolume(m.Name) {
			mounts = append(mounts, m)
		}
	}
	// The socket's group is the pod's fsGroup, which the kubelet gives
	// every container of the pod: the agent's user may use it.
	group := int64(DefaultFSGroup)
	if sc := pod.Spec.SecurityContext; sc != nil && sc.FSGroup != nil {
		group = *sc.FSGroup
	}
	always := corev1.ContainerRestartPolicyAlways
	pod.Spec.InitContainers = append(pod.Spec.InitContainers, corev1.Container{
		Name:            dindContainer,
		Image:           cmp.Or(s.Dind.Image, DefaultDindImage),
		ImagePullPolicy: s.ImagePullPolicy,
		Args:            []string{"dockerd", "--host=" + dockerHost, "--group=" + strconv.FormatInt(group, 10)},
		// No TLS: the daemon listens on its socket only.
		Env:           []corev1.EnvVar{{Name: "DOCKER_TLS_CERTDIR", Value: ""}},
		RestartPolicy: &always,
		SecurityContext: &corev1.SecurityContext{
			Privileged:   new(true),
			RunAsUser:    new(int64(0)),
			RunAsGroup:   new(int64(0)),
			RunAsNonRoot: new(false),
		},
		StartupProbe: &corev1.Probe{
			ProbeHandler:     corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"docker", "info"}}},
			PeriodSeconds:    1,
			TimeoutSeconds:   5,
			FailureThreshold: 120,
		},
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		VolumeMounts:             mounts,
	})
}

// sidecarsDropped says why a pod as the apiserver stored it lacks the
// sidecar's restartPolicy: an apiserver without native sidecars (before
// Kubernetes 1.29, or the SidecarContainers gate off) drops the field,
// and the daemon would then hold the pod in its init phase for ever.
func sidecarsDropped(pod *corev1.Pod) string {
	for _, c := range pod.Spec.InitContainers {
		if c.Name == dindContainer && c.RestartPolicy == nil {
			return "docker: dind needs native sidecar containers (Kubernetes 1.29 or later); this cluster dropped the dind container's restartPolicy"
		}
	}
	return ""
}
