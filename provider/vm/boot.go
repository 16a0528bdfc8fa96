// Package vm holds what the providers of cloud instances share: the boot
// script an instance runs first, which hands it to `runfleet agent`
// (package bootstrap), and CML's --cloud-* options with each cloud's
// tables of region and size aliases, the order a runner's machine is tried
// in across markets, types and places (Placement), what a provider knows
// of its machines between listings (Book), the limits shared per project
// or subscription (Shared), and the poller behind Watch and
// WatchPreemption (Poller). Each cloud's provider package says only what
// differs: its calls, its errors, its limits, its metadata service, its
// names.
package vm

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
)

// PlanPath is where the boot script writes the runner's plan (0600).
const PlanPath = "/var/lib/runfleet/plan.json"

// Boot is what an instance's boot script needs beside the runner's spec.
type Boot struct {
	// Cloud names the cloud in errors ("EC2") and Notices the metadata
	// service the agent watches for interruptions ("aws").
	Cloud, Notices string
	// Limit is the most bytes the cloud takes for the script.
	Limit int
	// Runfleet is runfleet on the image; Workdir the agent's working
	// directory there.
	Runfleet, Workdir string
	// StartupScript runs as root before the agent (installs, mounts);
	// SSHPublicKey is added to root's authorized keys.
	StartupScript, SSHPublicKey string
	// IdleTimeout and Lifetime: the instance powers off when no job came
	// within IdleTimeout, and at Lifetime from now whatever it runs.
	IdleTimeout, Lifetime time.Duration
}

// Placed notes in a runner's record the placement being tried: the
// image, the instance type, the zone or location ("" where the cloud
// chooses) and the market. The last one tried is the one that ran.
func Placed(spec provider.Spec, image, typ, zone string, spot bool) {
	if r := spec.Record; r != nil {
		r.Machine.Image, r.Machine.InstanceType, r.Machine.Zone, r.Machine.Spot = image, typ, zone, spot
	}
}

// Market is the Spot choice of a runner's instance: the pool's (spot and
// its fallback), or a job's spot=false (standard only) or spot=true (Spot,
// with the pool's fallback) where the pool is a Spot pool.
func Market(poolSpot, poolFallback bool, req *bool) (spot, fallback bool) {
	if req == nil || !poolSpot {
		return poolSpot, poolFallback
	}
	if !*req {
		return false, false
	}
	return true, poolFallback
}

// Honours is what a job of a dynamic pool may ask a cloud instance to
// be: spot=true or spot=false, where the pool is a Spot pool (whose
// machines the pool watches for notices).
func Honours(poolSpot bool) []string {
	if poolSpot {
		return []string{"spot"}
	}
	return nil
}

// Script is the shell script an instance runs at its first boot
// (cloud-init runs user data that starts with #!; GCE its startup-script
// metadata): it writes the runner's plan, runs the pool's startup script,
// and hands over to `runfleet agent`, which starts the forge's agent and
// powers the instance off at the end. It carries the runner's single-use
// credential (in the plan) and nothing else secret: never the forge's
// token, never a cloud credential. An instance that cannot start the agent
// powers off at once rather than sit idle at a cost.
func (b Boot) Script(spec provider.Spec, now time.Time) ([]byte, error) {
	spec = spec.WithRecord(b.Workdir)
	plan := bootstrap.Plan{
		Runner: spec.Name, Command: spec.Command, Args: spec.Args, Env: spec.Env, Files: spec.Files,
		Workdir: b.Workdir, BusyMarker: spec.BusyMarker, IdleTimeout: b.IdleTimeout,
		Deadline: now.Add(b.Lifetime).UTC().Truncate(time.Second), Poweroff: []string{"poweroff"}, Notices: b.Notices,
	}
	pj, err := json.Marshal(plan)
	if err != nil {
		return nil, err
	}
	var s strings.Builder
	fmt.Fprintf(&s, "#!/bin/sh\n# runfleet: runner %s of pool %s, manager %s.\n", spec.Name, spec.Pool, spec.Manager)
	s.WriteString("# The plan holds this runner's single-use credential; it powers the instance off at its deadline.\n")
	s.WriteString("umask 077\nmkdir -p /var/lib/runfleet\n")
	s.WriteString("off() { echo \"runfleet: $1; powering off\" >&2; poweroff; exit 1; }\n")
	heredoc(&s, PlanPath, pj)
	if b.SSHPublicKey != "" {
		s.WriteString("mkdir -p /root/.ssh && chmod 700 /root/.ssh\n")
		fmt.Fprintf(&s, "echo %s >> /root/.ssh/authorized_keys\n", ShellQuote(strings.TrimSpace(b.SSHPublicKey)))
	}
	if b.StartupScript != "" {
		heredoc(&s, "/var/lib/runfleet/startup.sh", []byte(b.StartupScript))
		s.WriteString("sh /var/lib/runfleet/startup.sh || off \"the startup script failed\"\n")
	}
	fmt.Fprintf(&s, "command -v %[1]s >/dev/null || off \"%[1]s is not on this image\"\n", ShellQuote(b.Runfleet))
	fmt.Fprintf(&s, "exec %s agent --plan %s\n", ShellQuote(b.Runfleet), PlanPath)
	if n := s.Len(); b.Limit > 0 && n > b.Limit {
		return nil, fmt.Errorf("the boot script of %s is %d bytes, over %s's %d (a shorter startup_script, or fewer files)", spec.Name, n, b.Cloud, b.Limit)
	}
	return []byte(s.String()), nil
}

// heredoc writes data to path through base64, so that no line of it can
// end the here-document.
func heredoc(b *strings.Builder, path string, data []byte) {
	fmt.Fprintf(b, "base64 -d > %s <<'RUNFLEET_EOF'\n", path)
	enc := base64.StdEncoding.EncodeToString(data)
	for len(enc) > 76 {
		b.WriteString(enc[:76] + "\n")
		enc = enc[76:]
	}
	b.WriteString(enc + "\nRUNFLEET_EOF\n")
}

// ShellQuote quotes s for sh.
func ShellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// IdleGrace is how much longer than the pool's idle_timeout an instance
// waits for a job before it powers itself off. The manager retires an
// idle runner's registration first, so that no job can be handed to it
// as it goes; an instance ending by itself cannot, and a job handed to it
// in the moment before its agent says it is busy is lost with it (the
// chaos test saw one). The instance's own timeout is therefore only for
// when the manager is gone, and the manager, while it is up, always acts
// first.
const IdleGrace = time.Minute

// InstanceIdle is an instance's own idle timeout: the section's as given,
// or the pool's and IdleGrace, or dflt.
func InstanceIdle(section, pool, dflt time.Duration) time.Duration {
	switch {
	case section > 0:
		return section
	case pool > 0:
		return pool + IdleGrace
	}
	return dflt
}
