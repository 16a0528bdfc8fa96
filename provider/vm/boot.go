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
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"path"
	"strings"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
)

// PlanPath is where the boot script writes the runner's plan (0600).
const PlanPath = "/var/lib/runfleet/plan.json"

// Where the boot script installs what a stock image lacks.
const (
	// InstalledRunfleet is runfleet, fetched for a stock image.
	InstalledRunfleet = "/usr/local/bin/runfleet"
	// AgentDir holds the forge's agent, fetched and unpacked for a stock
	// image: a pool's agent path is within it.
	AgentDir = "/opt/runfleet/agent"
)

// Install is what a stock image lacks, which the boot script fetches
// before it starts anything: runfleet itself and the forge's agent (a
// tarball is unpacked into AgentDir, a program put there). Each file's
// SHA-256 is checked before it is used; a file that does not match
// powers the instance off, saying which.
type Install struct {
	Runfleet Download `json:"runfleet"`
	Agent    Download `json:"agent"`
	// Docker installs Docker's engine where the image has none, from
	// the distribution's archive (docker.io; apt checks its signatures),
	// and waits for it: for an agent that runs as an image (Bitbucket's).
	Docker bool `json:"docker"`
}

// Download is one file: where it is and its SHA-256.
type Download struct {
	URL    string `json:"url"`
	SHA256 string `json:"sha256"`
}

// Given says whether anything is to be installed.
func (i Install) Given() bool { return i.Runfleet.URL != "" || i.Agent.URL != "" || i.Docker }

// Check says what is wrong with an install section, each problem named
// by its field.
func (i Install) Check() error {
	var errs []error
	for _, f := range []struct {
		name string
		d    Download
	}{{"install.runfleet", i.Runfleet}, {"install.agent", i.Agent}} {
		name, d := f.name, f.d
		if d.URL == "" && d.SHA256 == "" {
			continue
		}
		if u, err := url.Parse(d.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("%s.url: %q is not an http(s) URL", name, d.URL))
		}
		if b, err := hex.DecodeString(d.SHA256); err != nil || len(b) != sha256.Size {
			errs = append(errs, fmt.Errorf("%s.sha256: %q is not a SHA-256 (64 hexadecimal digits)", name, d.SHA256))
		}
	}
	return errors.Join(errs...)
}

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
	// Install is what the image lacks, fetched first (runfleet is then
	// InstalledRunfleet).
	Install Install
	// StartupScript runs as root before the agent (installs, mounts);
	// SSHPublicKey is added to root's authorized keys.
	StartupScript, SSHPublicKey string
	// IdleTimeout and Lifetime: the instance powers off when no job came
	// within IdleTimeout, and at Lifetime from now whatever it runs.
	IdleTimeout, Lifetime time.Duration
	// Handoff, where set, keeps the runner's assignment out of the
	// script: the instance takes it from the cloud's secret store
	// (bootstrap.Handoff), and the script is the same for every runner
	// of the pool asked for at the same moment.
	Handoff *bootstrap.Handoff
}

