package process

import (
	"cmp"
	"fmt"
	"path"

	"github.com/runfleet/runfleet/provider"
)

// Starter is a process pool's keys in `runfleet init`'s config.
func (driver) Starter(o provider.StarterOptions) string {
	agent := cmp.Or(o.Agent, "the forge's agent")
	where := agent
	if path.Base(agent) == agent {
		where = "/usr/local/bin/" + agent
	}
	return fmt.Sprintf(`    # Each runner is a process of this host, in a fresh working directory
    # under workdir, removed after its one job. The forge's agent (%s)
    # must be in the PATH or named:
    provider: process
    # agent: {path: %s}
    # gpus_per_runner: 1        # a GPU of this host for each runner, labelled gpu-<model>
`, agent, where)
}
