package config

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// GPUCount is a number of GPUs, or "all" (-1).
type GPUCount int

// AllGPUs is gpus_per_runner: all.
const AllGPUs GPUCount = -1

func (g GPUCount) MarshalJSON() ([]byte, error) {
	if g == AllGPUs {
		return json.Marshal("all")
	}
	return json.Marshal(int(g))
}

// badGPUCount marks a value that did not parse, for Validate to name.
const badGPUCount GPUCount = -2

func (g *GPUCount) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*g = badGPUCount
		if s == "all" {
			*g = AllGPUs
		}
		return nil
	}
	var n int
	if err := json.Unmarshal(b, &n); err != nil || n < 0 {
		*g = badGPUCount
		return nil
	}
	*g = GPUCount(n)
	return nil
}

// Duration is a time.Duration written as "30s", "5m" or "1h30m" in YAML.
// A value that does not parse is kept, so that Check can name it.
type Duration struct {
	time.Duration
	invalid string
}

// D makes a Duration.
func D(d time.Duration) Duration { return Duration{Duration: d} }

// Given reports whether the value was written, well or badly.
func (d Duration) Given() bool { return d.Duration != 0 || d.invalid != "" }

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		*d = Duration{invalid: string(b)}
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		*d = Duration{invalid: s}
		return nil
	}
	*d = Duration{Duration: v}
	return nil
}

// Check reports an unparsable or negative duration.
func (d Duration) Check() error {
	switch {
	case d.invalid != "":
		return fmt.Errorf("invalid duration %q (use a number with a unit: \"30s\", \"5m\", \"1h\")", d.invalid)
	case d.Duration < 0:
		return fmt.Errorf("must not be negative, got %s", d.Duration)
	}
	return nil
}

var envRef = lazyregexp.New(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)

// Expand replaces ${NAME} with the environment variable NAME. An unset
// variable is an error rather than an empty string: an empty token would
// only fail later, further from its cause.
func Expand(s string) (string, error) {
	var missing []string
	out := envRef.ReplaceAllStringFunc(s, func(m string) string {
		name := m[2 : len(m)-1]
		v, ok := os.LookupEnv(name)
		if !ok {
			missing = append(missing, name)
		}
		return v
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("environment variable %s is not set", strings.Join(missing, ", "))
	}
	return out, nil
}
