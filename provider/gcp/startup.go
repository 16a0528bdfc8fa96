package gcp

import (
	"time"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// MaxMetadataValue is Compute Engine's limit on one metadata value.
const MaxMetadataValue = 256 << 10

// startupScript is the instance's boot script (vm.Boot), run by the
// guest agent from the startup-script metadata, with preemptions read
// from Compute Engine's metadata server.
func startupScript(s Section, spec provider.Spec, now time.Time, idle, lifetime time.Duration) (string, error) {
	b, err := vm.Boot{
		Cloud: "Compute Engine", Notices: "gcp", Limit: MaxMetadataValue, Runfleet: s.Runfleet, Workdir: s.Workdir, Install: s.Install,
		StartupScript: s.StartupScript, SSHPublicKey: s.SSHPublicKey, IdleTimeout: idle, Lifetime: lifetime,
	}.Script(spec, now)
	return string(b), err
}
