package azurepipelines

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"fmt"
	"maps"
	"net/http"
	"strings"

	"github.com/microsoft/azure-devops-go-api/azuredevops/v7/taskagent"
)

// Azure DevOps fails a queued job at once ("No agent found in pool ...
// which satisfies the specified demands") when no agent registered in the
// pool, whatever its state, has the capabilities it demands. A pool that
// scales from zero, or whose agents are all deleted after their jobs,
// would see its jobs fail before it could start an agent for them. Each
// pool therefore keeps a placeholder: an agent registered with the pool's
// capabilities and never run, as KEDA's scaler has its users do
// (kedacore/keda-docs, scalers/azure-pipelines, "placeholder agent").
// It is disabled, and its private key is dropped as it is made: no job
// can ever be given to it, and nothing can connect as it.

// placeholderName is a pool's placeholder agent: outside its runners'
// names (<pool>-<n>), so that neither the pool nor `runfleet gc` removes
// it.
func placeholderName(pool string) string { return pool + "-placeholder" }

// Placehold registers the pool's placeholder agent, or gives the one there
// the pool's capabilities (forge.Placeholder).
func (d *Forge) Placehold(ctx context.Context, pool string, labels []string) error {
	api, poolID, err := d.pool(ctx)
	if err != nil {
		return err
	}
	name := placeholderName(pool)
	caps := capabilities(labels)
	caps[CapManager] = d.cfg.Manager
	caps[CapPool] = pool
	caps[CapPlaceholder] = capTrue
	agents, err := d.listAgents(ctx)
	if err != nil {
		return err
	}
	for _, a := range agents {
		if a.Name == nil || !strings.EqualFold(*a.Name, name) {
			continue
		}
		if a.UserCapabilities != nil && maps.Equal(*a.UserCapabilities, caps) {
			return nil
		}
		id := *a.Id
		err := d.call(ctx, "update placeholder agent "+name, func(ctx context.Context) error {
			_, err := api.UpdateAgent(ctx, taskagent.UpdateAgentArgs{PoolId: &poolID, AgentId: &id,
				Agent: &taskagent.TaskAgent{Id: &id, UserCapabilities: &caps}})
			return err
		})
		if err != nil {
			return rejectDefinitive(err)
		}
		d.log.Info("azure-pipelines: placeholder agent given the pool's capabilities", "agent", name, "pool", pool)
		return nil
	}
	key, err := rsa.GenerateKey(rand.Reader, keyBits)
	if err != nil {
		return fmt.Errorf("azure-pipelines: placeholder key: %w", err)
	}
	agent := d.newAgent(name, &key.PublicKey, caps)
	agent.Enabled = new(false)
	err = d.call(ctx, "add placeholder agent "+name, func(ctx context.Context) error {
		_, err := api.AddAgent(ctx, taskagent.AddAgentArgs{Agent: &agent, PoolId: &poolID})
		return err
	})
	if status(err) == http.StatusConflict {
		// Not among this manager's agents, yet there.
		return fmt.Errorf("azure-pipelines: the agent pool has an agent named %s that is not this manager's placeholder: rename it, or give this pool another name: %w", name, err)
	}
	if err != nil {
		return rejectDefinitive(err)
	}
	d.log.Info("azure-pipelines: placeholder agent registered, so that the pool's jobs queue while it has no agent", "agent", name, "pool", pool)
	return nil
}
