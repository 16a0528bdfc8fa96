// Command agent stands in for the Azure Pipelines agent's listener
// (bin/Agent.Listener, which run.sh starts): `run [--once]`. Like the
// agent, it finds its root directory from where its program is (bin/..),
// and reads there only the three files configuration leaves: .agent (its
// settings), .credentials (its OAuth client) and .credentials_rsaparams
// (its RSA key), as the agent's serializer reads them (the first two's
// names in any case; the key's as RSAParametersSerializable names them,
// with the lengths .NET's RSA demands). A mistake in any of them fails its
// start, as it would fail the agent's.
//
// It then does what the agent does: it gets an access token from the
// OAuth endpoint with a JWT client assertion signed with its key, opens a
// session with its system capabilities (its environment, as the agent
// reports them), long-polls for a message, and runs the job it gets: it
// deletes the message, renews the request's lock, runs the job's script
// with bash in _work, appends its output to the job's log with the job's
// own token, and finishes the request with the result. It prints the
// agent's own console lines ("Listening for Jobs", "Running job: ...",
// "Job ... completed with result: ..."). With --once it then closes its
// session and exits; AZP_STANDIN_IGNORE_ONCE=1 makes it listen for a
// second job all the same, as agents have done in the field
// (azure-pipelines-agent issue 2332).
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/golang-jwt/jwt/v4"
)

const (
	version    = "4.275.0"
	apiVersion = "5.1-preview.1"
	emptyGUID  = "00000000-0000-0000-0000-000000000000"
)

func main() {
	if len(os.Args) < 2 || os.Args[1] != "run" {
		fmt.Fprintln(os.Stderr, "usage: Agent.Listener run [--once]")
		os.Exit(1)
	}
	once := slices.Contains(os.Args[2:], "--once")
	if os.Getenv("AZP_STANDIN_IGNORE_ONCE") == "1" {
		once = false
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, once); err != nil {
		fmt.Printf("%s: An error occurred: %v\n", stamp(), err)
		os.Exit(1)
	}
}

func stamp() string { return time.Now().UTC().Format("2006-01-02 15:04:05Z") }

// settings is .agent; credentials is .credentials.
type settings struct {
	AgentID    int
	AgentName  string
	PoolID     int
	ServerURL  string
	WorkFolder string
}

type credentials struct {
	Scheme string
	Data   map[string]string
}

type agent struct {
	root   string
	s      settings
	c      credentials
	key    *rsa.PrivateKey
	hc     *http.Client
	token  string
	expiry time.Time
}

func run(ctx context.Context, once bool) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	a := &agent{root: filepath.Dir(filepath.Dir(exe)), hc: &http.Client{Timeout: 90 * time.Second}}
	if err := a.load(); err != nil {
		return err
	}
	fmt.Println("Scanning for tool capabilities.")
	fmt.Println("Connecting to the server.")
	session, err := a.openSession(ctx)
	if err != nil {
		return err
	}
	defer a.closeSession(session)
	fmt.Printf("%s: Listening for Jobs\n", stamp())
	var last int64
	for {
		msg, err := a.nextMessage(ctx, session, last)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return err
		}
		if msg == nil {
			continue
		}
		last = msg.MessageID
		if err := a.do(ctx, session, msg, once); err != nil {
			return err
		}
		if once {
			return nil
		}
	}
}

// load reads the three files from the root, as the agent's
// ConfigurationStore and RSAFileKeyManager do.
func (a *agent) load() error {
	read := func(name string, v any) error {
		b, err := os.ReadFile(filepath.Join(a.root, name))
		if err != nil {
			return fmt.Errorf("not configured (%v): run config.sh to configure the agent", err)
		}
		return json.Unmarshal(b, v) // Newtonsoft, like encoding/json, matches names in any case
	}
	if err := read(".agent", &a.s); err != nil {
		return fmt.Errorf(".agent: %w", err)
	}
	if a.s.AgentID == 0 || a.s.AgentName == "" || a.s.PoolID == 0 || a.s.ServerURL == "" {
		return fmt.Errorf(".agent: agentId, agentName, poolId and serverUrl are required")
	}
	if err := read(".credentials", &a.c); err != nil {
		return fmt.Errorf(".credentials: %w", err)
	}
	if a.c.Scheme != "OAuth" || a.c.Data["clientId"] == "" || a.c.Data["authorizationUrl"] == "" {
		return fmt.Errorf(".credentials: the OAuth scheme with clientId and authorizationUrl is required (scheme %q)", a.c.Scheme)
	}
	var p struct{ D, DP, DQ, Exponent, InverseQ, Modulus, P, Q []byte }
	raw := map[string]json.RawMessage{}
	if err := read(".credentials_rsaparams", &raw); err != nil {
		return fmt.Errorf(".credentials_rsaparams: %w", err)
	}
	// SerializationInfo.GetValue finds members by their exact names.
	for name, dst := range map[string]*[]byte{"d": &p.D, "dp": &p.DP, "dq": &p.DQ, "exponent": &p.Exponent, "inverseQ": &p.InverseQ, "modulus": &p.Modulus, "p": &p.P, "q": &p.Q} {
		v, ok := raw[name]
		if !ok {
			return fmt.Errorf(".credentials_rsaparams: member %q not found", name)
		}
		if err := json.Unmarshal(v, dst); err != nil {
			return fmt.Errorf(".credentials_rsaparams: %s: %w", name, err)
		}
	}
	key, err := importRSA(p.Modulus, p.Exponent, p.D, p.P, p.Q, p.DP, p.DQ, p.InverseQ)
	if err != nil {
		return fmt.Errorf(".credentials_rsaparams: %w", err)
	}
	a.key = key
	return nil
}

