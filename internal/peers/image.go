package peers

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/api/types/build"
	"github.com/moby/moby/api/types/jsonstream"
	"github.com/moby/moby/client"
)

// Static binaries from Debian's bash-static and busybox-static packages:
// with them an image can be built FROM scratch, since no registry can be
// reached to pull a base image.
const (
	BashStatic    = "/bin/bash-static"
	BusyboxStatic = "/bin/busybox"
)

// Repositories of the test images.
const (
	RunnerImageRepo = "runfleet-test/gitea-runner"
	BaseImageRepo   = "runfleet-test/busybox"
)

// RunnerImage builds, through the Engine API, a FROM scratch image that
// holds the given (static) gitea-runner, bash and busybox, and returns its
// tag. The tag is a hash of the inputs, so an image already built is
// reused. With runner "" the image has only bash and busybox.
func RunnerImage(ctx context.Context, cli *client.Client, runner string) (string, error) {
	if runner == "" {
		return AgentImage(ctx, cli, BaseImageRepo, "", "")
	}
	return AgentImage(ctx, cli, RunnerImageRepo, "gitea-runner", runner)
}

// AgentImage is RunnerImage for any static agent binary, installed as
// /bin/<name>.
func AgentImage(ctx context.Context, cli *client.Client, repo, name, bin string) (string, error) {
	inputs := map[string]string{"bin/bash": BashStatic, "bin/busybox": BusyboxStatic}
	bins := []string{"bin/bash", "bin/busybox"}
	if name != "" {
		inputs["bin/"+name] = bin
		bins = append(bins, "bin/"+name)
	}
	data := map[string][]byte{}
	h := sha256.New()
	for _, dst := range bins {
		b, err := os.ReadFile(inputs[dst])
		if err != nil {
			return "", fmt.Errorf("runner image: %w (install Debian's bash-static and busybox-static)", err)
		}
		data[dst] = b
		h.Write(b)
	}
	applets, err := exec.CommandContext(ctx, BusyboxStatic, "--list").Output()
	if err != nil {
		return "", fmt.Errorf("runner image: busybox --list: %w", err)
	}
	h.Write(applets)
	h.Write([]byte(dockerfile))
	tag := repo + ":" + hex.EncodeToString(h.Sum(nil))[:12]
	if _, err := cli.ImageInspect(ctx, tag); err == nil {
		return tag, nil
	} else if !cerrdefs.IsNotFound(err) {
		return "", fmt.Errorf("runner image: inspect %s: %w", tag, err)
	}

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	now := time.Now()
	add := func(hdr *tar.Header, body []byte) error {
		hdr.ModTime = now
		if hdr.Typeflag == tar.TypeReg {
			hdr.Size = int64(len(body))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		_, err := tw.Write(body)
		return err
	}
	var errs []error
	errs = append(errs, add(&tar.Header{Typeflag: tar.TypeReg, Name: "Dockerfile", Mode: 0o644}, []byte(dockerfile)))
	for _, d := range []struct {
		name string
		mode int64
	}{{"rootfs/", 0o755}, {"rootfs/bin/", 0o755}, {"rootfs/etc/", 0o755}, {"rootfs/root/", 0o700}, {"rootfs/tmp/", 0o1777}, {"rootfs/usr/", 0o755}, {"rootfs/runner/", 0o755}} {
		errs = append(errs, add(&tar.Header{Typeflag: tar.TypeDir, Name: d.name, Mode: d.mode}, nil))
	}
	for _, dst := range bins {
		errs = append(errs, add(&tar.Header{Typeflag: tar.TypeReg, Name: "rootfs/" + dst, Mode: 0o755}, data[dst]))
	}
	for _, l := range []struct{ name, target string }{{"usr/bin", "../bin"}, {"usr/sbin", "../bin"}, {"sbin", "bin"}} {
		errs = append(errs, add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "rootfs/" + l.name, Linkname: l.target}, nil))
	}
	for _, a := range strings.Fields(string(applets)) {
		if a == "bash" || a == "busybox" {
			continue
		}
		errs = append(errs, add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "rootfs/bin/" + a, Linkname: "busybox"}, nil))
	}
	errs = append(errs,
		add(&tar.Header{Typeflag: tar.TypeReg, Name: "rootfs/etc/passwd", Mode: 0o644}, []byte("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")),
		add(&tar.Header{Typeflag: tar.TypeReg, Name: "rootfs/etc/group", Mode: 0o644}, []byte("root:x:0:\nnogroup:x:65534:\n")),
		tw.Close())
	if err := errors.Join(errs...); err != nil {
		return "", fmt.Errorf("runner image: context: %w", err)
	}

	res, err := cli.ImageBuild(ctx, &buf, client.ImageBuildOptions{
		Tags: []string{tag}, Remove: true, ForceRemove: true, Version: build.BuilderV1,
	})
	if err != nil {
		return "", fmt.Errorf("runner image: build: %w", err)
	}
	defer res.Body.Close()
	var out strings.Builder
	dec := json.NewDecoder(res.Body)
	for {
		var m jsonstream.Message
		if err := dec.Decode(&m); err == io.EOF {
			break
		} else if err != nil {
			return "", fmt.Errorf("runner image: build output: %w", err)
		}
		out.WriteString(m.Stream)
		if m.Error != nil {
			return "", fmt.Errorf("runner image: build: %s\n%s", m.Error.Message, out.String())
		}
	}
	if _, err := cli.ImageInspect(ctx, tag); err != nil {
		return "", fmt.Errorf("runner image: not there after build: %w\n%s", err, out.String())
	}
	return tag, nil
}

const dockerfile = `FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8
WORKDIR /runner
CMD ["/bin/bash"]
`
