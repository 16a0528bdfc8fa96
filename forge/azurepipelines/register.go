package azurepipelines

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/url"
	"strings"

	"github.com/microsoft/azure-devops-go-api/azuredevops/v7/taskagent"

	"github.com/runfleet/runfleet/forge"
)

// The agent's configuration files, in its root directory.
const (
	FileAgent       = ".agent"
	FileCredentials = ".credentials"
	FileRSAParams   = ".credentials_rsaparams"
)

// keyBits is the size of an agent's key, as the agent's own
// RSAFileKeyManager makes it.
const keyBits = 2048

// Register adds an agent to the pool as the agent's configuration does
// (ConfigurationManager.ConfigureAsync): a new RSA key whose public half
// the server keeps, one job at a time, the pool's labels as user
// capabilities with the manager's marks. The credential is the three files
// the agent reads at start: its settings, its OAuth client, its private
// key. The PAT is in none of them.
func (d *Forge) Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	api, poolID, err := d.pool(ctx)
	if err != nil {
		return forge.Credential{}, err
	}
	key, err := rsa.GenerateKey(rand.Reader, keyBits)
	if err != nil {
		return forge.Credential{}, fmt.Errorf("azure-pipelines: agent key: %w", err)
	}
	caps := capabilities(req.Labels)
	caps[CapManager] = d.cfg.Manager
	caps[CapPool] = poolOf(req.Name)
	agent := d.newAgent(req.Name, &key.PublicKey, caps)
	var added *taskagent.TaskAgent
	err = d.call(ctx, "add agent "+req.Name, func(ctx context.Context) (err error) {
		added, err = api.AddAgent(ctx, taskagent.AddAgentArgs{Agent: &agent, PoolId: &poolID})
		return err
	})
	if err != nil {
		if st := status(err); st == http.StatusConflict || st == http.StatusBadRequest {
			// The agent's own configuration looks a name up before it
			// adds one, rather than rely on the server's answer for a
			// name taken: so does the driver, once refused.
			if taken := d.nameTaken(ctx, api, poolID, req.Name); taken != nil {
				return forge.Credential{}, taken
			}
		}
		if e := rejectDefinitive(err); e != err {
			return forge.Credential{}, e
		}
		// Sent but unanswered: the server may have added it.
		d.kept.Drop()
		return forge.Credential{}, err
	}
	files, err := d.agentFiles(added, poolID, key)
	if err != nil {
		// Nothing an agent can start with: the agent goes again.
		if id := idOf(added); id != 0 {
			_ = d.call(context.WithoutCancel(ctx), "delete agent "+req.Name, func(ctx context.Context) error {
				return api.DeleteAgent(ctx, taskagent.DeleteAgentArgs{PoolId: &poolID, AgentId: &id})
			})
		}
		d.kept.Drop()
		return forge.Credential{}, fmt.Errorf("%w: %w", forge.ErrRejected, err)
	}
	id := int64(*added.Id)
	d.kept.Change(id, func(list []forge.Runner, i int) []forge.Runner {
		return append(list, forge.Runner{ID: id, Name: req.Name, Status: forge.StatusOffline, Labels: req.Labels})
	})
	return forge.Credential{RunnerID: id, Files: files}, nil
}

// newAgent is an agent as the agent's configuration adds it: its public
// key, one job at a time, its version, its user capabilities and the
// system capabilities its scan reports (AgentCapabilitiesProvider: the
// agent's name, OS, architecture and version; the agent reports them
// again, with the tools it finds, when it connects).
func (d *Forge) newAgent(name string, key *rsa.PublicKey, caps map[string]string) taskagent.TaskAgent {
	exp := big.NewInt(int64(key.E)).Bytes()
	sys := d.systemCapabilities(name)
	return taskagent.TaskAgent{
		Name: &name,
		Authorization: &taskagent.TaskAgentAuthorization{
			PublicKey: &taskagent.TaskAgentPublicKey{Exponent: &exp, Modulus: new(key.N.Bytes())},
		},
		MaxParallelism:     new(1),
		ProvisioningState:  new("Provisioned"),
		Version:            &d.cfg.AgentVersion,
		Enabled:            new(true),
		UserCapabilities:   &caps,
		SystemCapabilities: &sys,
	}
}

