package aws

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
)

// MaxUserData is EC2's limit on user data, before its base64 encoding.
const MaxUserData = 16 << 10

// PlanPath is where the user data writes the runner's plan (0600).
const PlanPath = "/var/lib/runfleet/plan.json"

// userData is the shell script an instance runs at its first boot
// (cloud-init runs user data that starts with #!): it writes the
// runner's plan, runs the pool's startup script, and hands over to
// `runfleet agent`, which starts the forge's agent and powers the
// instance off at the end. It carries the runner's single-use credential
// (in the plan) and nothing else secret: never the forge's token, never
// a cloud credential. An instance that cannot start the agent powers off
// at once rather than sit idle at a cost.
func userData(s Section, spec provider.Spec, now time.Time, idle, lifetime time.Duration) ([]byte, error) {
	plan := bootstrap.Plan{
		Runner: spec.Name, Command: spec.Command, Args: spec.Args, Env: spec.Env, Files: spec.Files,
		Workdir: s.Workdir, BusyMarker: spec.BusyMarker, IdleTimeout: idle,
		Deadline: now.Add(lifetime).UTC().Truncate(time.Second), Poweroff: []string{"poweroff"}, Notices: "aws",
	}
	pj, err := json.Marshal(plan)
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "#!/bin/sh\n# runfleet: runner %s of pool %s, manager %s.\n", spec.Name, spec.Pool, spec.Manager)
	b.WriteString("# The plan holds this runner's single-use credential; it powers the instance off at its deadline.\n")
	b.WriteString("umask 077\nmkdir -p /var/lib/runfleet\n")
	b.WriteString("off() { echo \"runfleet: $1; powering off\" >&2; poweroff; exit 1; }\n")
	heredoc(&b, PlanPath, pj)
	if s.SSHPublicKey != "" {
		b.WriteString("mkdir -p /root/.ssh && chmod 700 /root/.ssh\n")
		fmt.Fprintf(&b, "echo %s >> /root/.ssh/authorized_keys\n", shellQuote(strings.TrimSpace(s.SSHPublicKey)))
	}
	if s.StartupScript != "" {
		heredoc(&b, "/var/lib/runfleet/startup.sh", []byte(s.StartupScript))
		b.WriteString("sh /var/lib/runfleet/startup.sh || off \"the startup script failed\"\n")
	}
	fmt.Fprintf(&b, "command -v %[1]s >/dev/null || off \"%[1]s is not on this image\"\n", shellQuote(s.Runfleet))
	fmt.Fprintf(&b, "exec %s agent --plan %s\n", shellQuote(s.Runfleet), PlanPath)
	if n := b.Len(); n > MaxUserData {
		return nil, fmt.Errorf("user data for %s is %d bytes, over EC2's %d (a shorter startup_script, or fewer files)", spec.Name, n, MaxUserData)
	}
	return []byte(b.String()), nil
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

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
