package peers

import (
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/moby/client"
)

// DindImageRepo is the repository of the image that stands in for
// Docker's docker:dind.
const DindImageRepo = "runfleet-test/dind"

// dindBinaries are the Docker engine's programs, from Debian's docker.io,
// containerd and runc packages on this host, and iptables' (the engine
// programs a container's DNS with it).
var dindBinaries = []string{
	"/usr/sbin/dockerd", "/usr/bin/containerd", "/usr/bin/containerd-shim-runc-v2", "/usr/sbin/runc",
	"/usr/bin/docker-init", "/usr/sbin/docker-proxy", "/usr/sbin/xtables-legacy-multi",
}

// xtablesDir holds iptables' extensions, which it loads by name.
const xtablesDir = "/usr/lib/x86_64-linux-gnu/xtables"

// dindEntrypoint stands in for docker:dind's dockerd-entrypoint.sh: given
// `dockerd ARGS`, it runs the daemon with them. The images a registry
// would serve (none can be reached here) are loaded first, through a
// daemon of their own on the same storage, so that the daemon that
// answers on the pod's socket, and so its startup probe, has them.
const dindEntrypoint = `#!/bin/sh
set -e
[ "$1" = dockerd ] && shift
if [ -s /preload/images.tar ] && [ ! -e /var/lib/docker/.preloaded ]; then
  dockerd --host=unix:///tmp/preload.sock --pidfile=/tmp/preload.pid --exec-root=/tmp/preload-exec >/tmp/preload.log 2>&1 &
  n=0
  until docker -H unix:///tmp/preload.sock info >/dev/null 2>&1; do
    n=$((n+1)); [ $n -lt 300 ] || { cat /tmp/preload.log >&2; exit 1; }
    sleep 0.2
  done
  docker -H unix:///tmp/preload.sock load -i /preload/images.tar
  kill $! && wait $! || true
  touch /var/lib/docker/.preloaded
fi
exec dockerd "$@"
`

// DindImage builds an image that runs a Docker daemon as docker:dind
// does (its entrypoint takes `dockerd ARGS`, it has the docker CLI),
// from this host's engine and its libraries and dockerCLI (a static
// build), with the images named in preload (of the host's engine) loaded
// into its storage before the daemon listens. Its tag is a hash of all
// of that.
func DindImage(ctx context.Context, cli *client.Client, dockerCLI string, preload ...string) (string, error) {
	files := []ImageFile{
		{Path: "bin/docker", From: dockerCLI, Mode: 0o755},
		{Path: "bin/dind-entrypoint", Data: []byte(dindEntrypoint), Mode: 0o755},
	}
	libs := map[string]bool{}
	for _, b := range dindBinaries {
		files = append(files, ImageFile{Path: "bin/" + filepath.Base(b), From: b, Mode: 0o755})
		if ok, err := Static(b); err != nil {
			return "", fmt.Errorf("dind image: %w (install Debian's docker.io and iptables)", err)
		} else if ok {
			continue
		}
		out, err := exec.CommandContext(ctx, "ldd", b).Output()
		if err != nil {
			return "", fmt.Errorf("dind image: ldd %s: %w (install Debian's docker.io and iptables)", b, err)
		}
		for line := range strings.Lines(string(out)) {
			for f := range strings.FieldsSeq(line) {
				if strings.HasPrefix(f, "/") {
					libs[f] = true
				}
			}
		}
	}
	exts, _ := filepath.Glob(filepath.Join(xtablesDir, "*.so"))
	for _, e := range exts {
		libs[e] = true
	}
	for l := range libs {
		real, err := filepath.EvalSymlinks(l)
		if err != nil {
			return "", fmt.Errorf("dind image: %w", err)
		}
		files = append(files, ImageFile{Path: strings.TrimPrefix(l, "/"), From: real, Mode: 0o755})
	}
	if len(preload) > 0 {
		res, err := cli.ImageSave(ctx, preload)
		if err != nil {
			return "", fmt.Errorf("dind image: save %v: %w", preload, err)
		}
		var buf bytes.Buffer
		_, err = io.Copy(&buf, res)
		res.Close()
		if err != nil {
			return "", fmt.Errorf("dind image: save %v: %w", preload, err)
		}
		files = append(files, ImageFile{Path: "preload/images.tar", Data: buf.Bytes(), Mode: 0o644})
	}
	slices.SortFunc(files, func(a, b ImageFile) int { return strings.Compare(a.Path, b.Path) })
	base, err := BuildImage(ctx, cli, DindImageRepo+"-base", files...)
	if err != nil {
		return "", err
	}
	var links strings.Builder
	for _, n := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		fmt.Fprintf(&links, " && ln -sf xtables-legacy-multi /bin/%s", n)
	}
	return DeriveImage(ctx, cli, base, "", "RUN mkdir -p /var/lib/docker /lib64"+links.String()+
		"\nENV PATH=/bin\nENTRYPOINT [\"/bin/dind-entrypoint\"]\n")
}

// Static says whether a program is a static build: it has no program
// interpreter (ldd fails on one; Debian's docker-init is tini's static
// build, Docker's own CLI release is static, Debian's is not).
func Static(path string) (bool, error) {
	f, err := elf.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	return !slices.ContainsFunc(f.Progs, func(p *elf.Prog) bool { return p.Type == elf.PT_INTERP }), nil
}
