package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/internal/daemon"
)

// GPUUnit is one GPU, or one MIG device, in `runfleet gpus`.
type GPUUnit struct {
	ID         string `json:"id"`
	GPU        int    `json:"gpu"`
	MIG        *int   `json:"mig,omitempty"`
	Name       string `json:"name"`
	MemoryMiB  uint64 `json:"memory_mib"`
	MIGProfile string `json:"mig_profile,omitempty"`
	// Runner holds it; empty when free.
	Runner string `json:"runner,omitempty"`
}

// GPUReport is `runfleet gpus -o json`.
type GPUReport struct {
	gpu.Inventory
	NVML  bool      `json:"nvml_built"`
	Units []GPUUnit `json:"units"`
}

func gpusCmd() *cobra.Command {
	var path, output, smi string
	cmd := &cobra.Command{
		Use:   "gpus",
		Short: "Show this host's GPUs, the CUDA version its driver supports, and which runner holds which GPU",
		Long: `gpus reads the host's GPUs (through NVML when built with the nvml tag,
else through nvidia-smi -q -x): each GPU, or each MIG device of a GPU in
MIG mode, is what a runner is given. With -c, it also shows which runner
of that configuration's manager holds each one, from the containers' labels
and the processes' records.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" {
				return &ExitError{ExitUsage, fmt.Errorf("-o: %q is not table or json", output)}
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), time.Minute)
			defer cancel()
			holders := map[string]string{}
			shareVM := false
			if path != "" {
				cfg, err := loadConfig(path)
				if err != nil {
					return err
				}
				if smi == "" {
					smi = cfg.GPU.NvidiaSMI
				}
				shareVM = cfg.GPU.AllowHostVGPU
				fleet, err := daemon.Inspect(ctx, cfg, slog.New(slog.DiscardHandler))
				if err != nil {
					return &ExitError{ExitUsage, err}
				}
				defer fleet.Close()
				if holders, err = fleet.Holders(ctx); err != nil {
					return err
				}
			}
			inv := gpu.Detect(ctx, smi)
			inv.ShareVMGPUs = shareVM
			rep := report(inv, holders)
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(rep); err != nil {
					return err
				}
			} else {
				printGPUs(cmd.OutOrStdout(), rep)
			}
			if rep.Error != "" {
				// Unlike a host without GPUs, this says nothing of the
				// host: a script must be able to tell.
				return fmt.Errorf("could not read the GPUs: %s", rep.Error)
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&path, "config", "c", "", "config file (YAML), to show which runner holds each GPU")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	cmd.Flags().StringVar(&smi, "nvidia-smi", "", "read the GPUs from this nvidia-smi instead of NVML")
	return cmd
}

func report(inv gpu.Inventory, holders map[string]string) GPUReport {
	rep := GPUReport{Inventory: inv, NVML: gpu.NVMLBuilt(), Units: []GPUUnit{}}
	if rep.GPUs == nil {
		rep.GPUs = []gpu.Device{}
	}
	for _, u := range inv.Units() {
		gu := GPUUnit{ID: u.ID, GPU: u.Device.Index, Name: u.Device.Name, MemoryMiB: u.Device.MemoryMiB, Runner: holders[u.ID]}
		if u.MIG != nil {
			idx := u.MIG.Index
			gu.MIG, gu.MemoryMiB, gu.MIGProfile = &idx, u.MIG.MemoryMiB, u.MIG.Profile
		}
		rep.Units = append(rep.Units, gu)
	}
	return rep
}

func printGPUs(w io.Writer, rep GPUReport) {
	for _, d := range rep.GPUs {
		if why, ok := rep.Skipped[d.UUID]; ok && !rep.ShareVMGPUs {
			fmt.Fprintf(w, "GPU %d (%s) is not handed out: %s\n", d.Index, d.UUID, why)
		}
	}
	if rep.Error != "" {
		fmt.Fprintf(w, "GPUs unreadable: %s\n", rep.Error)
		return
	}
	if len(rep.Units) == 0 {
		fmt.Fprintf(w, "no GPU: %s\n", rep.Reason)
		if rep.Driver != "" {
			fmt.Fprintf(w, "driver %s, CUDA %s\n", rep.Driver, rep.CUDA)
		}
		return
	}
	fmt.Fprintf(w, "driver %s, CUDA %s, %d GPUs, read through %s\n", rep.Driver, rep.CUDA, len(rep.GPUs), rep.Source)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tID\tNAME\tMEMORY\tRUNNER")
	for _, u := range rep.Units {
		idx, name := fmt.Sprint(u.GPU), u.Name
		if u.MIG != nil {
			idx = fmt.Sprintf("%d:%d", u.GPU, *u.MIG)
			name += " MIG " + u.MIGProfile
		}
		runner := u.Runner
		if runner == "" {
			runner = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.1f GiB\t%s\n", idx, u.ID, name, float64(u.MemoryMiB)/1024, runner)
	}
	tw.Flush()
}