// importRSA checks the parameters as .NET's RSA.ImportParameters does
// ("Bad Data" otherwise) and makes the key.
func importRSA(n, e, d, p, q, dp, dq, qinv []byte) (*rsa.PrivateKey, error) {
	half := (len(n) + 1) / 2
	switch {
	case len(n) == 0 || len(e) == 0:
		return nil, errors.New("bad data: no modulus or exponent")
	case len(d) != len(n):
		return nil, fmt.Errorf("bad data: D is %d bytes, the modulus %d", len(d), len(n))
	case len(p) != half || len(q) != half || len(dp) != half || len(dq) != half || len(qinv) != half:
		return nil, fmt.Errorf("bad data: P, Q, DP, DQ and InverseQ must be %d bytes", half)
	}
	key := &rsa.PrivateKey{
		PublicKey: rsa.PublicKey{N: new(big.Int).SetBytes(n), E: int(new(big.Int).SetBytes(e).Int64())},
		D:         new(big.Int).SetBytes(d),
		Primes:    []*big.Int{new(big.Int).SetBytes(p), new(big.Int).SetBytes(q)},
	}
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("bad data: %w", err)
	}
	key.Precompute()
	for name, want := range map[string][]byte{"DP": dp, "DQ": dq, "InverseQ": qinv} {
		got := map[string]*big.Int{"DP": key.Precomputed.Dp, "DQ": key.Precomputed.Dq, "InverseQ": key.Precomputed.Qinv}[name]
		if got.Cmp(new(big.Int).SetBytes(want)) != 0 {
			return nil, fmt.Errorf("bad data: %s does not belong to the key", name)
		}
	}
	return key, nil
}

