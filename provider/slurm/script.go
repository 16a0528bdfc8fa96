package slurm

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	// The package's own record is a runner's spool record.
	jobrecord "github.com/runfleet/runfleet/record"
)

// The job's own variables that its agent and the agent's job keep: which
// GPUs it got, and where it runs.
var passed = []string{
	"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE",
	"SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "SLURM_JOB_PARTITION",
	"SLURM_JOB_ACCOUNT", "SLURM_CLUSTER_NAME", "SLURM_CPUS_ON_NODE", "SLURM_MEM_PER_NODE",
}

var envNameRE = lazyregexp.New(`^[A-Za-z_][A-Za-z0-9_]*$`)

// batchScript is the job's script. It holds no secret (Slurm keeps it
// with the job, and its owner and the cluster's admins can read it back):
// the agent's files and environment wait in the spool, readable by this
// user only, are moved into a fresh directory on the node as the job
// starts, and are removed with it when the job ends, cancelled or not.
//
// Slurm's notice of the job's end, --signal's USR1 (NoticeSignal) ahead of
// its time limit or, with SchedulerParameters=preempt_send_user_signal, at
// its preemption, or the TERM of a preemption's grace time, leaves a file
// named after the job in notices for the manager to see at its next read
// (the manager's own cancels are told apart there), and the agent runs on.
func batchScript(spec provider.Spec, spool, parent, notices string) []byte {
	var keep strings.Builder
	for _, v := range passed {
		fmt.Fprintf(&keep, " ${%[1]s+\"%[1]s=$%[1]s\"}", v)
	}
	agent := quote(spec.Command)
	for _, a := range spec.Args {
		agent += " " + quote(a)
	}
	return fmt.Appendf(nil, `#!/bin/sh
# runfleet runner %[1]s of pool %[2]s (manager %[3]s)
umask 077
spool=%[4]s
parent=%[5]s
mkdir -p "$parent" && work=$(mktemp -d "$parent/%[1]s.XXXXXX") || { rm -rf "$spool"; exit 1; }
notices=%[9]s
trap 'rm -rf "$work"' EXIT
trap 'echo USR1 > "$notices/$SLURM_JOB_ID"' USR1
trap 'echo TERM > "$notices/$SLURM_JOB_ID"; kill -TERM "$pid" 2>/dev/null; wait "$pid"; exit 143' TERM INT HUP
if ! { cp -R "$spool/files/." "$work/" && mv "$spool/env" "$work/.runfleet-env"; }; then
  echo "runfleet: the runner's files are not in $spool" >&2
  rm -rf "$spool"; exit 1
fi
rm -rf "$spool"
mkdir "$work/tmp" && cd "$work" || exit 1
%[8]senv -i HOME="$work" TMPDIR="$work/tmp"%[6]s /bin/sh -c '. ./.runfleet-env && rm -f ./.runfleet-env && exec "$@"' agent %[7]s &
pid=$!
# A trapped signal ends wait early: wait again while the agent runs.
while :; do
  wait "$pid"; rc=$?
  kill -0 "$pid" 2>/dev/null || exit "$rc"
done
`, spec.Name, spec.Pool, spec.Manager, quote(spool), quote(parent), keep.String(), agent, recordLines(spec), quote(notices))
}

// recordLines complete the runner's record on its node: the node's name in
// its file, and RUNFLEET_RECORD and RUNFLEET_NODE in the agent's
// environment (exported before the env -i, which keeps what it names).
func recordLines(spec provider.Spec) string {
	if spec.Record == nil {
		return ""
	}
	return fmt.Sprintf(`sed -i "s/%s/$SLURMD_NODENAME/" %s 2>/dev/null
echo "export RUNFLEET_RECORD=\"$work/%[2]s\" RUNFLEET_NODE=\"$SLURMD_NODENAME\"" >> .runfleet-env
`, jobrecord.NodeMark, jobrecord.File)
}

// writeSpool writes a runner's files and environment for its job into
// dir, which only this user can enter.
func writeSpool(dir string, spec provider.Spec) error {
	if err := os.MkdirAll(filepath.Join(dir, "files"), 0o700); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return err
	}
	for rel, data := range spec.Files {
		path := filepath.Join(dir, "files", filepath.Clean("/"+rel))
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return err
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return err
		}
	}
	env, err := envFile(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "env"), env, 0o600)
}

// envFile is the agent's environment as the job's script sources it.
func envFile(spec provider.Spec) ([]byte, error) {
	var env strings.Builder
	for _, k := range slices.Sorted(maps.Keys(spec.Env)) {
		if !envNameRE.MatchString(k) {
			return nil, fmt.Errorf("environment variable name %q cannot be passed to a shell", k)
		}
		fmt.Fprintf(&env, "export %s=%s\n", k, quote(spec.Env[k]))
	}
	return []byte(env.String()), nil
}

// quote makes s one word of a POSIX shell.
func quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