// Assign is the runner's part of its plan: what a Handoff brings to its
// instance.
func (b Boot) Assign(spec provider.Spec) bootstrap.Assignment {
	spec = spec.WithRecord(b.Workdir)
	return bootstrap.Assignment{
		Runner: spec.Name, Command: spec.Command, Args: spec.Args, Env: spec.Env, Files: spec.Files, BusyMarker: spec.BusyMarker,
	}
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

// Script is the shell script an instance runs at its first boot
// (cloud-init runs user data that starts with #!; GCE its startup-script
// metadata): it writes the runner's plan, runs the pool's startup script,
// and hands over to `runfleet agent`, which starts the forge's agent and
// powers the instance off at the end. With a Handoff it holds nothing
// secret and names no runner; without one it carries the runner's
// single-use credential (in the plan) and nothing else secret: never the
// forge's token, never a cloud credential. An instance that cannot start
// the agent powers off at once rather than sit idle at a cost.
func (b Boot) Script(spec provider.Spec, now time.Time) ([]byte, error) {
	plan := bootstrap.Plan{
		Workdir: b.Workdir, IdleTimeout: b.IdleTimeout, Handoff: b.Handoff,
		Deadline: now.Add(b.Lifetime).UTC().Truncate(time.Second), Poweroff: []string{"poweroff"}, Notices: b.Notices,
	}
	if b.Handoff == nil {
		plan.Assignment = b.Assign(spec)
	}
	pj, err := json.Marshal(plan)
	if err != nil {
		return nil, err
	}
	var s strings.Builder
	if b.Handoff != nil {
		fmt.Fprintf(&s, "#!/bin/sh\n# runfleet: a runner of pool %s, manager %s.\n", spec.Pool, spec.Manager)
		s.WriteString("# The instance takes its runner's assignment from where the plan's handoff says, once; it powers off at its deadline.\n")
	} else {
		fmt.Fprintf(&s, "#!/bin/sh\n# runfleet: runner %s of pool %s, manager %s.\n", spec.Name, spec.Pool, spec.Manager)
		s.WriteString("# The plan holds this runner's single-use credential; it powers the instance off at its deadline.\n")
	}
	s.WriteString("umask 077\nmkdir -p /var/lib/runfleet\n")
	s.WriteString("off() { echo \"runfleet: $1; powering off\" >&2; poweroff; exit 1; }\n")
	heredoc(&s, PlanPath, pj)
	if b.SSHPublicKey != "" {
		// root's, and the image's login user's where it has one (Ubuntu's
		// ubuntu, which CML's docs ssh in as).
		fmt.Fprintf(&s, "for home in /root /home/ubuntu; do [ -d \"$home\" ] || continue; mkdir -p \"$home/.ssh\" && chmod 700 \"$home/.ssh\" && echo %s >> \"$home/.ssh/authorized_keys\"; done\n", ShellQuote(strings.TrimSpace(b.SSHPublicKey)))
		s.WriteString("[ -d /home/ubuntu/.ssh ] && chown -R ubuntu: /home/ubuntu/.ssh 2>/dev/null\n")
	}
	runfleet := b.Runfleet
	if b.Install.Given() {
		b.Install.script(&s)
		if b.Install.Runfleet.URL != "" {
			runfleet = InstalledRunfleet
		}
	}
	if b.StartupScript != "" {
		heredoc(&s, "/var/lib/runfleet/startup.sh", []byte(b.StartupScript))
		s.WriteString("sh /var/lib/runfleet/startup.sh || off \"the startup script failed\"\n")
	}
	fmt.Fprintf(&s, "command -v %[1]s >/dev/null || off \"%[1]s is not on this image\"\n", ShellQuote(runfleet))
	fmt.Fprintf(&s, "exec %s agent --plan %s\n", ShellQuote(runfleet), PlanPath)
	if n := s.Len(); b.Limit > 0 && n > b.Limit {
		return nil, fmt.Errorf("the boot script of %s is %d bytes, over %s's %d (a shorter startup_script, or fewer files)", spec.Name, n, b.Cloud, b.Limit)
	}
	return []byte(s.String()), nil
}

// script writes the lines that install what the image lacks: each file
// fetched (curl, or wget where there is no curl) into a directory only
// root can read, its SHA-256 checked, then put in place. A failure powers
// the instance off with a line that says what failed, so the runner is
// reported failed instead of waiting for a job it cannot take.
func (i Install) script(s *strings.Builder) {
	s.WriteString("fetch() { curl -fsSL --retry 5 --retry-connrefused -o \"$2\" \"$1\" 2>/dev/null || wget -q -O \"$2\" \"$1\"; }\n")
	s.WriteString("verify() { [ \"$(sha256sum \"$1\" | cut -d' ' -f1)\" = \"$2\" ]; }\n")
	// cp and chmod rather than install(1), which a minimal image may lack.
	s.WriteString("place() { mkdir -p \"$(dirname \"$2\")\" && cp \"$1\" \"$2\" && chmod 0755 \"$2\"; }\n")
	s.WriteString("mkdir -p /var/lib/runfleet/fetch\n")
	if d := i.Runfleet; d.URL != "" {
		fmt.Fprintf(s, "fetch %s /var/lib/runfleet/fetch/runfleet || off %s\n", ShellQuote(d.URL), ShellQuote("could not fetch runfleet from "+d.URL))
		fmt.Fprintf(s, "verify /var/lib/runfleet/fetch/runfleet %s || off %s\n", d.SHA256, ShellQuote("runfleet from "+d.URL+": its SHA-256 is not "+d.SHA256+" (checksum mismatch)"))
		fmt.Fprintf(s, "place /var/lib/runfleet/fetch/runfleet %s || off \"could not install runfleet\"\n", InstalledRunfleet)
	}
	if d := i.Agent; d.URL != "" {
		fmt.Fprintf(s, "fetch %s /var/lib/runfleet/fetch/agent || off %s\n", ShellQuote(d.URL), ShellQuote("could not fetch the agent from "+d.URL))
		fmt.Fprintf(s, "verify /var/lib/runfleet/fetch/agent %s || off %s\n", d.SHA256, ShellQuote("the agent from "+d.URL+": its SHA-256 is not "+d.SHA256+" (checksum mismatch)"))
		fmt.Fprintf(s, "mkdir -p %s\n", AgentDir)
		if strings.HasSuffix(d.URL, ".tar.gz") || strings.HasSuffix(d.URL, ".tgz") {
			fmt.Fprintf(s, "tar -xzf /var/lib/runfleet/fetch/agent -C %s || off \"could not unpack the agent\"\n", AgentDir)
			// A release that says what it needs from the system (GitHub's
			// runner: .NET's libraries) gets it, where the image can.
			fmt.Fprintf(s, "[ -x %[1]s/bin/installdependencies.sh ] && %[1]s/bin/installdependencies.sh >/var/lib/runfleet/dependencies.log 2>&1\n", AgentDir)
		} else {
			fmt.Fprintf(s, "place /var/lib/runfleet/fetch/agent %s/%s || off \"could not install the agent\"\n", AgentDir, path.Base(d.URL))
		}
	}
	s.WriteString("rm -rf /var/lib/runfleet/fetch\n")
	if i.Docker {
		s.WriteString(dockerScript)
	}
}

// dockerScript installs Docker where the image has none: Ubuntu's and
// Debian's docker.io, whose package starts the engine (the clouds' GPU
// images have Docker already), and waits up to two minutes for the engine
// to answer.
const dockerScript = `if ! command -v docker >/dev/null 2>&1; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io; } >/var/lib/runfleet/docker.log 2>&1 ||
    off "could not install Docker (apt-get install docker.io; its output is in /var/lib/runfleet/docker.log)"
fi
n=0
until docker info >/dev/null 2>&1; do
  n=$((n+1)); [ $n -le 60 ] || off "Docker's engine did not answer within two minutes"
  sleep 2
done
`

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
