package github

import (
	"cmp"
	"fmt"
	"strings"

	"github.com/runfleet/runfleet/forge"
)

// Starter is the forge's entry in `runfleet init`'s config.
func (driver) Starter(o forge.StarterOptions) forge.StarterEntry {
	url := strings.TrimRight(cmp.Or(o.URL, "https://github.com"), "/") + "/" + cmp.Or(o.Scope, "acme/models")
	return forge.StarterEntry{
		Keys: fmt.Sprintf(`    # A repository's URL, or an organisation's (https://github.com/acme);
    # for Enterprise Server, https://HOST/OWNER/REPO.
    url: %s
    # A fine-grained token with the repository's "Administration: read
    # and write" (the organisation's "Self-hosted runners: read and
    # write" for an organisation), or a classic token with repo (admin:org).
    # It stays in the manager: each runner gets a just-in-time config good
    # for one job. Or a GitHub App: app_id, installation_id,
    # private_key_file.
    token: ${GITHUB_TOKEN}
    # mode: scaleset            # GitHub's runner scale sets instead of webhooks and polls
`, url),
		TokenEnv: "GITHUB_TOKEN",
		Agent:    "run.sh",
		Image:    "runfleet/github-runner", // images/github-runner
	}
}
