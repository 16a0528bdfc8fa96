package kubernetes

import (
	"cmp"
	"fmt"

	"github.com/runfleet/runfleet/provider"
)

// Starter is a pod pool's keys in `runfleet init`'s config.
func (driver) Starter(o provider.StarterOptions) string {
	return fmt.Sprintf(`    # Each runner is a pod of its own, deleted after its one job. The
    # manager needs to create, watch and delete pods and Secrets in the
    # namespace (deploy/kubernetes/rbac.yaml).
    provider: kubernetes
    kubernetes:
      # kubeconfig: ~/.kube/config      # the default; or in_cluster: true
      namespace: ci
      image: %s   # the forge's agent, /bin/sh and cp
      resources: {requests: {cpu: "2", memory: 4Gi}, limits: {memory: 4Gi}}
      # volumes: ["pvc:datasets:/data"] # read-only unless :rw is written
    # gpus_per_runner: 1                # nvidia.com/gpu: 1 in each pod's limits
`, cmp.Or(o.Image, o.AgentImage, "runfleet/gitea-runner"))
}
