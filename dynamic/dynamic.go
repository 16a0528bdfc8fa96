// Package dynamic reads what a job asks its machine to be, in labels of
// its runs-on (gpus=2, gpu=h100, cpu=8, mem=64g, image=cuda12.4,
// spot=false; on a batch scheduler partition=short, constraint=ib,
// time=2h), and checks it against what its pool allows (the pool's
// `dynamic:` section). A pool with such a section starts, for each job,
// a runner with exactly what the job asked for; a request outside the
// limits starts nothing, and its reason is shown.
package dynamic

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// nameRE is a Slurm name that a label's value can hold.
var nameRE = lazyregexp.New(`^[A-Za-z0-9_.+-]+$`)

// The keys a job may ask for.
const (
	KeyGPUs  = "gpus"  // how many GPUs
	KeyGPU   = "gpu"   // which model: h100, a100
	KeyCPU   = "cpu"   // CPUs
	KeyMem   = "mem"   // memory: 64g, 512m
	KeyImage = "image" // a name the pool maps to an image
	KeySpot  = "spot"  // true or false
	// A batch scheduler's options (Slurm's sbatch): the partition, a
	// node feature, and the job's own time.
	KeyPartition  = "partition"
	KeyConstraint = "constraint"
	KeyTime       = "time" // how long the job runs: 90m, 2h
)

// The most a pool may let a job ask for, beyond any machine there is
// (the largest have under a thousand CPUs and 32 TiB): a value past them
// is a slip, refused with the bound rather than sent to a backend.
const (
	maxCPUs  = 4096
	maxBytes = 64 << 40
)

// Keys lists them, in the order requests are written.
var Keys = []string{KeyGPUs, KeyGPU, KeyCPU, KeyMem, KeyImage, KeySpot, KeyPartition, KeyConstraint, KeyTime}

// Limits is a pool's `dynamic:` section: what its jobs may ask for. A key
// left out may not be asked for.
type Limits struct {
	// GPUs are the GPU counts a job may ask for.
	GPUs []int `json:"gpus"`
	// GPU are the models a job may ask for, as the hardware labels name
	// them (h100 for gpu-h100).
	GPU []string `json:"gpu"`
	// CPU is the most CPUs, Mem the most memory a job may ask for.
	CPU float64 `json:"cpu"`
	Mem string  `json:"mem"`
	// Image maps the names a job may ask for to images.
	Image map[string]string `json:"image"`
	// Spot lets a job choose spot=true or spot=false.
	Spot bool `json:"spot"`
	// Partition are the partitions, Constraint the node features (one
	// per job) a job may ask for.
	Partition  []string `json:"partition"`
	Constraint []string `json:"constraint"`
	// Time is the longest a job may say it runs (time=): its machine's
	// time limit makes room for that instead of the pool's job_timeout.
	Time string `json:"time"`

	mem  int64
	time time.Duration
}

// MaxTime is the longest time a job may ask for; 0 when it may not.
func (l Limits) MaxTime() time.Duration { return l.time }

// Request is what one job asked for; zero fields keep the pool's own
// settings.
type Request struct {
	GPUs   int    // 0: the pool's gpus_per_runner
	GPU    string // a model, lower case
	CPUs   float64
	Memory int64  // bytes
	Image  string // the image itself, from the pool's names
	Spot   *bool

	Partition  string
	Constraint string
	Time       time.Duration // 0: the pool's job_timeout
}

// IsZero reports whether the job asked for nothing.
func (r Request) IsZero() bool { return r == Request{} }

// Keys lists the keys a pool allows.
func (l Limits) Keys() []string {
	var out []string
	for _, k := range Keys {
		if l.allows(k) {
			out = append(out, k)
		}
	}
	return out
}

