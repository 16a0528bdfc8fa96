// Package vmboot boots the cloud stand-ins' instances: each is a
// container of the instance image that runs its boot script (user data,
// a startup script) as the image's stand-in for cloud-init or the guest
// agent would, beside a metadata service of its own served here, which
// the cloud's stand-in answers. The clouds' stand-ins (ec2sim, gcesim,
// azuresim) share it; each says only how its metadata service answers
// and how the instance finds it.
package vmboot

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"
)

// InitPath is the image's stand-in for cloud-init: it runs ScriptPath
// once, and the machine stays up until something powers it off (PID 1
// exits).
const InitPath = "/sbin/ec2-init"

// ScriptPath is where the boot script is written in the container.
const ScriptPath = "/var/lib/cloud/instance/user-data.txt"

// Options describe one machine.
type Options struct {
	Docker *client.Client
	// HostAddr is how a container reaches this host
	// (host.docker.internal).
	HostAddr string
	// Name is the container's name; Hostname the machine's.
	Name, Image, Hostname string
	Labels                map[string]string
	// Script is the boot script.
	Script []byte
	// Metadata answers the machine's metadata service; Env gives the
	// environment that points the machine at it, from its host:port.
	Metadata http.Handler
	Env      func(hostPort string) []string
	// Binds are host paths given to the machine (host:container), as
	// docker run -v takes them.
	Binds []string
}

// Machine is one booted instance.
type Machine struct {
	docker    *client.Client
	Container string
	md        *http.Server
}

// Create serves the machine's metadata and makes its container with its
// boot script; Start starts it. On an error nothing is left.
func Create(ctx context.Context, o Options) (*Machine, error) {
	ln, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		return nil, err
	}
	hostPort := o.HostAddr + ":" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	m := &Machine{docker: o.Docker, md: &http.Server{Handler: o.Metadata, ReadHeaderTimeout: 10 * time.Second}}
	go m.md.Serve(ln)
	var env []string
	if o.Env != nil {
		env = o.Env(hostPort)
	}
	created, err := o.Docker.ContainerCreate(ctx, client.ContainerCreateOptions{
		Name: o.Name,
		Config: &container.Config{
			Image: o.Image, Cmd: []string{InitPath}, Hostname: o.Hostname, Env: env, Labels: o.Labels,
		},
		HostConfig: &container.HostConfig{ExtraHosts: []string{"host.docker.internal:host-gateway"}, Binds: o.Binds},
	})
	if err != nil {
		_ = m.md.Close()
		return nil, fmt.Errorf("create: %w", err)
	}
	m.Container = created.ID
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"var/", "var/lib/", "var/lib/cloud/", "var/lib/cloud/instance/"} {
		_ = tw.WriteHeader(&tar.Header{Name: d, Typeflag: tar.TypeDir, Mode: 0o755})
	}
	_ = tw.WriteHeader(&tar.Header{Name: ScriptPath[1:], Mode: 0o700, Size: int64(len(o.Script))})
	_, _ = tw.Write(o.Script)
	_ = tw.Close()
	if _, err := o.Docker.CopyToContainer(ctx, created.ID, client.CopyToContainerOptions{DestinationPath: "/", Content: &buf}); err != nil {
		m.Finish()
		return nil, fmt.Errorf("boot script: %w", err)
	}
	return m, nil
}

// Start starts the machine.
func (m *Machine) Start(ctx context.Context) error {
	if _, err := m.docker.ContainerStart(ctx, m.Container, client.ContainerStartOptions{}); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	return nil
}

// Wait returns once the machine is off.
func (m *Machine) Wait() {
	res := m.docker.ContainerWait(context.Background(), m.Container, client.ContainerWaitOptions{Condition: container.WaitConditionNotRunning})
	select {
	case <-res.Result:
	case <-res.Error:
	}
}

// Stop shuts the machine down (its init gets SIGTERM, then SIGKILL 2 s
// later).
func (m *Machine) Stop() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	timeout := 2
	_, _ = m.docker.ContainerStop(ctx, m.Container, client.ContainerStopOptions{Timeout: &timeout})
}

// Finish removes the machine and its metadata service and returns what
// it printed (the last 500 lines).
func (m *Machine) Finish() string {
	_ = m.md.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Read again after a failure (an engine slow under load once left a
	// console empty), and say why where it cannot be read: an empty
	// console reads as a machine that printed nothing.
	var console string
	var err error
	for wait := 250 * time.Millisecond; ; wait *= 4 {
		if console, err = m.console(ctx); err == nil || wait > 4*time.Second {
			break
		}
		time.Sleep(wait)
	}
	if err != nil {
		console = "(the console could not be read: " + err.Error() + ")"
	}
	_, _ = m.docker.ContainerRemove(ctx, m.Container, client.ContainerRemoveOptions{Force: true})
	return console
}

// console is the last 500 lines the machine printed.
func (m *Machine) console(ctx context.Context) (string, error) {
	logs, err := m.docker.ContainerLogs(ctx, m.Container, client.ContainerLogsOptions{ShowStdout: true, ShowStderr: true, Tail: "500"})
	if err != nil {
		return "", err
	}
	defer logs.Close()
	b, err := io.ReadAll(io.LimitReader(logs, 1<<20))
	return string(b), err
}
