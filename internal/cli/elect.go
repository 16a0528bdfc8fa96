//go:build provider_kubernetes || !(forge_azurepipelines || forge_bitbucket || forge_gitea || forge_github || forge_gitlab || provider_aws || provider_azure || provider_docker || provider_gcp || provider_kubernetes || provider_process || provider_slurm)

package cli

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/daemon"
	"github.com/runfleet/runfleet/kubeclient"
	"github.com/runfleet/runfleet/leader"
)

// Leader election takes turns on a Kubernetes Lease through client-go: it
// comes with the kubernetes driver, under its build tag.
func init() { runElected = elect }

// elect runs the fleet while this manager holds the config's Lease, and
// waits as a standby while another does.
func elect(ctx context.Context, fleet *daemon.Fleet, le *config.LeaderElection, log *slog.Logger) error {
	rc, ns, err := kubeclient.Config(kubeclient.Options{
		Kubeconfig: le.Kubeconfig, Context: le.Context, InCluster: le.InCluster, Namespace: le.Namespace, Field: "leader_election",
	})
	if err != nil {
		fleet.Close()
		return err
	}
	cs, err := kubeclient.New(rc)
	if err != nil {
		fleet.Close()
		return fmt.Errorf("leader_election: %w", err)
	}
	led := false
	fleet.LeaderAt(func(ctx context.Context) (string, error) { return leader.Advertised(ctx, cs, ns, le.Lease) })
	err = leader.Run(ctx, leader.Options{
		Client: cs, Namespace: ns, Lease: le.Lease, Identity: cmp.Or(le.Identity, leader.Identity()),
		LeaseDuration: le.LeaseDuration.Duration, RenewDeadline: le.RenewDeadline.Duration, RetryPeriod: le.RetryPeriod.Duration,
		Advertise: le.Advertise, Logger: log,
	}, func(ctx context.Context, lost <-chan struct{}) {
		led = true
		fleet.RunLeader(ctx, lost)
	})
	if !led {
		fleet.Close()
	}
	return err
}
