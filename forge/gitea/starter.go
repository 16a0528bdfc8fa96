package gitea

import (
	"cmp"
	"fmt"

	"github.com/runfleet/runfleet/forge"
)

// Starter is the forge's entry in `runfleet init`'s config.
func (driver) Starter(o forge.StarterOptions) forge.StarterEntry {
	return forge.StarterEntry{
		Keys: fmt.Sprintf(`    url: %s   # Gitea or Forgejo, as this host reaches it
    # An API token of a user who administers the repository (scope
    # write:repository; write:organization with org:, write:admin with
    # scope: instance). It stays in the manager: runners get a
    # registration of their own. Or token_file: /run/secrets/gitea.
    token: ${GITEA_TOKEN}
    repo: %s   # owner/name; or org: NAME, or scope: instance
`, cmp.Or(o.URL, "https://gitea.example.com"), cmp.Or(o.Scope, "ml/models")),
		TokenEnv: "GITEA_TOKEN",
		Agent:    "gitea-runner",
		Image:    "runfleet/gitea-runner", // docker build -t runfleet/gitea-runner images/gitea-runner
	}
}
