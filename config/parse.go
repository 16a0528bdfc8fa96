package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/secret"
)

// Load reads, expands, defaults and validates the config file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	c, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// Parse parses, expands, defaults and validates a config document.
func Parse(data []byte) (*Config, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, errors.New("config is empty")
	}
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, fmt.Errorf("parse: %s%s", strings.TrimPrefix(err.Error(), "error converting YAML to JSON: "), tabHint(data, err))
	}
	c, failed, err := decode(js)
	if c == nil {
		return nil, err
	}
	// Every problem at once: what decoded is checked too, but for the
	// entries that did not, whose other problems may only echo that.
	errs := []error{err, c.resolve()}
	c.setDefaults()
	for _, e := range flatten(c.Validate()) {
		if !slices.ContainsFunc(failed, func(entry string) bool { return within(e.Error(), entry) }) {
			errs = append(errs, e)
		}
	}
	if err := sortErrors(errors.Join(errs...)); err != nil {
		return nil, err
	}
	return c, nil
}

var yamlLine = lazyregexp.New(`line (\d+):`)

// tabHint says what the YAML parser does not: that the line it stopped at
// holds a tab, which YAML never takes as indentation.
func tabHint(data []byte, err error) string {
	m := yamlLine.FindStringSubmatch(err.Error())
	if m == nil {
		return ""
	}
	n, _ := strconv.Atoi(m[1])
	lines := strings.Split(string(data), "\n")
	for _, i := range []int{n - 1, n - 2} { // the line named, or the one before it
		if i >= 0 && i < len(lines) && strings.Contains(lines[i], "\t") {
			return fmt.Sprintf(" (line %d holds a tab: YAML indents with spaces only)", i+1)
		}
	}
	return ""
}

// within reports whether a problem is about the entry (forges[0]) or one
// of its fields.
func within(problem, entry string) bool {
	rest, ok := strings.CutPrefix(problem, entry)
	return ok && (strings.HasPrefix(rest, ".") || strings.HasPrefix(rest, ":"))
}

// decode reads the document: the common fields strictly, and each forge's
// and pool's driver keys as written. It returns every problem found, and
// the entries that did not decode ("forges[0]"); a nil config when the
// document itself did not.
func decode(js []byte) (*Config, []string, error) {
	var c Config
	var errs []error
	var failed []string
	obj, ok := object(js)
	if !ok {
		return nil, nil, errors.New("config: must be a mapping")
	}
	rest, err := decodeFields(obj, "", &c, "forges", "pools")
	if err != nil {
		return nil, nil, err
	}
	if v, ok := obj["status_listen"]; ok {
		c.StatusListenGiven = true
		if string(v) == `""` || string(v) == "null" {
			c.StatusListen = "off" // written empty: none, as off
		}
	}
	for _, k := range slices.Sorted(maps.Keys(rest)) {
		if k != "forges" && k != "pools" {
			errs = append(errs, fmt.Errorf("parse: unknown field %q", k))
		}
	}
	var forges, pools []json.RawMessage
	if err := list(rest, "forges", &forges); err != nil {
		errs = append(errs, err)
	}
	if err := list(rest, "pools", &pools); err != nil {
		errs = append(errs, err)
	}
	for i, raw := range forges {
		entry := fmt.Sprintf("forges[%d]", i)
		f, err := decodeForge(raw, entry)
		if err != nil {
			errs, failed = append(errs, err), append(failed, entry)
		}
		c.Forges = append(c.Forges, f)
	}
	for i, raw := range pools {
		entry := fmt.Sprintf("pools[%d]", i)
		p, err := decodePool(raw, entry)
		if err != nil {
			errs, failed = append(errs, err), append(failed, entry)
		}
		c.Pools = append(c.Pools, p)
	}
	return &c, failed, errors.Join(errs...)
}

// list decodes the list under key, if there is one.
func list(obj map[string]json.RawMessage, key string, into *[]json.RawMessage) error {
	raw, ok := obj[key]
	if !ok || string(raw) == "null" {
		return nil
	}
	if err := json.Unmarshal(raw, into); err != nil {
		return fmt.Errorf("%s: must be a list", key)
	}
	return nil
}

