package gitea

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkBurstMemory measures the manager's memory over 20-job bursts of
// one-second jobs on a pool of host processes (size 2, max 20, webhooks
// on): its peak resident set (VmHWM), and what is resident at the end,
// its own heap and stacks (RssAnon) apart from the binary's pages
// (RssFile). Each iteration is one burst. The binary is
// RUNFLEET_E2E_BINARY's, so that builds with other drivers compare
// (docs/builds.md):
//
//	CGO_ENABLED=0 go build -trimpath -tags '...' -o /tmp/rf ./cmd/runfleet
//	RUNFLEET_E2E_BINARY=/tmp/rf go test ./internal/e2e/gitea -run '^$' -bench BurstMemory -benchtime 1x
func BenchmarkBurstMemory(b *testing.B) {
	name := fmt.Sprintf("mem-%d", b.N)
	top, hooks, _ := harness.Listeners(b)
	f := harness.NewFleet(b, name, harness.FleetOptions{Size: 2, Max: 20, Top: top, Forge: "    webhook_secret: " + harness.HookSecret + "\n"})
	f.Hooks = hooks
	f.AddWebhook()
	// A copy, written as an install writes it: a binary the Go linker
	// has just written shows up to 25 MiB more of its pages resident
	// (docs/builds.md), which is the page cache's doing, not the build's.
	bin := filepath.Join(b.TempDir(), "runfleet")
	copyFile(b, harness.FleetBin, bin)
	f.UseBinary(bin)
	f.Start()
	harness.Eventually(b, time.Minute, "2 warm runners", func() bool { return f.IdleOnline() == 2 })
	b.ResetTimer()
	for i := range b.N {
		f.Push(harness.Matrix(name, 20, fmt.Sprintf("echo burst %d job ${{ matrix.n }}\nsleep 1", i)))
		f.WaitJobs(20*(i+1), 5*time.Minute)
	}
	b.StopTimer()
	st := procStatus(b, f.Cmd.Process.Pid)
	if err := f.Stop(time.Minute); err != nil {
		b.Error(err)
	}
	size := int64(0)
	if fi, err := os.Stat(bin); err == nil {
		size = fi.Size()
	}
	for _, k := range []string{"VmHWM", "RssAnon", "RssFile"} {
		b.ReportMetric(st[k]/1024, k+"-MiB")
	}
	b.Logf("%s (%.1f MiB): over %d bursts of 20 jobs, VmHWM %.1f MiB; at the end RssAnon %.1f MiB, RssFile %.1f MiB",
		harness.FleetBin, float64(size)/(1<<20), b.N, st["VmHWM"]/1024, st["RssAnon"]/1024, st["RssFile"]/1024)
}

// procStatus reads a process's figures in kB from /proc/<pid>/status.
func procStatus(b *testing.B, pid int) map[string]float64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	st := map[string]float64{}
	for line := range strings.SplitSeq(string(raw), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if v, found := strings.CutSuffix(strings.TrimSpace(v), " kB"); ok && found {
			st[k], _ = strconv.ParseFloat(v, 64)
		}
	}
	return st
}

// copyFile copies an executable with read and write calls.
func copyFile(b *testing.B, from, to string) {
	in, err := os.Open(from)
	if err != nil {
		b.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		b.Fatal(err)
	}
	if err := out.Close(); err != nil {
		b.Fatal(err)
	}
}
