package cli

// The drivers built into runfleet: each registers itself with the forge
// or provider registry. A new driver is added here, and nowhere else
// outside its own package.
import (
	_ "github.com/runfleet/runfleet/forge/azurepipelines"
	_ "github.com/runfleet/runfleet/forge/bitbucket"
	_ "github.com/runfleet/runfleet/forge/gitea"
	_ "github.com/runfleet/runfleet/forge/github"
	_ "github.com/runfleet/runfleet/forge/gitlab"
	_ "github.com/runfleet/runfleet/provider/aws"
	_ "github.com/runfleet/runfleet/provider/azure"
	_ "github.com/runfleet/runfleet/provider/docker"
	_ "github.com/runfleet/runfleet/provider/gcp"
	_ "github.com/runfleet/runfleet/provider/kubernetes"
	_ "github.com/runfleet/runfleet/provider/process"
	_ "github.com/runfleet/runfleet/provider/slurm"
)
