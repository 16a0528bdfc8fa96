package process

import "github.com/runfleet/runfleet/provider"

// Starter is a process pool's keys in `runfleet init`'s config.
func (driver) Starter(provider.StarterOptions) string {
	return `    # Each runner is a process of this host, in a fresh working directory
    # under workdir, removed after its one job. The forge's agent must be
    # in the PATH (gitea-runner, run.sh, gitlab-runner, ...) or named:
    provider: process
    # agent: {path: /usr/local/bin/gitea-runner}
    # gpus_per_runner: 1        # a GPU of this host for each runner, labelled gpu-<model>
`
}
