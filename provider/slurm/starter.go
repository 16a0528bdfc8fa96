package slurm

import "github.com/runfleet/runfleet/provider"

// Starter is a Slurm pool's keys in `runfleet init`'s config.
func (driver) Starter(provider.StarterOptions) string {
	return `    # Each runner is a batch job (sbatch) running the forge's agent on a
    # node; the manager runs as an ordinary user of the cluster, and the
    # nodes must see its spool_dir and the agent's path.
    provider: slurm
    slurm:
      # partition: gpu
      # account: ml
      # --time is max_lifetime and one job (the pool's job_timeout, or
      # the forge's limit), within the partition's MaxTime.
      cpus: 4
      memory: 16G
    # gpus_per_runner: 1                # --gres=gpu:1
`
}