func decodeForge(raw json.RawMessage, path string) (Forge, error) {
	var f Forge
	obj, ok := object(raw)
	if !ok {
		return f, fmt.Errorf("%s: must be a mapping", path)
	}
	rest, err := decodeFields(obj, path, &f)
	if err != nil {
		return f, err
	}
	if _, ok := obj["poll_interval"]; ok {
		// Written as zero: the forge is not polled.
		f.PollOff = !f.PollInterval.Given()
	}
	if len(rest) > 0 {
		if f.Section, err = json.Marshal(rest); err != nil {
			return f, fmt.Errorf("%s: %w", path, err)
		}
	}
	return f, nil
}

func decodePool(raw json.RawMessage, path string) (Pool, error) {
	var p Pool
	obj, ok := object(raw)
	if !ok {
		return p, fmt.Errorf("%s: must be a mapping", path)
	}
	rest, err := decodeFields(obj, path, &p)
	if err != nil {
		return p, err
	}
	if _, ok := obj["size"]; !ok && p.GPUsPerRunner != 0 && p.Dynamic == nil {
		// A pool of GPU runners without a size is sized by its GPUs;
		// one whose jobs choose their GPUs keeps none idle unless told.
		p.SizeFromGPUs = true
	}
	var errs []error
	sections := map[string]json.RawMessage{}
	for _, k := range slices.Sorted(maps.Keys(rest)) {
		if _, ok := provider.Lookup(k); ok {
			sections[k] = rest[k]
			continue
		}
		if how, out := provider.LeftOut(k); out {
			errs = append(errs, fmt.Errorf("%s.%s: provider %q is not in this build of runfleet: %s", path, k, k, how))
			continue
		}
		errs = append(errs, fmt.Errorf("%s: unknown field %q (neither a pool's field nor a provider of this build: %s)", path, k, strings.Join(provider.Names(), ", ")))
	}
	names := slices.Sorted(maps.Keys(sections))
	switch {
	case p.Provider == "" && len(names) == 1:
		p.Provider = names[0]
	case p.Provider == "" && len(names) > 1:
		return p, errors.Join(append(errs, fmt.Errorf("%s: has sections for %s; set provider to one of them", path, strings.Join(names, " and ")))...)
	}
	for _, k := range names {
		if k == p.Provider {
			p.Section = sections[k]
			continue
		}
		errs = append(errs, fmt.Errorf("%s.%s: is set but provider is %q; set provider: %s", path, k, p.Provider, k))
	}
	return p, errors.Join(errs...)
}

// object reads a JSON object, keeping each value as written.
func object(raw []byte) (map[string]json.RawMessage, bool) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
		return nil, false
	}
	return obj, true
}

// decodeFields decodes each key of obj that names a field of v (a pointer
// to a struct), strictly, but for those in skip; each problem is named by
// path and the key. It returns the keys it did not decode.
func decodeFields(obj map[string]json.RawMessage, path string, v any, skip ...string) (map[string]json.RawMessage, error) {
	fields := jsonFields(reflect.TypeOf(v).Elem())
	rv := reflect.ValueOf(v).Elem()
	rest := map[string]json.RawMessage{}
	var errs []error
	for _, k := range slices.Sorted(maps.Keys(obj)) {
		i, ok := fields[k]
		if !ok || slices.Contains(skip, k) {
			rest[k] = obj[k]
			continue
		}
		if err := decodeValue(obj[k], rv.Field(i).Addr().Interface()); err != nil {
			errs = append(errs, fmt.Errorf("%s%w", join(path, k), err))
		}
	}
	return rest, errors.Join(errs...)
}

func join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