func (l Limits) allows(key string) bool {
	switch key {
	case KeyGPUs:
		return len(l.GPUs) > 0
	case KeyGPU:
		return len(l.GPU) > 0
	case KeyCPU:
		return l.CPU > 0
	case KeyMem:
		return l.Mem != ""
	case KeyImage:
		return len(l.Image) > 0
	case KeySpot:
		return l.Spot
	case KeyPartition:
		return len(l.Partition) > 0
	case KeyConstraint:
		return len(l.Constraint) > 0
	case KeyTime:
		return l.Time != ""
	}
	return false
}

// Check reads and checks the section; it returns each problem as
// "field: message" relative to the section.
func (l *Limits) Check() error {
	var errs []error
	for i, n := range l.GPUs {
		if n < 1 || n > 64 {
			errs = append(errs, fmt.Errorf("gpus[%d]: %d is not a number of GPUs from 1 to 64", i, n))
		}
	}
	for i, g := range l.GPU {
		if g == "" || strings.ContainsAny(g, "=:, ") {
			errs = append(errs, fmt.Errorf("gpu[%d]: %q is not a GPU model's name (h100)", i, g))
		}
	}
	if !(l.CPU >= 0 && l.CPU <= maxCPUs) { // NaN too
		errs = append(errs, fmt.Errorf("cpu: %v is not a number of CPUs from 0 to %d", l.CPU, maxCPUs))
	}
	if l.Mem != "" {
		n, err := ParseBytes(l.Mem)
		if err != nil {
			errs = append(errs, fmt.Errorf("mem: %w", err))
		}
		l.mem = n
	}
	for _, name := range slices.Sorted(maps.Keys(l.Image)) {
		if name == "" || strings.ContainsAny(name, "=:, ") || l.Image[name] == "" {
			errs = append(errs, fmt.Errorf("image.%s: a name (no '=', ':', ',' or space) for an image", name))
		}
	}
	for field, names := range map[string][]string{"partition": l.Partition, "constraint": l.Constraint} {
		for i, n := range names {
			// What a label's value can hold, and a Slurm name: a
			// constraint is one feature, not an expression.
			if !nameRE.MatchString(n) {
				errs = append(errs, fmt.Errorf("%s[%d]: %q is not a name (letters, digits, _ . + -)", field, i, n))
			}
		}
	}
	if l.Time != "" {
		d, err := time.ParseDuration(l.Time)
		if err != nil || d < time.Minute || d > 366*24*time.Hour {
			errs = append(errs, fmt.Errorf("time: %q is not a duration from 1m to a year (2h, 90m)", l.Time))
		}
		l.time = d
	}
	return errors.Join(errs...)
}

// Decode reads a section written as JSON (the config's form of YAML).
func Decode(raw json.RawMessage) (Limits, error) {
	var l Limits
	if len(raw) == 0 || string(raw) == "null" {
		return l, nil
	}
	if err := json.Unmarshal(raw, &l); err != nil {
		return l, err
	}
	return l, l.Check()
}

// Split separates a job's labels into its plain labels and its requests
// (key=value labels whose key is one of Keys), the requests sorted by key.
func Split(labels []string) (plain, asks []string) {
	for _, l := range labels {
		if k, _, ok := strings.Cut(l, "="); ok && slices.Contains(Keys, strings.ToLower(k)) {
			asks = append(asks, l)
		} else {
			plain = append(plain, l)
		}
	}
	slices.SortFunc(asks, func(a, b string) int {
		ka, _, _ := strings.Cut(a, "=")
		kb, _, _ := strings.Cut(b, "=")
		return cmp.Compare(slices.Index(Keys, strings.ToLower(ka)), slices.Index(Keys, strings.ToLower(kb)))
	})
	return plain, asks
}

// Shape names a set of requests: its labels as the job wrote them (the
// runner registers with them, and forges compare labels as written),
// sorted, joined by commas; "" for a job that asks for nothing.
func Shape(labels []string) string {
	_, asks := Split(labels)
	return strings.Join(asks, ",")
}

// Labels are a shape's labels.
func Labels(shape string) []string {
	if shape == "" {
		return nil
	}
	return strings.Split(shape, ",")
}

