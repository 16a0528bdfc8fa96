package aws

import (
	"time"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// MaxUserData is EC2's limit on user data, before its base64 encoding.
const MaxUserData = 16 << 10

// userData is the instance's boot script (vm.Boot), run by cloud-init,
// with the instance interruptions read from EC2's metadata service.
func userData(s Section, h *bootstrap.Handoff, spec provider.Spec, now time.Time, idle, lifetime time.Duration) ([]byte, error) {
	return boot(s, h, idle, lifetime).Script(spec, now)
}

func boot(s Section, h *bootstrap.Handoff, idle, lifetime time.Duration) vm.Boot {
	return vm.Boot{
		Cloud: "EC2", Notices: "aws", Limit: MaxUserData, Runfleet: s.Runfleet, Workdir: s.Workdir, Install: s.Install,
		StartupScript: s.StartupScript, SSHPublicKey: s.SSHPublicKey, IdleTimeout: idle, Lifetime: lifetime, Handoff: h,
	}
}
