package azurepipelines

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
)

func init() { forge.Register("azure-pipelines", driver{}) }

// driver is the registry's entry for Azure Pipelines.
type driver struct{}

// section is what an azure-pipelines forge adds to the common fields. The
// forge's url is the organisation (https://dev.azure.com/acme) or, for
// Azure DevOps Server, the collection (https://ado.example.com/tfs/DefaultCollection).
type section struct {
	// Pool is the agent pool, by name or id.
	Pool poolRef `json:"pool"`
	// Project is where a job lost with its agent is re-run (its build's
	// failed jobs); without it lost jobs are not re-run.
	Project string `json:"project"`
	// AgentVersion is the agent's version, sent when the manager adds
	// the agent, as the agent's own configuration does; the agent
	// reports its own when it connects.
	AgentVersion string `json:"agent_version"`
	// AcceptTeeEula accepts the Team Explorer Everywhere licence in each
	// agent's settings, as config.sh --acceptTeeEula does: what a Linux
	// agent needs to check out TFVC repositories.
	AcceptTeeEula bool `json:"accept_tee_eula"`
	// Architecture is the runners' Agent.OSArchitecture, as the agent
	// reports .NET's RuntimeInformation.OSArchitecture: X64 (the
	// default) or ARM64.
	Architecture string `json:"architecture"`
	// CacheTTL is how long a listing of agents is reused (5s).
	CacheTTL config.Duration `json:"cache_ttl"`
}

// poolRef is an agent pool: its name, or its id as a number.
type poolRef struct {
	Name string
	ID   int
}

func (p *poolRef) UnmarshalJSON(b []byte) error {
	if bytes.HasPrefix(b, []byte(`"`)) {
		return json.Unmarshal(b, &p.Name)
	}
	if err := json.Unmarshal(b, &p.ID); err != nil {
		return fmt.Errorf("%s is not a pool name or id", b)
	}
	return nil
}

// DefaultAgentVersion is the agent version the manager registers agents
// with when the config does not say: a release of microsoft/azure-pipelines-agent.
const DefaultAgentVersion = "4.275.0"

// decode reads and checks an azure-pipelines forge's configuration,
// returning every problem found, each naming its field.
func decode(c forge.Config) (section, error) {
	var s section
	errs := []error{config.DecodeSection(c.Section, &s)}
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if c.Token == "" {
		bad("token", "is required (a personal access token with the Agent Pools (read & manage) scope, \"${ENV_VAR}\", or token_file)")
	}
	if u, err := url.Parse(c.URL); err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
		bad("url", "%q is not an organisation URL (https://dev.azure.com/<organisation>) or a collection URL", c.URL)
	}
	switch {
	case s.Pool.Name == "" && s.Pool.ID == 0:
		bad("pool", "is required: the agent pool's name or id")
	case s.Pool.ID < 0:
		bad("pool", "%d is not a pool id", s.Pool.ID)
	}
	switch strings.ToUpper(s.Architecture) {
	case "":
		s.Architecture = "X64"
	case "X64", "ARM64":
		s.Architecture = strings.ToUpper(s.Architecture)
	default:
		bad("architecture", "%q is not X64 or ARM64", s.Architecture)
	}
	if s.AgentVersion == "" {
		s.AgentVersion = DefaultAgentVersion
	} else if !isVersion(s.AgentVersion) {
		bad("agent_version", "%q is not a version (4.275.0)", s.AgentVersion)
	}
	return s, errors.Join(errs...)
}

// isVersion reports whether v is a dotted version of two to four numbers.
func isVersion(v string) bool {
	parts := strings.Split(v, ".")
	if len(parts) < 2 || len(parts) > 4 {
		return false
	}
	for _, p := range parts {
		if _, err := strconv.ParseUint(p, 10, 32); err != nil {
			return false
		}
	}
	return true
}

// DefaultBudget is well below Azure DevOps' limit of 200 TSTUs per user in
// any five minutes: agent pool calls are cheap, and a pool costs three or
// four calls a job.
func (driver) DefaultBudget() (perHour, burst int) { return 7200, 60 }

func (driver) Check(c forge.Config) error {
	_, err := decode(c)
	return err
}

func (driver) Open(ctx context.Context, c forge.Config, env forge.Env) (forge.Forge, error) {
	s, err := decode(c)
	if err != nil {
		return nil, err
	}
	return New(Config{
		URL:           c.URL,
		RunnerURL:     c.RunnerURL,
		Token:         c.Token.Reveal(),
		PoolName:      s.Pool.Name,
		PoolID:        s.Pool.ID,
		Project:       s.Project,
		AgentVersion:  s.AgentVersion,
		Architecture:  s.Architecture,
		AcceptTeeEula: s.AcceptTeeEula,
		CacheTTL:      s.CacheTTL.Duration,
		Manager:       env.Manager,
		Version:       env.Version,
		Logger:        env.Logger,
		Budget:        env.Budget,
	})
}

// Recognize takes Azure DevOps Services' hosts.
func (driver) Recognize(repo *url.URL) bool {
	h := strings.ToLower(repo.Hostname())
	return h == "dev.azure.com" || strings.HasSuffix(h, ".visualstudio.com")
}

// InCI reports an Azure Pipelines job, which has TF_BUILD set to True.
func (driver) InCI(getenv func(string) (string, bool)) bool {
	v, _ := getenv("TF_BUILD")
	return strings.EqualFold(v, "true")
}

// RepoConfig takes a project or repository URL: of Azure DevOps Services
// (https://dev.azure.com/acme/ml/_git/models, or the older
// https://acme.visualstudio.com/ml), where the organisation is the forge;
// or of a server of one's own (https://ado.example.com/tfs/DefaultCollection/ml),
// where the forge is the collection, the path before the project (the
// segment before the first that starts with "_", or the last). The
// project is where lost jobs are re-run; the agent pool is the URL's pool
// parameter (?pool=gpu), or Default, the pool every organisation has.
func (driver) RepoConfig(repo string) (string, json.RawMessage, error) {
	u, err := url.Parse(repo)
	if err != nil {
		return "", nil, err
	}
	if u.Scheme == "" || u.Host == "" {
		return "", nil, fmt.Errorf("%q is not a project URL (https://dev.azure.com/<organisation>/<project>)", repo)
	}
	var parts []string
	for p := range strings.SplitSeq(strings.Trim(u.Path, "/"), "/") {
		if strings.HasPrefix(p, "_") {
			break
		}
		if p != "" {
			parts = append(parts, p)
		}
	}
	forgeURL, project := u.Scheme+"://"+u.Host, ""
	switch h := strings.ToLower(u.Hostname()); {
	case h == "dev.azure.com":
		if len(parts) == 0 {
			return "", nil, fmt.Errorf("%q names no organisation", repo)
		}
		forgeURL += "/" + parts[0]
		if len(parts) > 1 {
			project = parts[1]
		}
	case strings.HasSuffix(h, ".visualstudio.com"):
		if len(parts) > 0 {
			project = parts[0]
		}
	case len(parts) == 0:
		return "", nil, fmt.Errorf("%q names no collection", repo)
	case len(parts) == 1:
		forgeURL += "/" + parts[0]
	default:
		forgeURL += "/" + strings.Join(parts[:len(parts)-1], "/")
		project = parts[len(parts)-1]
	}
	s := map[string]any{"pool": "Default"}
	if p := u.Query().Get("pool"); p != "" {
		s["pool"] = p
		if id, err := strconv.Atoi(p); err == nil {
			s["pool"] = id
		}
	}
	if project != "" {
		s["project"] = project
	}
	b, err := json.Marshal(s)
	return forgeURL, b, err
}