// systemCapabilities are those of the agent's own scan that runfleet
// knows before the agent runs (AgentCapabilitiesProvider.cs): the rest
// (the tools on PATH, the environment) only the agent finds, and a pool
// declares those a job demands in its labels.
func (d *Forge) systemCapabilities(name string) map[string]string {
	return map[string]string{
		"Agent.Name":           name,
		"Agent.OS":             "Linux",
		"Agent.OSArchitecture": d.cfg.Architecture,
		"Agent.Version":        d.cfg.AgentVersion,
	}
}

// nameTaken looks up an agent of the name in the pool. One of this
// manager's, left from before (a crash after adding it), the pool removes
// once the next listing shows it: a retry then adds the name. Another's
// no retry fixes. nil when the name is free, or could not be looked up.
func (d *Forge) nameTaken(ctx context.Context, api taskagent.Client, poolID int, name string) error {
	var agents *[]taskagent.TaskAgent
	err := d.call(ctx, "look up agent "+name, func(ctx context.Context) (err error) {
		agents, err = api.GetAgents(ctx, taskagent.GetAgentsArgs{PoolId: &poolID, AgentName: &name, IncludeCapabilities: new(true)})
		return err
	})
	if err != nil || agents == nil {
		return nil
	}
	for _, a := range *agents {
		if a.Name == nil || !strings.EqualFold(*a.Name, name) {
			continue
		}
		if a.UserCapabilities != nil && (*a.UserCapabilities)[CapManager] == d.cfg.Manager {
			d.kept.Drop()
			return fmt.Errorf("azure-pipelines: an agent named %s is left in the pool from before; the pool removes it, then adds the name again", name)
		}
		return fmt.Errorf("%w: azure-pipelines: the agent pool has an agent named %s that is not this manager's: rename or delete it, or give the pool another name", forge.ErrRejected, name)
	}
	return nil
}

func idOf(a *taskagent.TaskAgent) int {
	if a == nil || a.Id == nil {
		return 0
	}
	return *a.Id
}

// poolOf is a runner's pool, from its name (<pool>-<n>).
func poolOf(name string) string {
	if i := strings.LastIndexByte(name, '-'); i > 0 {
		return name[:i]
	}
	return name
}

// agentSettings is the agent's .agent file (AgentSettings in the agent's
// ConfigurationStore), in its serializer's camel case, empty values left
// out.
type agentSettings struct {
	AgentID    int    `json:"agentId"`
	AgentName  string `json:"agentName"`
	PoolID     int    `json:"poolId"`
	PoolName   string `json:"poolName,omitempty"`
	ServerURL  string `json:"serverUrl"`
	WorkFolder string `json:"workFolder"`
	// AcceptTeeEula is the agent's own setting (AgentSettings), written
	// by config.sh --acceptTeeEula.
	AcceptTeeEula bool `json:"acceptTeeEula,omitempty"`
}

// credentialData is the .credentials file (CredentialData): the OAuth
// scheme, whose data name the agent's client and where it gets tokens.
type credentialData struct {
	Scheme string            `json:"scheme"`
	Data   map[string]string `json:"data"`
}

// rsaParams is the .credentials_rsaparams file: the agent's
// RSAParametersSerializable, whose members keep the names it gives them.
// Each is big-endian, and .NET's RSA takes D as long as the modulus and
// the CRT values half as long.
type rsaParams struct {
	ContainerName string `json:"ContainerName"`
	UseCng        bool   `json:"UseCng"`
	D             []byte `json:"d"`
	DP            []byte `json:"dp"`
	DQ            []byte `json:"dq"`
	Exponent      []byte `json:"exponent"`
	InverseQ      []byte `json:"inverseQ"`
	Modulus       []byte `json:"modulus"`
	P             []byte `json:"p"`
	Q             []byte `json:"q"`
}

