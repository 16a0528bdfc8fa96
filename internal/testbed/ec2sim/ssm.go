package ec2sim

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Systems Manager Parameter Store, as much of it as runfleet's handoff
// uses (PutParameter, GetParameter, DeleteParameter), for the same
// account as the EC2 stand-in, and the instance role credentials its
// instances read from their metadata service. The behaviour follows the
// SSM API reference (docs.aws.amazon.com/systems-manager/latest/APIReference:
// PutParameter, GetParameter, DeleteParameter and their errors), the
// Parameter Store user guide (parameter tiers: 4 KB standard, 8 KB
// advanced; Intelligent-Tiering; parameter policies, whose Expiration
// deletes a parameter at its time; throughput: 40 transactions a second by
// default, shared by GetParameter and PutParameter, "ThrottlingException:
// Rate exceeded"), and the EC2 User Guide on instance metadata
// (iam/security-credentials/<role>).
//
// The calls speak the AWS JSON 1.1 protocol (X-Amz-Target:
// AmazonSSM.<Action>). The caller is told apart by the access key id of
// its SigV4 Authorization header: the account's key (AccessKey) may do
// anything; an instance's role credentials are allowed only what
// runfleet's documented instance policy allows (docs/providers/aws.md):
// ssm:GetParameter and ssm:DeleteParameter on a parameter whose
// runfleet:instance tag is the calling instance's ARN
// (${ec2:SourceInstanceARN}). IAM decides before the parameter is looked
// up, so a parameter that does not exist, having no tag, is an
// AccessDeniedException to an instance, as it is on AWS. Signatures are
// not checked.

// TagInstance is the parameter tag the instance policy matches against
// ${ec2:SourceInstanceARN}.
const TagInstance = "runfleet:instance"

// Parameter is one stored parameter.
type Parameter struct {
	Name, Type, Tier, Value string
	Tags                    map[string]string
	Version                 int
	Modified                time.Time
	Expires                 time.Time // zero: no Expiration policy
	// Reads counts the GetParameter answers that gave its value.
	Reads int
}

type ssmState struct {
	mu     sync.Mutex
	params map[string]*Parameter
	keys   map[string]string // an instance role's access key id -> instance id
	bucket *rate.Limiter
	calls  map[string]int
	denied map[string]bool // instance profiles whose role lacks runfleet's statement
	taken  []Parameter     // deleted by their instance, for tests to read
	srv    *http.Server
	down   bool
}

// SSMURL is where the Parameter Store stand-in answers: on Options.SSMHost,
// which the manager and the instances' containers both reach.
func (s *Server) SSMURL() string { return s.ssmURL }

func (s *Server) startSSM() error {
	host := s.opt.SSMHost
	if host == "" {
		host = "127.0.0.1"
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return err
	}
	s.ssm = &ssmState{params: map[string]*Parameter{}, keys: map[string]string{}, calls: map[string]int{}, denied: map[string]bool{}}
	if !s.opt.Unthrottled {
		s.ssm.bucket = rate.NewLimiter(40, 40)
	}
	s.ssmURL = "http://" + ln.Addr().String()
	s.ssm.srv = &http.Server{Handler: http.HandlerFunc(s.serveSSM), ReadHeaderTimeout: 10 * time.Second}
	go s.ssm.srv.Serve(ln)
	return nil
}

// Parameters returns copies of the stored parameters, expired ones gone.
func (s *Server) Parameters() []Parameter {
	st := s.ssm
	st.mu.Lock()
	defer st.mu.Unlock()
	st.expire(time.Now())
	var out []Parameter
	for _, p := range st.params {
		c := *p
		c.Tags = maps.Clone(p.Tags)
		out = append(out, c)
	}
	return out
}

// TakenParameters returns the parameters that an instance deleted, as
// they were: what a test looks for where a job could read.
func (s *Server) TakenParameters() []Parameter {
	s.ssm.mu.Lock()
	defer s.ssm.mu.Unlock()
	return slices.Clone(s.ssm.taken)
}

