package bitbucket

import (
	"cmp"
	"fmt"
	"strings"

	"github.com/runfleet/runfleet/forge"
)

// Starter is the forge's entry in `runfleet init`'s config. Its scope is
// workspace/repository, or a workspace alone for workspace runners.
func (driver) Starter(o forge.StarterOptions) forge.StarterEntry {
	ws, repo, _ := strings.Cut(cmp.Or(o.Scope, "acme/models"), "/")
	keys := fmt.Sprintf(`    url: %s   # Bitbucket Cloud's API
    # A repository (or workspace) access token with the runner scopes
    # (pipeline and runner: read and write); or username: with an app
    # password or API token. It stays in the manager: each runner gets its
    # own OAuth client.
    token: ${BITBUCKET_TOKEN}
    workspace: %s
`, cmp.Or(o.URL, "https://api.bitbucket.org"), ws)
	if repo != "" {
		keys += "    repository: " + repo + "   # leave out for workspace runners (then repositories: [..] for demand)\n"
	}
	return forge.StarterEntry{
		Keys:     keys,
		TokenEnv: "BITBUCKET_TOKEN",
		Agent:    DefaultAgentPath,
		// Atlassian's own runner image; it needs the engine's socket.
		Image: RunnerImage,
	}
}
