package gcp

import (
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// MaxMetadataValue is Compute Engine's limit on one metadata value.
const MaxMetadataValue = 256 << 10

// startupScript is the instance's boot script (vm.Boot), run by the
// guest agent from the startup-script metadata, with preemptions read
// from Compute Engine's metadata server. With a handoff it holds no
// credential and names no runner.
func startupScript(s Section, h *bootstrap.Handoff, spec provider.Spec, now time.Time, idle, lifetime time.Duration) (string, error) {
	b, err := boot(s, h, idle, lifetime).Script(spec, now)
	return string(b), err
}

func boot(s Section, h *bootstrap.Handoff, idle, lifetime time.Duration) vm.Boot {
	return vm.Boot{
		Cloud: "Compute Engine", Notices: "gcp", Limit: MaxMetadataValue, Runfleet: s.Runfleet, Workdir: s.Workdir, Install: s.Install,
		StartupScript: s.StartupScript, SSHPublicKey: s.SSHPublicKey, IdleTimeout: idle, Lifetime: lifetime, Handoff: h,
	}
}

// boot is the pool's vm.Boot with handoff h.
func (p *Provider) boot(h *bootstrap.Handoff) vm.Boot {
	return boot(p.opt.Section, h, p.opt.IdleTimeout, p.opt.Lifetime)
}
