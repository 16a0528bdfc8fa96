//go:build provider_slurm || !(forge_azurepipelines || forge_bitbucket || forge_gitea || forge_github || forge_gitlab || provider_aws || provider_azure || provider_docker || provider_gcp || provider_kubernetes || provider_process || provider_slurm)

package cli

// See drivers.go.
import _ "github.com/runfleet/runfleet/provider/slurm"