// DenyHandoff makes an instance profile's role one without runfleet's
// statement (a role made for something else, CML's --cloud-permission-set
// for S3): its instances are denied every parameter.
func (s *Server) DenyHandoff(profile string) {
	s.ssm.mu.Lock()
	defer s.ssm.mu.Unlock()
	s.ssm.denied[profile] = true
}

// SSMCalls returns how many requests each Parameter Store action got.
func (s *Server) SSMCalls() map[string]int {
	st := s.ssm
	st.mu.Lock()
	defer st.mu.Unlock()
	return maps.Clone(st.calls)
}

// SetSSMDown makes Parameter Store answer every call 503 (an outage), or
// brings it back.
func (s *Server) SetSSMDown(down bool) {
	s.ssm.mu.Lock()
	defer s.ssm.mu.Unlock()
	s.ssm.down = down
}

// InstanceARN is an instance's ARN in us-east-1, as
// ${ec2:SourceInstanceARN} gives it.
func InstanceARN(id string) string { return regionARN("us-east-1", id) }

// regionARN is an instance's ARN in a region: the stand-in serves any,
// and an instance's calls are signed for its own.
func regionARN(region, id string) string {
	return "arn:aws:ec2:" + region + ":" + owner + ":instance/" + id
}

// roleCredentials are an instance's role credentials
// (iam/security-credentials/<role>) as its metadata service gives them:
// only an instance launched with an instance profile has them.
func (s *Server) roleCredentials(in *Instance) (string, bool) {
	key, secret, token, ok := s.RoleCredentials(in.ID)
	if !ok {
		return "", false
	}
	b, _ := json.Marshal(map[string]string{
		"Code": "Success", "LastUpdated": time.Now().UTC().Format(time.RFC3339), "Type": "AWS-HMAC",
		"AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
		"Expiration": time.Now().Add(6 * time.Hour).UTC().Format(time.RFC3339),
	})
	return string(b), true
}

// RoleCredentials are the role credentials of an instance launched with
// an instance profile, made at the first ask: what any process on it
// reads from its metadata service.
func (s *Server) RoleCredentials(id string) (key, secret, token string, ok bool) {
	if s.instanceProfile(id) == "" {
		return "", "", "", false
	}
	st := s.ssm
	st.mu.Lock()
	defer st.mu.Unlock()
	for k, i := range st.keys {
		if i == id {
			return k, "secret-" + k, "IQoJ-" + k, true
		}
	}
	key = "ASIA" + strings.ToUpper(randHex(8))
	st.keys[key] = id
	return key, "secret-" + key, "IQoJ-" + key, true
}

// roleName is the role of an instance profile given by name or ARN (the
// stand-in names the role as its profile).
func roleName(profile string) string { return profile[strings.LastIndex(profile, "/")+1:] }

// credentialKey reads a SigV4 Authorization's access key id and region.
var credentialKey = regexp.MustCompile(`Credential=([A-Z0-9a-z-]+)/\d{8}/([a-z0-9-]+)/`)

type ssmError struct {
	status    int
	code, msg string
}

