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
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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
	var extra []ImageFile
	if name != "" {
		extra = append(extra, ImageFile{Path: "bin/" + name, From: bin, Mode: 0o755})
	}
	return BuildImage(ctx, cli, repo, extra...)
}

// ImageFile is a file of a test image: read from From, or Data.
type ImageFile struct {
	Path string // in the image, relative
	From string
	Data []byte
	Mode int64
}

// BuildImage builds a FROM scratch image of bash, busybox (with its
// applets, less the ones extra replaces) and extra, tagged by a hash of
// its inputs.
func BuildImage(ctx context.Context, cli *client.Client, repo string, extra ...ImageFile) (string, error) {
	files := append([]ImageFile{{Path: "bin/bash", From: BashStatic, Mode: 0o755}, {Path: "bin/busybox", From: BusyboxStatic, Mode: 0o755}}, extra...)
	h := sha256.New()
	taken := map[string]bool{}
	for i, f := range files {
		if f.From != "" {
			b, err := os.ReadFile(f.From)
			if err != nil {
				return "", fmt.Errorf("runner image: %w (install Debian's bash-static and busybox-static)", err)
			}
			files[i].Data = b
		}
		h.Write([]byte(f.Path))
		h.Write(files[i].Data)
		taken[f.Path] = true
	}
	applets, err := exec.CommandContext(ctx, BusyboxStatic, "--list").Output()
	if err != nil {
		return "", fmt.Errorf("runner image: busybox --list: %w", err)
	}
	h.Write(applets)
	h.Write([]byte(dockerfile))
	sum := hex.EncodeToString(h.Sum(nil))[:12]
	tag := repo + ":" + sum
	if _, err := cli.ImageInspect(ctx, tag); err == nil {
		return tag, nil
	} else if !cerrdefs.IsNotFound(err) {
		return "", fmt.Errorf("runner image: inspect %s: %w", tag, err)
	}
	// One build of a tag at a time across test packages; whoever waited
	// finds it built.
	unlock, err := lock(filepath.Join(CacheDir(), "images", strings.ReplaceAll(repo, "/", "_")+"-"+sum+".lock"))
	if err != nil {
		return "", fmt.Errorf("runner image: %w", err)
	}
	defer unlock()
	if _, err := cli.ImageInspect(ctx, tag); err == nil {
		return tag, nil
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
	for _, f := range files {
		errs = append(errs, add(&tar.Header{Typeflag: tar.TypeReg, Name: "rootfs/" + f.Path, Mode: f.Mode}, f.Data))
	}
	for _, l := range []struct{ name, target string }{{"usr/bin", "../bin"}, {"usr/sbin", "../bin"}, {"sbin", "bin"}} {
		errs = append(errs, add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "rootfs/" + l.name, Linkname: l.target}, nil))
	}
	for _, a := range strings.Fields(string(applets)) {
		if a == "bash" || a == "busybox" || taken["bin/"+a] {
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

	if _, err := buildTar(ctx, cli, &buf, tag); err != nil {
		return "", fmt.Errorf("runner image: %w", err)
	}
	return tag, nil
}

// UserImage builds, from a local image, one that runs as user (uid or
// uid:gid) with its home in /home/runner, its own, and files added, as runner
// images that run as a user of their own do (GitHub's actions-runner runs
// as 1001, run.sh in its home), tagged tag or, with tag "", by a hash.
func UserImage(ctx context.Context, cli *client.Client, base, tag, user string, files ...ImageFile) (string, error) {
	uid, _, _ := strings.Cut(user, ":")
	return DeriveImage(ctx, cli, base, tag, fmt.Sprintf("RUN mkdir -p /home/runner && chown %s /home/runner\nUSER %s\nENV HOME=/home/runner\n", uid, user), files...)
}

// DeriveImage builds, from a local image, one with files added and then
// the Dockerfile's instructions, tagged tag or, with tag "", by a hash.
func DeriveImage(ctx context.Context, cli *client.Client, base, tag, instructions string, files ...ImageFile) (string, error) {
	var df strings.Builder
	fmt.Fprintf(&df, "FROM %s\n", base)
	h := sha256.New()
	for _, f := range files {
		fmt.Fprintf(&df, "COPY %s /%[1]s\n", f.Path)
		h.Write([]byte(f.Path))
		h.Write(f.Data)
	}
	df.WriteString(instructions)
	h.Write([]byte(df.String()))
	if tag == "" {
		tag = base[:strings.LastIndex(base, ":")] + "-user:" + hex.EncodeToString(h.Sum(nil))[:12]
	} else if _, err := cli.ImageInspect(ctx, tag); err == nil {
		// A fixed tag is rebuilt: its inputs may have changed.
		if _, err := cli.ImageRemove(ctx, tag, client.ImageRemoveOptions{}); err != nil {
			return "", fmt.Errorf("derived image: %w", err)
		}
	}
	if _, err := cli.ImageInspect(ctx, tag); err == nil {
		return tag, nil
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: time.Now()}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	errs := []error{add("Dockerfile", 0o644, []byte(df.String()))}
	for _, f := range files {
		errs = append(errs, add(f.Path, f.Mode, f.Data))
	}
	if err := errors.Join(append(errs, tw.Close())...); err != nil {
		return "", fmt.Errorf("derived image: context: %w", err)
	}
	if _, err := buildTar(ctx, cli, &buf, tag); err != nil {
		return "", fmt.Errorf("derived image: %w", err)
	}
	return tag, nil
}

// BuildDir builds the image whose context (Dockerfile included) is the
// directory dir, as `docker build -t tag dir` would, through the Engine
// API, and returns the engine's output.
func BuildDir(ctx context.Context, cli *client.Client, dir, tag string) (string, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		return "", fmt.Errorf("image context %s: %w", dir, err)
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	return buildTar(ctx, cli, &buf, tag)
}

// buildTar builds a tagged image from a tar context with the classic
// builder (BuildKit would want a registry for its frontend), and returns
// the engine's output.
func buildTar(ctx context.Context, cli *client.Client, context io.Reader, tag string) (string, error) {
	var out strings.Builder
	res, err := cli.ImageBuild(ctx, context, client.ImageBuildOptions{
		Tags: []string{tag}, Remove: true, ForceRemove: true, Version: build.BuilderV1,
	})
	if err != nil {
		return "", fmt.Errorf("build: %w", err)
	}
	defer res.Body.Close()
	dec := json.NewDecoder(res.Body)
	for {
		var m jsonstream.Message
		if err := dec.Decode(&m); err == io.EOF {
			break
		} else if err != nil {
			return out.String(), fmt.Errorf("build output: %w", err)
		}
		out.WriteString(m.Stream)
		if m.Error != nil {
			return out.String(), fmt.Errorf("build: %s\n%s", m.Error.Message, out.String())
		}
	}
	if _, err := cli.ImageInspect(ctx, tag); err != nil {
		return out.String(), fmt.Errorf("not there after build: %w\n%s", err, out.String())
	}
	return out.String(), nil
}

const dockerfile = `FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8
WORKDIR /runner
CMD ["/bin/bash"]
`

// InstanceImageRepo is the repository of the EC2 stand-in's "AMI" image.
const InstanceImageRepo = "runfleet-test/ec2-instance"

// InstanceImage builds the image an ec2sim instance boots: bash, busybox,
// a static runfleet, the forge agents (static binaries, by name in /bin),
// a stand-in for cloud-init that runs the user data (/sbin/ec2-init), and
// a poweroff that ends the machine.
func InstanceImage(ctx context.Context, cli *client.Client, runfleet string, agents map[string]string) (string, error) {
	files := []ImageFile{
		// /bin/sh a shell, not busybox's: busybox's runs its own applets
		// before PATH, and its poweroff does nothing in a container, so
		// a boot script's poweroff would not end the machine.
		{Path: "bin/sh", From: BashStatic, Mode: 0o755},
		{Path: "bin/runfleet", From: runfleet, Mode: 0o755},
		{Path: "bin/ec2-init", Data: []byte(ec2Init), Mode: 0o755},
		{Path: "bin/poweroff", Data: []byte("#!/bin/sh\n# Ends the machine: its init is PID 1.\nkill -TERM 1\n"), Mode: 0o755},
	}
	for _, name := range slices.Sorted(maps.Keys(agents)) {
		files = append(files, ImageFile{Path: "bin/" + name, From: agents[name], Mode: 0o755})
	}
	return BuildImage(ctx, cli, InstanceImageRepo, files...)
}

// StockImageRepo is the repository of the clouds' stand-ins' stock image.
const StockImageRepo = "runfleet-test/stock-instance"

// StockImage builds the image a stand-in boots for a cloud's stock image
// (Ubuntu, a Deep Learning AMI): a shell, busybox's tools (wget,
// sha256sum, tar), the stand-in for cloud-init and a poweroff, and no
// runfleet and no agent, which its boot script must fetch.
func StockImage(ctx context.Context, cli *client.Client) (string, error) {
	return BuildImage(ctx, cli, StockImageRepo, stockFiles()...)
}

// stockFiles are a stock image's own: a shell (as InstanceImage's), the
// stand-in for cloud-init, and a poweroff.
func stockFiles() []ImageFile {
	return []ImageFile{
		{Path: "bin/sh", From: BashStatic, Mode: 0o755},
		{Path: "bin/ec2-init", Data: []byte(ec2Init), Mode: 0o755},
		{Path: "bin/poweroff", Data: []byte("#!/bin/sh\n# Ends the machine: its init is PID 1.\nkill -TERM 1\n"), Mode: 0o755},
	}
}

// StockDockerImageRepo is the repository of the stock image whose
// archive holds Docker.
const StockDockerImageRepo = "runfleet-test/stock-instance-docker"

// StockDockerImage is StockImage with an archive that holds Docker, for a
// boot script that installs it: apt-get stands in for Ubuntu's, whose
// docker.io package puts the CLI at /usr/bin/docker and starts the engine
// (https://packages.ubuntu.com/noble/amd64/docker.io/filelist). The CLI is
// dockerCLI, a static build; the engine is the host's, which the cloud's
// stand-in gives the machine (ec2sim's Engine).
func StockDockerImage(ctx context.Context, cli *client.Client, dockerCLI string) (string, error) {
	return BuildImage(ctx, cli, StockDockerImageRepo, append(stockFiles(),
		ImageFile{Path: "bin/apt-get", Data: []byte(aptGet), Mode: 0o755},
		ImageFile{Path: "usr/share/archive/docker", From: dockerCLI, Mode: 0o755})...)
}

// aptGet stands in for apt-get with an archive of one package, docker.io:
// `update` reads it, `install docker.io` installs it, anything else is
// not found, with apt-get's exit status (100).
const aptGet = `#!/bin/sh
echo "apt-get $*" >> /var/log/apt-get.log
case " $* " in
*" update "*) echo "Reading package lists... Done" ;;
*" install "*" docker.io "*)
  cp /usr/share/archive/docker /bin/docker && chmod 0755 /bin/docker && echo "Setting up docker.io ..." ;;
*) echo "E: Unable to locate package $*" >&2; exit 100 ;;
esac
`

// ec2Init plays cloud-init: it runs the user data once, its output on
// the console, and keeps the machine up until it is powered off.
const ec2Init = `#!/bin/sh
trap 'exit 0' TERM INT
ud=/var/lib/cloud/instance/user-data.txt
mkdir -p /var/log
if [ -s "$ud" ]; then
  chmod 700 "$ud"
  ( "$ud" 2>&1 | tee /var/log/cloud-init-output.log ) &
fi
while :; do sleep 3600 & wait $!; done
`