// DecodeSection decodes a driver's section strictly into v, a pointer to
// a struct: a key v has no field for is an error. A number or a boolean
// given where v has a string is taken as that string, as YAML writers
// expect (token: 12345). Each problem names its field, relative to the
// section; the caller prefixes the section's own name.
func DecodeSection(raw []byte, v any) error {
	if len(raw) == 0 {
		return nil
	}
	obj, ok := object(raw)
	if !ok {
		return errors.New("must be a mapping")
	}
	rest, err := decodeFields(obj, "", v)
	errs := []error{err}
	for _, k := range slices.Sorted(maps.Keys(rest)) {
		errs = append(errs, fmt.Errorf("%s: unknown field", k))
	}
	return errors.Join(errs...)
}

// decodeValue decodes one field's value (JSON) into v. It goes through
// sigs.k8s.io/yaml, which takes a number or a boolean as a string where v
// wants one, as the whole document was before it was split by drivers.
// The error begins with what to add to the field's name (".sub" for a
// nested field) and then ": " and the problem.
func decodeValue(raw json.RawMessage, v any) error {
	err := yaml.UnmarshalStrict(raw, v)
	if err == nil {
		return nil
	}
	if te, ok := errors.AsType[*json.UnmarshalTypeError](err); ok {
		sub := ""
		if te.Field != "" {
			sub = "." + te.Field
		}
		return fmt.Errorf("%s: must be %s, got %s", sub, typeName(te.Type.Kind().String()), te.Value)
	}
	msg := err.Error()
	for _, p := range []string{"error converting YAML to JSON: ", "error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		msg = strings.ReplaceAll(msg, p, "")
	}
	if rest, ok := strings.CutPrefix(msg, "unknown field "); ok {
		// A nested mapping's stray key: agent: {paht: x}.
		return fmt.Errorf(": unknown field %s", rest)
	}
	return fmt.Errorf(": %s", msg)
}

var fieldCache sync.Map // reflect.Type -> map[string]int

// jsonFields maps the JSON names of a struct's fields to their indexes.
func jsonFields(t reflect.Type) map[string]int {
	if m, ok := fieldCache.Load(t); ok {
		return m.(map[string]int)
	}
	m := map[string]int{}
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		if name != "" && name != "-" {
			m[name] = i
		}
	}
	fieldCache.Store(t, m)
	return m
}

// resolve expands ${ENV} references and reads token files.
func (c *Config) resolve() error {
	var errs []error
	if tok, err := Expand(c.StatusToken.Reveal()); err != nil {
		errs = append(errs, fmt.Errorf("status_token: %w", err))
	} else {
		c.StatusToken = secret.String(strings.TrimSpace(tok))
	}
	for i := range c.Forges {
		f := &c.Forges[i]
		field := fmt.Sprintf("forges[%d]", i)
		var err error
		if f.URL, err = Expand(f.URL); err != nil {
			errs = append(errs, fmt.Errorf("%s.url: %w", field, err))
		}
		if f.RunnerURL, err = Expand(f.RunnerURL); err != nil {
			errs = append(errs, fmt.Errorf("%s.runner_url: %w", field, err))
		}
		tok, err := Expand(f.Token.Reveal())
		if err != nil {
			errs = append(errs, fmt.Errorf("%s.token: %w", field, err))
		}
		// A token from a variable is trimmed as one from token_file is:
		// `export GITEA_TOKEN=$(cat file)` keeps no newline, but a secret
		// store's or a here-string's may.
		f.Token = secret.String(strings.TrimSpace(tok))
		hook, err := Expand(f.WebhookSecret.Reveal())
		if err != nil {
			errs = append(errs, fmt.Errorf("%s.webhook_secret: %w", field, err))
		}
		f.WebhookSecret = secret.String(hook)
		if f.TokenFile != "" {
			if f.Token != "" {
				errs = append(errs, fmt.Errorf("%s: set token or token_file, not both", field))
				continue
			}
			b, err := os.ReadFile(f.TokenFile)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.token_file: %w", field, err))
				continue
			}
			f.Token = secret.String(strings.TrimSpace(string(b)))
		}
	}
	if le := c.LeaderElection; le != nil {
		var err error
		if le.Identity, err = Expand(le.Identity); err != nil {
			errs = append(errs, fmt.Errorf("leader_election.identity: %w", err))
		}
		if le.Advertise, err = Expand(le.Advertise); err != nil {
			errs = append(errs, fmt.Errorf("leader_election.advertise: %w", err))
		}
	}
	for i := range c.Pools {
		for k, v := range c.Pools[i].Env {
			x, err := Expand(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("pools[%d].env.%s: %w", i, k, err))
			}
			c.Pools[i].Env[k] = x
		}
	}
	return sortErrors(errors.Join(errs...))
}