func (s *Server) serveSSM(w http.ResponseWriter, r *http.Request) {
	st := s.ssm
	action, ok := strings.CutPrefix(r.Header.Get("X-Amz-Target"), "AmazonSSM.")
	if r.Method != http.MethodPost || !ok {
		writeSSMError(w, &ssmError{http.StatusBadRequest, "UnknownOperationException", ""})
		return
	}
	var caller, region string // caller: "" for the account, else the calling instance's id
	m := credentialKey.FindStringSubmatch(r.Header.Get("Authorization"))
	if m != nil {
		region = m[2]
	}
	switch {
	case m == nil:
		writeSSMError(w, &ssmError{http.StatusBadRequest, "MissingAuthenticationTokenException", "Missing Authentication Token"})
		return
	case m[1] == AccessKey:
	default:
		st.mu.Lock()
		id, known := st.keys[m[1]]
		st.mu.Unlock()
		if !known || r.Header.Get("X-Amz-Security-Token") == "" {
			writeSSMError(w, &ssmError{http.StatusBadRequest, "UnrecognizedClientException", "The security token included in the request is invalid."})
			return
		}
		caller = id
	}
	var in struct {
		Name, Value, Type, Tier, Policies string
		Overwrite, WithDecryption         bool
		Tags                              []struct{ Key, Value string }
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10)).Decode(&in); err != nil {
		writeSSMError(w, &ssmError{http.StatusBadRequest, "SerializationException", err.Error()})
		return
	}
	profile := ""
	if caller != "" {
		profile = s.instanceProfile(caller)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.calls[action]++
	if st.down {
		writeSSMError(w, &ssmError{http.StatusServiceUnavailable, "InternalServerError", "Service Unavailable"})
		return
	}
	if (action == "GetParameter" || action == "PutParameter") && st.bucket != nil && !st.bucket.Allow() {
		writeSSMError(w, &ssmError{http.StatusBadRequest, "ThrottlingException", "Rate exceeded"})
		return
	}
	now := time.Now()
	st.expire(now)
	if caller != "" {
		if err := st.authorize(caller, region, action, in.Name, profile); err != nil {
			writeSSMError(w, err)
			return
		}
	}
	var out any
	var err *ssmError
	switch action {
	case "PutParameter":
		tags := map[string]string{}
		for _, t := range in.Tags {
			tags[t.Key] = t.Value
		}
		out, err = st.put(in.Name, in.Value, in.Type, in.Tier, in.Policies, in.Overwrite, len(in.Tags) > 0, tags, now)
	case "GetParameter":
		out, err = st.get(in.Name, in.WithDecryption)
	case "DeleteParameter":
		p, ok := st.params[in.Name]
		if !ok {
			err = &ssmError{http.StatusBadRequest, "ParameterNotFound", ""}
			break
		}
		if caller != "" {
			st.taken = append(st.taken, *p)
		}
		delete(st.params, in.Name)
		out = struct{}{}
	default:
		err = &ssmError{http.StatusBadRequest, "UnknownOperationException", ""}
	}
	if err != nil {
		writeSSMError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-amz-json-1.1")
	_ = json.NewEncoder(w).Encode(out)
}

// instanceProfile is an instance's profile, "" when it is not known.
func (s *Server) instanceProfile(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if in, ok := s.instances[id]; ok {
		return in.Profile
	}
	return ""
}

// authorize applies the instance policy runfleet documents to a call
// made with an instance's role credentials. Called with st.mu held.
func (st *ssmState) authorize(id, region, action, name, profile string) *ssmError {
	p, ok := st.params[name]
	allowed := !st.denied[profile] && (action == "GetParameter" || action == "DeleteParameter") &&
		strings.HasPrefix(name, "/runfleet/") && ok && p.Tags[TagInstance] == regionARN(region, id)
	if allowed {
		return nil
	}
	return &ssmError{http.StatusBadRequest, "AccessDeniedException", fmt.Sprintf(
		"User: arn:aws:sts::%s:assumed-role/%s/%s is not authorized to perform: ssm:%s on resource: arn:aws:ssm:%s:%s:parameter%s because no identity-based policy allows the ssm:%s action",
		owner, roleName(profile), id, action, region, owner, name, action)}
}

// expire deletes the parameters whose Expiration has come. Called with
// st.mu held.
func (st *ssmState) expire(now time.Time) {
	for n, p := range st.params {
		if !p.Expires.IsZero() && !now.Before(p.Expires) {
			delete(st.params, n)
		}
	}
}

// parameterName is what the API reference allows in a name; names may
// not begin with aws or ssm, and have at most 15 levels.
var parameterName = regexp.MustCompile(`^[a-zA-Z0-9_.\-/]+$`)

func (st *ssmState) put(name, value, typ, tier, policies string, overwrite, tagged bool, tags map[string]string, now time.Time) (any, *ssmError) {
	invalid := func(msg string) *ssmError { return &ssmError{http.StatusBadRequest, "ValidationException", msg} }
	low := strings.ToLower(strings.TrimPrefix(name, "/"))
	switch {
	case !parameterName.MatchString(name) || len(name) > 1011 || strings.HasPrefix(low, "aws") || strings.HasPrefix(low, "ssm"):
		return nil, invalid(`Parameter name: can't be prefixed with "aws" or "ssm" (case-insensitive). It must use only letters, numbers, or the following symbols: . (period), - (hyphen), _ (underscore). Special characters are not allowed. All sub-paths, if specified, must use the forward slash symbol "/".`)
	case strings.Count(name, "/") > 15:
		return nil, &ssmError{http.StatusBadRequest, "HierarchyLevelLimitExceededException", "A hierarchy can have a maximum of 15 levels."}
	case typ != "String" && typ != "StringList" && typ != "SecureString":
		return nil, invalid(fmt.Sprintf("1 validation error detected: Value '%s' at 'type' failed to satisfy constraint: Member must satisfy enum value set: [SecureString, StringList, String]", typ))
	case overwrite && tagged:
		return nil, invalid("Invalid request: tags and overwrite can't be used together. To create a parameter with tags, please remove overwrite flag. To update tags for an existing parameter, please use AddTagsToResource or RemoveTagsFromResource.")
	}
	var expires time.Time
	if policies != "" {
		var ps []struct {
			Type       string
			Attributes map[string]string
		}
		if err := json.Unmarshal([]byte(policies), &ps); err != nil {
			return nil, &ssmError{http.StatusBadRequest, "InvalidPolicyTypeException", "The policy type is not supported."}
		}
		for _, p := range ps {
			if p.Type != "Expiration" {
				continue
			}
			t, err := time.Parse(time.RFC3339, p.Attributes["Timestamp"])
			if err != nil || !t.After(now) {
				return nil, &ssmError{http.StatusBadRequest, "InvalidPolicyAttributeException", "Expiration timestamp must be in the future."}
			}
			expires = t
		}
	}
	switch tier {
	case "", "Standard":
		tier = "Standard"
		if policies != "" {
			return nil, invalid("Parameter policies are supported only for the advanced-parameter tier.")
		}
	case "Intelligent-Tiering":
		tier = "Standard"
		if policies != "" || len(value) > 4096 {
			tier = "Advanced"
		}
	case "Advanced":
	default:
		return nil, invalid(fmt.Sprintf("1 validation error detected: Value '%s' at 'tier' failed to satisfy constraint: Member must satisfy enum value set: [Advanced, Intelligent-Tiering, Standard]", tier))
	}
	if limit := map[string]int{"Standard": 4096, "Advanced": 8192}[tier]; len(value) > limit || value == "" {
		return nil, invalid(fmt.Sprintf("1 validation error detected: Value at 'value' failed to satisfy constraint: Member must have length between 1 and %d (the %s tier's limit)", limit, tier))
	}
	version := 1
	if old, ok := st.params[name]; ok {
		if !overwrite {
			return nil, &ssmError{http.StatusBadRequest, "ParameterAlreadyExists", "The parameter already exists. To overwrite this value, set the overwrite option in the request to true."}
		}
		version, tags = old.Version+1, old.Tags
	}
	st.params[name] = &Parameter{Name: name, Type: typ, Tier: tier, Value: value, Tags: tags, Version: version, Modified: now, Expires: expires}
	return map[string]any{"Tier": tier, "Version": version}, nil
}

func (st *ssmState) get(name string, decrypt bool) (any, *ssmError) {
	p, ok := st.params[name]
	if !ok {
		return nil, &ssmError{http.StatusBadRequest, "ParameterNotFound", ""}
	}
	value := p.Value
	if p.Type == "SecureString" && !decrypt {
		// Without decryption a SecureString's value is its ciphertext.
		value = base64.StdEncoding.EncodeToString([]byte("ec2sim-ciphertext:" + randHex(16)))
	} else {
		p.Reads++
	}
	return map[string]any{"Parameter": map[string]any{
		"ARN": "arn:aws:ssm:us-east-1:" + owner + ":parameter" + name, "DataType": "text", "Name": name, "Type": p.Type,
		"Value": value, "Version": p.Version, "LastModifiedDate": float64(p.Modified.UnixMilli()) / 1000,
	}}, nil
}

func writeSSMError(w http.ResponseWriter, e *ssmError) {
	w.Header().Set("Content-Type", "application/x-amz-json-1.1")
	w.Header().Set("X-Amzn-ErrorType", e.code)
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(map[string]string{"__type": e.code, "message": e.msg})
}
