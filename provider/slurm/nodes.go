package slurm

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	jobrecord "github.com/runfleet/runfleet/record"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// A batch job's host is its node: the record of a runner keeps the
// node's system as slurmd registered it with the controller (its
// architecture, CPUs, memory and kernel: `scontrol show node`'s Arch,
// CPUTot, RealMemory and OS), read once per node in the background
// (provider.NodeSystems).

// NodeReader is a Cluster that can say what a node is.
type NodeReader interface {
	Node(ctx context.Context, name string) (*jobrecord.System, error)
}

// Node runs `scontrol show node -o NAME`: one line of key=value pairs,
// the same since long before --json existed.
func (c *CLI) Node(ctx context.Context, name string) (*jobrecord.System, error) {
	out, err := c.run(ctx, nil, "scontrol", "show", "node", "-o", name)
	if err != nil {
		return nil, err
	}
	return parseNode(out, name)
}

// nodeKey finds where each key=value pair of scontrol's line begins: a
// value may hold spaces (OS=Linux 6.1.0-25-amd64 #1 SMP ...).
var nodeKey = lazyregexp.New(`(?:^| )([A-Za-z][A-Za-z0-9_/]*)=`)

// parseNode reads a node's line.
func parseNode(out []byte, name string) (*jobrecord.System, error) {
	line := strings.TrimSpace(string(out))
	idx := nodeKey.FindAllStringSubmatchIndex(line, -1)
	kv := map[string]string{}
	for i, m := range idx {
		end := len(line)
		if i+1 < len(idx) {
			end = idx[i+1][0]
		}
		kv[line[m[2]:m[3]]] = strings.TrimSpace(line[m[1]:end])
	}
	if kv["NodeName"] != name {
		return nil, fmt.Errorf("scontrol show node %s: no such node in %q", name, line)
	}
	s := &jobrecord.System{Arch: goArch(kv["Arch"])}
	s.CPUs, _ = strconv.Atoi(kv["CPUTot"])
	if mb, err := strconv.ParseUint(kv["RealMemory"], 10, 64); err == nil {
		s.MemoryMiB = mb // RealMemory is in megabytes, slurm.conf(5)'s MiB
	}
	// OS is the node's uname: "Linux 6.1.0-25-amd64 #1 SMP ...".
	if f := strings.Fields(kv["OS"]); len(f) >= 2 {
		s.OS, s.Kernel = f[0], f[1]
	}
	return s, nil
}

// goArch is a machine's architecture as Go names it (the records' word).
func goArch(uname string) string {
	switch uname {
	case "x86_64":
		return "amd64"
	case "aarch64":
		return "arm64"
	}
	return uname
}