// Resolve reads a shape's requests and checks them against the limits; the
// error says which request is outside them and what the pool allows.
func (l Limits) Resolve(shape string) (Request, error) {
	var r Request
	seen := map[string]bool{}
	for _, a := range Labels(shape) {
		k, v, _ := strings.Cut(a, "=")
		k = strings.ToLower(k)
		if k != KeyImage {
			v = strings.ToLower(v)
		}
		if seen[k] {
			return r, fmt.Errorf("%s is asked for twice", k)
		}
		seen[k] = true
		if !l.allows(k) {
			return r, fmt.Errorf("%s: this pool lets jobs choose only %s", a, strings.Join(l.Keys(), ", "))
		}
		if err := l.resolve(&r, k, v); err != nil {
			return r, fmt.Errorf("%s: %w", a, err)
		}
	}
	return r, nil
}

func (l Limits) resolve(r *Request, k, v string) error {
	switch k {
	case KeyGPUs:
		n, err := strconv.Atoi(v)
		if err != nil || !slices.Contains(l.GPUs, n) {
			return fmt.Errorf("the pool allows gpus=%s", joinInts(l.GPUs))
		}
		r.GPUs = n
	case KeyGPU:
		if !slices.Contains(l.GPU, v) {
			return fmt.Errorf("the pool allows gpu=%s", strings.Join(l.GPU, "|"))
		}
		r.GPU = v
	case KeyCPU:
		n, err := strconv.ParseFloat(v, 64)
		if err != nil || !(n > 0 && n <= l.CPU) { // NaN and Inf too
			return fmt.Errorf("the pool allows cpu up to %v", l.CPU)
		}
		r.CPUs = n
	case KeyMem:
		n, err := ParseBytes(v)
		if err != nil || n <= 0 || n > l.mem {
			return fmt.Errorf("the pool allows mem up to %s", l.Mem)
		}
		r.Memory = n
	case KeyImage:
		img, ok := l.Image[v]
		if !ok {
			return fmt.Errorf("the pool's images are %s", strings.Join(slices.Sorted(maps.Keys(l.Image)), ", "))
		}
		r.Image = img
	case KeySpot:
		b, err := strconv.ParseBool(v)
		if err != nil {
			return errors.New("spot is true or false")
		}
		r.Spot = &b
	case KeyPartition:
		// Labels may be compared without case (GitHub's are); Slurm's
		// names are not, so the pool's spelling is the one used.
		i := slices.IndexFunc(l.Partition, func(p string) bool { return strings.EqualFold(p, v) })
		if i < 0 {
			return fmt.Errorf("the pool allows partition=%s", strings.Join(l.Partition, "|"))
		}
		r.Partition = l.Partition[i]
	case KeyConstraint:
		i := slices.IndexFunc(l.Constraint, func(c string) bool { return strings.EqualFold(c, v) })
		if i < 0 {
			return fmt.Errorf("the pool allows constraint=%s", strings.Join(l.Constraint, "|"))
		}
		r.Constraint = l.Constraint[i]
	case KeyTime:
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > l.time {
			return fmt.Errorf("the pool allows time up to %s (a duration: 90m, 2h)", l.Time)
		}
		r.Time = d
	}
	return nil
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, "|")
}

// ParseBytes reads a size: 512m, 64g, 1.5g, 1024k, 2t, or bytes.
func ParseBytes(s string) (int64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "ib"), "b")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'k':
			mult = 1 << 10
		case 'm':
			mult = 1 << 20
		case 'g':
			mult = 1 << 30
		case 't':
			mult = 1 << 40
		}
		if mult > 1 {
			t = t[:n-1]
		}
	}
	f, err := strconv.ParseFloat(t, 64)
	if err != nil || !(f > 0 && f*float64(mult) <= maxBytes) { // NaN and Inf too
		return 0, fmt.Errorf("%q is not a size from 1 byte to 64t (512m, 64g)", s)
	}
	return int64(f * float64(mult)), nil
}