func (c *Config) setDefaults() {
	if c.ID == "" {
		c.ID = DefaultID
	}
	if c.StateDir == "" {
		c.StateDir = defaultStateDir(c.ID)
	}
	if !c.Resync.Given() {
		c.Resync = D(DefaultResync)
	}
	if !c.DrainTimeout.Given() {
		c.DrainTimeout = D(DefaultDrainTimeout)
	}
	c.StatusListen = c.DefaultStatus(c.StatusListen)
	if c.History.Path == "" {
		c.History.Path = filepath.Join(c.StateDir, "history.db")
	}
	if c.History.MaxJobs == 0 {
		c.History.MaxJobs = DefaultHistoryMaxJobs
	}
	if !c.History.Keep.Given() {
		c.History.Keep = D(DefaultHistoryKeep)
	}
	if c.Currency == "" {
		c.Currency = DefaultCurrency
	}
	if le := c.LeaderElection; le != nil {
		if le.Lease == "" {
			le.Lease = "runfleet-" + c.ID
		}
		for d, def := range map[*Duration]time.Duration{&le.LeaseDuration: DefaultLeaseDuration, &le.RenewDeadline: DefaultRenewDeadline, &le.RetryPeriod: DefaultRetryPeriod} {
			if !d.Given() {
				*d = D(def)
			}
		}
	}
	for i := range c.Forges {
		f := &c.Forges[i]
		if !f.PollInterval.Given() && !f.PollOff {
			f.PollInterval = D(DefaultPollInterval)
		}
		perHour, burst := DefaultCallsPerHour, DefaultCallBurst
		if d, ok := forge.Lookup(f.Type); ok {
			if b, ok := d.(forge.Budgeter); ok {
				perHour, burst = b.DefaultBudget()
			}
		}
		if f.CallsPerHour == 0 {
			f.CallsPerHour = perHour
		}
		if f.CallBurst == 0 {
			f.CallBurst = burst
		}
		f.URL = strings.TrimRight(f.URL, "/")
		f.RunnerURL = strings.TrimRight(f.RunnerURL, "/")
		if f.RunnerURL == "" {
			f.RunnerURL = f.URL
		}
	}
	for i := range c.Pools {
		p := &c.Pools[i]
		if p.Forge == "" && len(c.Forges) == 1 {
			p.Forge = c.Forges[0].Name
		}
		if p.Provider == "" {
			p.Provider = DefaultProvider
		}
		if p.Max == 0 && !p.SizeFromGPUs {
			p.Max = p.Size
		}
		for d, def := range map[*Duration]Duration{&p.IdleTimeout: D(DefaultIdleTimeout), &p.MaxLifetime: D(DefaultMaxLifetime),
			&p.BootstrapTimeout: D(DefaultBootstrapTimeout), &p.Agent.FetchInterval: D(DefaultFetchInterval)} {
			if !d.Given() {
				*d = def
			}
		}
		if p.Workdir == "" {
			p.Workdir = filepath.Join(c.StateDir, "work")
		}
	}
}

func defaultStateDir(id string) string {
	base := os.Getenv("XDG_STATE_HOME")
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = os.TempDir()
		}
		base = filepath.Join(home, ".local", "state")
	}
	return filepath.Join(base, "runfleet", id)
}

// Complete defaults and validates a config built in code rather than
// parsed (the CML-compatible `runfleet runner`).
func (c *Config) Complete() error {
	c.setDefaults()
	return c.Validate()
}

func typeName(kind string) string {
	switch kind {
	case "int", "int64":
		return "a whole number"
	case "slice":
		return "a list"
	case "map", "struct":
		return "a mapping"
	}
	return "a " + kind
}
