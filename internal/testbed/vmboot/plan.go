package vmboot

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider/vm"
)

// PlanOf is the runner's plan a boot script (vm.Boot.Script) writes, as
// a process on the machine reads it back: the script's heredoc for
// vm.PlanPath, base64.
func PlanOf(script string) (bootstrap.Plan, error) {
	_, b64, ok := strings.Cut(script, vm.PlanPath+" <<'RUNFLEET_EOF'\n")
	b64, _, _ = strings.Cut(b64, "RUNFLEET_EOF")
	var plan bootstrap.Plan
	if !ok {
		return plan, fmt.Errorf("no plan for %s in the script", vm.PlanPath)
	}
	pj, err := base64.StdEncoding.DecodeString(strings.ReplaceAll(b64, "\n", ""))
	if err != nil {
		return plan, err
	}
	return plan, json.Unmarshal(pj, &plan)
}
