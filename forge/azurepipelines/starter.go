package azurepipelines

import (
	"cmp"
	"fmt"

	"github.com/runfleet/runfleet/forge"
)

// Starter is the forge's entry in `runfleet init`'s config.
func (driver) Starter(o forge.StarterOptions) forge.StarterEntry {
	return forge.StarterEntry{
		Keys: fmt.Sprintf(`    url: %s   # the organisation, or a collection of Azure DevOps Server
    # A personal access token with Agent Pools (read & manage). It stays
    # in the manager: each agent gets its own key and OAuth client.
    token: ${AZP_TOKEN}
    pool: %s   # the agent pool, by name or id
    # project: models   # where a job lost with its agent is re-run
`, cmp.Or(o.URL, "https://dev.azure.com/acme"), cmp.Or(o.Scope, "gpu")),
		TokenEnv: "AZP_TOKEN",
		Agent:    DefaultAgentPath,
		Image:    "runfleet/azure-pipelines-agent", // images/azure-pipelines-agent
	}
}
