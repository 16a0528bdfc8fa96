package azurepipelines

import (
	"strconv"
	"strings"
)

// A pool's labels are its agents' user capabilities: "cuda" becomes the
// capability cuda (with the value true), "gpu=a100" the capability gpu
// with the value a100. A pipeline's demands name them: "cuda" wants the
// capability to exist, "gpu -equals a100" wants its value, "cuda
// -gtVersion 12.0" a version at least that.

// capTrue is the value of a capability that a label without a value
// gives: Azure DevOps keeps a value for every capability.
const capTrue = "true"

// capabilities turns labels into user capabilities.
func capabilities(labels []string) map[string]string {
	caps := make(map[string]string, len(labels))
	for _, l := range labels {
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			v = capTrue
		}
		caps[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return caps
}

// label is a capability as a label.
func label(k, v string) string {
	if v == capTrue {
		return k
	}
	return k + "=" + v
}

// demand is one of a job's demands, as the server writes it: a capability
// name alone (it must exist), or with an operator and a value.
type demand struct {
	Name  string
	Op    string // "" (exists), "equals" or "gtVersion"
	Value string
}

// parseDemand reads a demand string ("cuda", "Agent.OS -equals Linux",
// "Agent.Version -gtVersion 2.163.1").
func parseDemand(s string) (demand, bool) {
	s = strings.TrimSpace(s)
	name, rest, found := strings.Cut(s, " ")
	if name == "" {
		return demand{}, false
	}
	if !found {
		return demand{Name: name}, true
	}
	rest = strings.TrimSpace(rest)
	op, value, _ := strings.Cut(rest, " ")
	if !strings.HasPrefix(op, "-") {
		return demand{}, false
	}
	op = op[1:]
	value = strings.TrimSpace(value)
	switch {
	case strings.EqualFold(op, "equals"):
		return demand{Name: name, Op: "equals", Value: value}, true
	case strings.EqualFold(op, "gtVersion"):
		return demand{Name: name, Op: "gtVersion", Value: value}, true
	case strings.EqualFold(op, "exists") && value == "":
		return demand{Name: name}, true
	}
	return demand{}, false
}

// meets reports whether capabilities meet every demand, as the server
// decides whether an agent may take a job: names compare without regard
// to case, as do equal values; a demand it cannot read is not met.
func meets(caps map[string]string, demands []string) bool {
	for _, s := range demands {
		d, ok := parseDemand(s)
		if !ok {
			return false
		}
		v, ok := lookup(caps, d.Name)
		if !ok {
			return false
		}
		switch d.Op {
		case "equals":
			if !strings.EqualFold(v, d.Value) {
				return false
			}
		case "gtVersion":
			if compareVersions(v, d.Value) < 0 {
				return false
			}
		}
	}
	return true
}

func lookup(caps map[string]string, name string) (string, bool) {
	if v, ok := caps[name]; ok {
		return v, true
	}
	for k, v := range caps {
		if strings.EqualFold(k, name) {
			return v, true
		}
	}
	return "", false
}

// compareVersions compares dotted versions number by number; a part that
// is not a number compares as 0, a missing part as 0.
func compareVersions(a, b string) int {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := range max(len(pa), len(pb)) {
		var x, y int
		if i < len(pa) {
			x, _ = strconv.Atoi(pa[i])
		}
		if i < len(pb) {
			y, _ = strconv.Atoi(pb[i])
		}
		if x != y {
			if x < y {
				return -1
			}
			return 1
		}
	}
	return 0
}
