package gitlab

import (
	"cmp"
	"fmt"

	"github.com/runfleet/runfleet/forge"
)

// Starter is the forge's entry in `runfleet init`'s config.
func (driver) Starter(o forge.StarterOptions) forge.StarterEntry {
	return forge.StarterEntry{
		Keys: fmt.Sprintf(`    url: %s   # or https://gitlab.com
    # A personal, project or group access token with the create_runner and
    # manage_runner scopes (or api), of a Maintainer. It stays in the
    # manager: each runner gets a glrt- token of its own, deleted after
    # its job.
    token: ${GITLAB_TOKEN}
    project: %s   # full path or id; or group: acme, or scope: instance (an admin's token)
    # webhook_secret: ${GITLAB_HOOK_SECRET}   # a Job Hook to /webhook/<name>, for demand without polling
`, cmp.Or(o.URL, "https://gitlab.example.com"), cmp.Or(o.Scope, "acme/models")),
		TokenEnv: "GITLAB_TOKEN",
		Agent:    "gitlab-runner",
		Image:    "runfleet/gitlab-runner", // images/gitlab-runner
	}
}