// agentFiles writes the agent's three files from what AddAgent answered,
// as ConfigurationManager.UpdateCredentialData does.
func (d *Forge) agentFiles(a *taskagent.TaskAgent, poolID int, key *rsa.PrivateKey) (map[string][]byte, error) {
	if a == nil || a.Id == nil || a.Name == nil || a.Authorization == nil || a.Authorization.ClientId == nil || a.Authorization.AuthorizationUrl == nil {
		return nil, fmt.Errorf("azure-pipelines: the server added the agent without its OAuth client (id and authorization URL): this server does not take agents that authenticate with their own key")
	}
	serverURL, err := d.serverURL(a)
	if err != nil {
		return nil, err
	}
	authURL, err := url.Parse(*a.Authorization.AuthorizationUrl)
	if err != nil || authURL.Host == "" {
		return nil, fmt.Errorf("azure-pipelines: the agent's authorization URL %q: %v", *a.Authorization.AuthorizationUrl, err)
	}
	// The token endpoint is the authorization URL; on a server of one's
	// own (not Azure DevOps Services), reached where the agent reaches
	// the server, as the agent's configuration does.
	endpoint := *authURL
	if su, _ := url.Parse(serverURL); !hosted(su) && !strings.EqualFold(su.Scheme+"://"+su.Host, endpoint.Scheme+"://"+endpoint.Host) {
		endpoint.Scheme, endpoint.Host = su.Scheme, su.Host
	}
	settings := agentSettings{
		AgentID: *a.Id, AgentName: *a.Name, PoolID: poolID, PoolName: d.cfg.PoolName,
		ServerURL: serverURL, WorkFolder: "_work", AcceptTeeEula: d.cfg.AcceptTeeEula,
	}
	creds := credentialData{Scheme: "OAuth", Data: map[string]string{
		"clientId":         a.Authorization.ClientId.String(),
		"authorizationUrl": authURL.String(),
		"oauthEndpointUrl": endpoint.String(),
	}}
	half := (key.N.BitLen() + 15) / 16
	full := (key.N.BitLen() + 7) / 8
	params := rsaParams{
		D:        key.D.FillBytes(make([]byte, full)),
		DP:       key.Precomputed.Dp.FillBytes(make([]byte, half)),
		DQ:       key.Precomputed.Dq.FillBytes(make([]byte, half)),
		Exponent: big.NewInt(int64(key.E)).Bytes(),
		InverseQ: key.Precomputed.Qinv.FillBytes(make([]byte, half)),
		Modulus:  key.N.FillBytes(make([]byte, full)),
		P:        key.Primes[0].FillBytes(make([]byte, half)),
		Q:        key.Primes[1].FillBytes(make([]byte, half)),
	}
	files := map[string][]byte{}
	for name, v := range map[string]any{FileAgent: settings, FileCredentials: creds, FileRSAParams: params} {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return nil, err
		}
		files[name] = b
	}
	return files, nil
}

// serverURL is where the agent talks to the server: the server's own word
// for it (the agent's ServerUrl property) with the scheme and host by which
// runners reach it, else the runner URL.
func (d *Forge) serverURL(a *taskagent.TaskAgent) (string, error) {
	ru, err := url.Parse(strings.TrimRight(d.cfg.RunnerURL, "/") + "/")
	if err != nil {
		return "", fmt.Errorf("azure-pipelines: runner_url %q: %w", d.cfg.RunnerURL, err)
	}
	if props, ok := a.Properties.(map[string]any); ok {
		if v, ok := props["ServerUrl"].(map[string]any); ok {
			if s, ok := v["$value"].(string); ok && s != "" {
				if su, err := url.Parse(s); err == nil {
					su.Scheme, su.Host = ru.Scheme, ru.Host
					return su.String(), nil
				}
			}
		}
	}
	return ru.String(), nil
}

// hosted reports Azure DevOps Services, whose token service has a host of
// its own.
func hosted(u *url.URL) bool {
	if u == nil {
		return false
	}
	h := strings.ToLower(u.Hostname())
	return h == "dev.azure.com" || strings.HasSuffix(h, ".visualstudio.com") || strings.HasSuffix(h, ".azure.com")
}
