package docker

import (
	"cmp"
	"fmt"

	"github.com/runfleet/runfleet/provider"
)

// StarterRunnerHost is how a container reaches a forge on this host.
func (driver) StarterRunnerHost() string { return "host.docker.internal" }

// Starter is a Docker pool's keys in `runfleet init`'s config.
func (driver) Starter(o provider.StarterOptions) string {
	return fmt.Sprintf(`    # Each runner is a new container of the engine at DOCKER_HOST (the
    # local socket), removed with all its job wrote. The image holds the
    # forge's agent: build it from the repository's images/.
    provider: docker
    docker:
      image: %s
      # cpus: 4                         # at most the host's CPUs
      # memory: 8g
      # shm_size: 8g                    # PyTorch data loaders want more than 64m
      # volumes: ["/data/imagenet:/data"]   # read-only unless :rw is written
    # gpus_per_runner: 1                # a GPU of the host for each container
`, cmp.Or(o.Image, o.AgentImage, "runfleet/gitea-runner"))
}