// accessToken gets (or reuses) an access token: the client credentials
// grant with a JWT assertion, as VssOAuthJwtBearerClientCredential makes it.
func (a *agent) accessToken(ctx context.Context) (string, error) {
	if a.token != "" && time.Until(a.expiry) > time.Minute {
		return a.token, nil
	}
	now := time.Now()
	id := make([]byte, 16)
	_, _ = rand.Read(id)
	clientID := a.c.Data["clientId"]
	assertion, err := jwt.NewWithClaims(jwt.SigningMethodRS256, jwt.RegisteredClaims{
		Issuer: clientID, Subject: clientID, Audience: jwt.ClaimStrings{a.c.Data["authorizationUrl"]},
		NotBefore: jwt.NewNumericDate(now), ExpiresAt: jwt.NewNumericDate(now.Add(5 * time.Minute)), ID: hex.EncodeToString(id),
	}).SignedString(a.key)
	if err != nil {
		return "", err
	}
	endpoint := a.c.Data["oauthEndpointUrl"]
	if endpoint == "" {
		endpoint = a.c.Data["authorizationUrl"]
	}
	form := url.Values{
		"grant_type":            {"client_credentials"},
		"client_assertion_type": {"urn:ietf:params:oauth:client-assertion-type:jwt-bearer"},
		"client_assertion":      {assertion},
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Accept", "application/json")
	resp, err := a.hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("token: %w", err)
	}
	defer resp.Body.Close()
	var t struct {
		AccessToken string `json:"access_token"`
		ExpiresIn   int    `json:"expires_in"`
		Error       string `json:"error"`
		Description string `json:"error_description"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&t)
	if resp.StatusCode != http.StatusOK || t.AccessToken == "" {
		return "", fmt.Errorf("token: %s: %s %s", resp.Status, t.Error, t.Description)
	}
	a.token, a.expiry = t.AccessToken, now.Add(time.Duration(t.ExpiresIn)*time.Second)
	return a.token, nil
}

// call sends a request of the agent to its server.
func (a *agent) call(ctx context.Context, method, path string, query url.Values, body, out any) (int, error) {
	tok, err := a.accessToken(ctx)
	if err != nil {
		return 0, err
	}
	return send(ctx, a.hc, method, strings.TrimRight(a.s.ServerURL, "/")+path, query, "Bearer "+tok, body, out)
}

func send(ctx context.Context, hc *http.Client, method, u string, query url.Values, auth string, body, out any) (int, error) {
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	}
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, r)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Authorization", auth)
	req.Header.Set("Accept", "application/json; api-version="+apiVersion)
	if body != nil {
		req.Header.Set("Content-Type", "application/json; charset=utf-8")
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		return resp.StatusCode, fmt.Errorf("%s %s: %s %s", method, req.URL.Path, resp.Status, bytes.TrimSpace(b))
	}
	if out != nil && len(b) > 0 {
		return resp.StatusCode, json.Unmarshal(b, out)
	}
	return resp.StatusCode, nil
}

func (a *agent) poolPath(rest string) string {
	return fmt.Sprintf("/_apis/distributedtask/pools/%d/%s", a.s.PoolID, rest)
}

// openSession creates the agent's session, with its environment as its
// system capabilities; a session left by an earlier start is waited out.
func (a *agent) openSession(ctx context.Context) (string, error) {
	caps := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			caps[k] = v
		}
	}
	host, _ := os.Hostname()
	caps["Agent.Name"], caps["Agent.Version"], caps["Agent.OS"] = a.s.AgentName, version, "Linux"
	caps["Agent.OSArchitecture"], caps["Agent.ComputerName"], caps["Agent.HomeDirectory"] = strings.ToUpper(runtime.GOARCH), host, a.root
	body := map[string]any{
		"ownerName":          fmt.Sprintf("%s (PID: %d)", host, os.Getpid()),
		"agent":              map[string]any{"id": a.s.AgentID, "name": a.s.AgentName, "version": version, "osDescription": "Linux stand-in"},
		"systemCapabilities": caps,
	}
	var out struct {
		SessionID string `json:"sessionId"`
	}
	for deadline := time.Now().Add(time.Minute); ; {
		code, err := a.call(ctx, http.MethodPost, a.poolPath("sessions"), nil, body, &out)
		if err == nil {
			return out.SessionID, nil
		}
		if code != http.StatusConflict || time.Now().After(deadline) {
			return "", fmt.Errorf("failed to create session: %w", err)
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func (a *agent) closeSession(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _ = a.call(ctx, http.MethodDelete, a.poolPath("sessions/"+id), nil, nil, nil)
}

type agentMessage struct {
	MessageID   int64  `json:"messageId"`
	MessageType string `json:"messageType"`
	Body        string `json:"body"`
}

// nextMessage long-polls for a message: nil when the poll ended without
// one. A lost connection is retried; an answer refusing the agent (its
// registration gone) ends it.
func (a *agent) nextMessage(ctx context.Context, session string, last int64) (*agentMessage, error) {
	var m agentMessage
	q := url.Values{"sessionId": {session}, "lastMessageId": {fmt.Sprint(last)}, "status": {"Online"}}
	code, err := a.call(ctx, http.MethodGet, a.poolPath("messages"), q, nil, &m)
	switch {
	case err != nil && (code == http.StatusUnauthorized || code == http.StatusNotFound || code == http.StatusBadRequest):
		return nil, fmt.Errorf("the agent's session ended (its registration may be gone): %w", err)
	case err != nil:
		fmt.Printf("%s: Lost connection to the server (%v); retrying\n", stamp(), err)
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
		return nil, nil
	case code == http.StatusAccepted || m.MessageID == 0:
		return nil, nil
	}
	return &m, nil
}

// job is the part of a PipelineAgentJobRequest the stand-in reads.
type job struct {
	Plan struct {
		PlanID          string `json:"planId"`
		ScopeIdentifier string `json:"scopeIdentifier"`
		Version         int    `json:"version"`
	} `json:"plan"`
	JobID          string `json:"jobId"`
	JobDisplayName string `json:"jobDisplayName"`
	RequestID      int64  `json:"requestId"`
	Resources      struct {
		Endpoints []struct {
			Name          string `json:"name"`
			URL           string `json:"url"`
			Authorization struct {
				Parameters map[string]string `json:"parameters"`
			} `json:"authorization"`
		} `json:"endpoints"`
	} `json:"resources"`
	Variables map[string]struct {
		Value string `json:"value"`
	} `json:"variables"`
	Steps []struct {
		Inputs map[string]string `json:"inputs"`
	} `json:"steps"`
}

// do runs a job message.
func (a *agent) do(ctx context.Context, session string, m *agentMessage, once bool) error {
	_, _ = a.call(ctx, http.MethodDelete, a.poolPath(fmt.Sprintf("messages/%d", m.MessageID)), url.Values{"sessionId": {session}}, nil, nil)
	if m.MessageType != "PipelineAgentJobRequest" {
		return nil
	}
	var j job
	if err := json.Unmarshal([]byte(m.Body), &j); err != nil {
		return fmt.Errorf("job message: %w", err)
	}
	fmt.Printf("%s: Running job: %s\n", stamp(), j.JobDisplayName)
	renew := func(body map[string]any) error {
		_, err := a.call(context.WithoutCancel(ctx), http.MethodPatch, a.poolPath(fmt.Sprintf("jobrequests/%d", j.RequestID)), url.Values{"lockToken": {emptyGUID}}, body, nil)
		return err
	}
	if err := renew(map[string]any{"requestId": j.RequestID}); err != nil {
		return fmt.Errorf("renew job request %d: %w", j.RequestID, err)
	}
	stopRenew := make(chan struct{})
	renewed := make(chan struct{})
	go func() {
		defer close(renewed)
		every := 60 * time.Second
		if d, err := time.ParseDuration(os.Getenv("AZP_STANDIN_RENEW")); err == nil && d > 0 {
			every = d
		}
		for {
			select {
			case <-stopRenew:
				return
			case <-time.After(every):
				_ = renew(map[string]any{"requestId": j.RequestID})
			}
		}
	}()
	result := a.runJob(ctx, &j, once)
	fmt.Printf("%s: Job %s completed with result: %s\n", stamp(), j.JobDisplayName, strings.ToUpper(result[:1])+result[1:])
	close(stopRenew)
	<-renewed
	// A plan of version 8 or later learned the end from the worker's
	// JobCompleted event; the listener completes older plans' requests.
	if j.Plan.Version >= 8 {
		return nil
	}
	if err := renew(map[string]any{"requestId": j.RequestID, "finishTime": time.Now().UTC().Format(time.RFC3339), "result": result}); err != nil {
		fmt.Printf("%s: finish job request %d: %v\n", stamp(), j.RequestID, err)
	}
	return nil
}

// runJob runs the job's scripts with bash in the work folder, appends
// their output to the job's log and, for a plan of version 8 or later,
// raises the JobCompleted event, saying whether the agent stops after it
// (run --once); it returns the TaskResult.
func (a *agent) runJob(ctx context.Context, j *job, once bool) string {
	var conn struct{ url, token string }
	for _, e := range j.Resources.Endpoints {
		if e.Name == "SystemVssConnection" {
			conn.url, conn.token = e.URL, e.Authorization.Parameters["AccessToken"]
		}
	}
	logs := fmt.Sprintf("%s%s/_apis/distributedtask/hubs/build/plans/%s/logs", conn.url, j.Plan.ScopeIdentifier, j.Plan.PlanID)
	var created struct {
		ID int `json:"id"`
	}
	if _, err := send(ctx, a.hc, http.MethodPost, logs, nil, "Bearer "+conn.token, map[string]any{"path": "logs/1"}, &created); err != nil {
		fmt.Printf("%s: create log: %v\n", stamp(), err)
		return "failed"
	}
	work := filepath.Join(a.root, a.s.WorkFolder, "1", "s")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return "failed"
	}
	result := "succeeded"
	var out bytes.Buffer
	for _, step := range j.Steps {
		cmd := exec.CommandContext(ctx, "bash", "-c", step.Inputs["script"])
		cmd.Dir = work
		cmd.Env = append(os.Environ(), "AGENT_NAME="+a.s.AgentName, "SYSTEM_JOBDISPLAYNAME="+j.JobDisplayName,
			"BUILD_BUILDID="+j.Variables["build.buildId"].Value, "AGENT_ROOTDIRECTORY="+a.root)
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			fmt.Fprintf(&out, "##[error]Bash exited: %v\n", err)
			result = "failed"
			break
		}
	}
	u := fmt.Sprintf("%s/%d", logs, created.ID)
	req, _ := http.NewRequestWithContext(context.WithoutCancel(ctx), http.MethodPost, u, bytes.NewReader(out.Bytes()))
	req.Header.Set("Authorization", "Bearer "+conn.token)
	req.Header.Set("Content-Type", "application/octet-stream")
	if resp, err := a.hc.Do(req); err == nil {
		resp.Body.Close()
	}
	if j.Plan.Version >= 8 {
		events := fmt.Sprintf("%s%s/_apis/distributedtask/hubs/build/plans/%s/events", conn.url, j.Plan.ScopeIdentifier, j.Plan.PlanID)
		ev := map[string]any{"name": "JobCompleted", "jobId": j.JobID, "requestId": j.RequestID, "result": result, "agentShuttingDown": once}
		if _, err := send(context.WithoutCancel(ctx), a.hc, http.MethodPost, events, nil, "Bearer "+conn.token, ev, nil); err != nil {
			fmt.Printf("%s: job completed event: %v\n", stamp(), err)
		}
	}
	return result
}
