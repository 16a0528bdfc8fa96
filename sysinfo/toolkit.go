package sysinfo

import (
	"context"
	"os/exec"
	"sync"
	"time"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// toolkitVersion finds the version in what NVIDIA's container toolkit
// prints: `nvidia-ctk --version`'s "NVIDIA Container Toolkit CLI version
// 1.17.4", or `nvidia-container-cli --version`'s "cli-version: 1.17.4"
// (github.com/NVIDIA/nvidia-container-toolkit, cmd/nvidia-ctk; libnvidia-container).
var toolkitVersion = lazyregexp.New(`(?m)(?:Toolkit CLI version|cli-version:)\s+v?([0-9][0-9A-Za-z.+~-]*)`)

var (
	toolkitOnce sync.Once
	toolkit     string
)

// NvidiaToolkit is the version of NVIDIA's container toolkit on this
// host, asked once (5 s at most); "" where neither of its commands is
// on the PATH or says one.
func NvidiaToolkit(ctx context.Context) string {
	toolkitOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		for _, cmd := range [][]string{{"nvidia-ctk", "--version"}, {"nvidia-container-cli", "--version"}} {
			out, err := exec.CommandContext(ctx, cmd[0], cmd[1:]...).Output()
			if err != nil {
				continue
			}
			if m := toolkitVersion.FindSubmatch(out); m != nil {
				toolkit = string(m[1])
				return
			}
		}
	})
	return toolkit
}
