package docker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/provider"
)

func init() { provider.Register("docker", driver{}) }

// driver is the registry's entry for Docker containers, configured by the
// pool's `docker:` section.
type driver struct{}

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section, c.GPUsPerRunner)
	return err
}

// Open connects to the engine named by DOCKER_HOST, one connection per
// pool, and chooses the pool's image by the host's CUDA version when the
// section asks for that.
func (driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section, c.GPUsPerRunner)
	if err != nil {
		return nil, err
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	if s.NeedsGPUs() {
		if c.GPUs == nil {
			return nil, errors.New("docker.image: chosen by CUDA version, but the host's GPUs are not known here")
		}
		inv := c.GPUs()
		image, err := gpu.PickImage(s.Image, s.GPUImages(), inv)
		if err != nil {
			return nil, fmt.Errorf("docker.image: %w", err)
		}
		if image != s.Image {
			log.Info("image chosen for the driver's CUDA version", "pool", c.Pool, "image", image, "cuda", inv.CUDA)
		}
		s.Image, s.Images = image, nil
	}
	opt, err := s.Options()
	if err != nil {
		return nil, fmt.Errorf("docker: %w", err)
	}
	cli, err := NewClient()
	if err != nil {
		return nil, err
	}
	opt.Client, opt.closeClient = cli, true
	opt.Manager, opt.Pool, opt.ReadOnly = c.Manager, c.Pool, c.ReadOnly
	opt.LogDir = filepath.Join(c.StateDir, "logs")
	// The runners' files are bind-mounted where the engine shares this
	// host's filesystem, and copied into the container where it does
	// not (a remote engine).
	// A directory per pool: each pool prunes the files of its containers
	// that are gone, and must not take another pool's for those.
	if localEngine(cli.DaemonHost()) {
		opt.FilesDir = filepath.Join(c.StateDir, "docker", c.Pool)
	}
	opt.Logger = log.With("provider", "docker", "pool", c.Pool)
	p, err := New(opt)
	if err != nil {
		_ = cli.Close()
		return nil, err
	}
	return p, nil
}

func localEngine(host string) bool { return strings.HasPrefix(host, "unix://") }

// Traits: containers come with their image; an engine on this host gives
// them this host's GPUs by device id.
func (p *Provider) Traits() provider.Traits {
	return provider.Traits{HostGPUs: localEngine(p.cli.DaemonHost())}
}

// Image is the image the pool's containers run, as chosen at Open.
func (p *Provider) Image() string { return p.opt.Image }

// Honours says what a job of a dynamic pool may ask a container to be: its
// CPU and memory limits and its image.
func (p *Provider) Honours() []string {
	return []string{dynamic.KeyCPU, dynamic.KeyMem, dynamic.KeyImage}
}

// LocalOutput: the output is a file on this host (provider.LocalOutput).
func (*Provider) LocalOutput() {}

// Output opens the end of the copy of a container's output, which
// outlives the container.
func (p *Provider) Output(_ context.Context, inst provider.Instance, max int64) (io.ReadCloser, error) {
	if p.opt.LogDir == "" || inst.Name == "" || inst.ID == "" {
		return nil, provider.ErrNoOutput
	}
	return provider.TailFile(p.logFile(inst.ID, inst.Name), max)
}

// CMLSection takes `--docker IMAGE` (and `--docker-volumes`): a fresh
// container of that image for each job.
func (driver) CMLSection(o provider.CMLOptions) (json.RawMessage, bool, error) {
	if o.Docker == "" {
		return nil, false, nil
	}
	b, err := json.Marshal(Section{Image: o.Docker, Volumes: o.DockerVolumes})
	return b, true, err
}
