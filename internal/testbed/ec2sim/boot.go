package ec2sim

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/runfleet/runfleet/internal/testbed/vmboot"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Labels of an instance's container.
const (
	LabelServer   = "ec2sim.server"
	LabelInstance = "ec2sim.instance"
)

// boot brings an instance up: a container of its AMI's image with its
// user data and a metadata service of its own (vmboot), or, without an
// image, nothing but the state.
func (s *Server) boot(in *Instance, image string) {
	defer s.wg.Done()
	if s.opt.Docker == nil || image == "" {
		time.Sleep(200 * time.Millisecond)
		s.mu.Lock()
		if in.State == "pending" {
			in.State = "running"
		}
		s.mu.Unlock()
		return
	}
	m, err := s.start(in, image)
	if err != nil {
		s.opt.Logger.Error("ec2sim: instance did not boot", "id", in.ID, "err", err)
		s.finish(in, "Server.InternalError", "Server.InternalError: Internal error on launch")
		return
	}
	if m == nil {
		return
	}
	m.Wait()
	// An instance whose own shutdown ended it: terminated, as its
	// shutdown behaviour says (the stand-in does not keep stopped ones).
	s.finish(in, "Client.InstanceInitiatedShutdown", "Client.InstanceInitiatedShutdown: Instance initiated shutdown")
}

func (s *Server) start(in *Instance, image string) (*vmboot.Machine, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	md := &metadata{tokens: map[string]time.Time{}}
	var binds []string
	if s.opt.Engine != "" {
		binds = []string{s.opt.Engine + ":/var/run/docker.sock", "/tmp:/tmp"}
	}
	m, err := vmboot.Create(ctx, vmboot.Options{
		Binds:  binds,
		Docker: s.opt.Docker, HostAddr: s.opt.HostAddr, Name: "ec2sim-" + in.ID, Image: image, Hostname: in.hostname,
		Labels: map[string]string{LabelServer: s.id, LabelInstance: in.ID}, Script: in.UserData,
		Metadata: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.metadataAnswer(in, md, w, r) }),
		Env: func(hostPort string) []string {
			return []string{"AWS_EC2_METADATA_SERVICE_ENDPOINT=http://" + hostPort}
		},
	})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	in.machine = m
	stopping := in.State != "pending"
	s.mu.Unlock()
	if stopping {
		// Terminated while it was being made: its end is recorded
		// already, and nothing else removes its container.
		m.Finish()
		return nil, nil
	}
	if err := m.Start(ctx); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if in.State == "pending" {
		in.State = "running"
	}
	s.mu.Unlock()
	return m, nil
}

// stopInstance shuts an instance down (a termination, an interruption):
// its machine is stopped, and its end is recorded by boot, or here
// when nothing runs.
func (s *Server) stopInstance(in *Instance, code, msg string) {
	s.mu.Lock()
	if in.State == "terminated" {
		s.mu.Unlock()
		return
	}
	in.shutDown()
	if code != "" {
		in.ReasonCode, in.ReasonMessage = code, msg
	}
	m := in.machine
	s.mu.Unlock()
	if m == nil {
		s.finish(in, code, msg)
		return
	}
	m.Stop()
}

// finish records the end of an instance once: its console kept, its
// machine gone, and only then terminated, as EC2 lists an instance
// terminated once it is gone.
func (s *Server) finish(in *Instance, code, msg string) {
	s.mu.Lock()
	if in.State == "terminated" || in.finishing {
		s.mu.Unlock()
		return
	}
	in.finishing = true
	if in.ReasonCode == "" {
		in.ReasonCode, in.ReasonMessage = code, msg
	}
	in.shutDown()
	m := in.machine
	s.mu.Unlock()
	var console string
	if m != nil {
		console = m.Finish()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	in.Console = console
	in.State = "terminated"
	in.Ended = time.Now()
	s.releaseVolumes(in.ID)
	if in.Spot && strings.HasPrefix(in.SpotStatus, "marked") {
		in.SpotStatus, in.SpotStatusTime = "instance-terminated-no-capacity", in.Ended
	} else if in.Spot {
		in.SpotStatus, in.SpotStatusTime = "instance-terminated-by-user", in.Ended
	}
}

// Interrupt gives a spot instance its two-minute notice (after instead
// of two minutes): its spot request is marked for termination, its
// metadata service shows spot/instance-action, and at the time it is
// terminated.
func (s *Server) Interrupt(id string, after time.Duration) error {
	s.mu.Lock()
	in, ok := s.instances[id]
	if !ok || !in.Spot || in.State == "terminated" {
		s.mu.Unlock()
		return fmt.Errorf("ec2sim: %s is not a live spot instance", id)
	}
	now := time.Now().UTC()
	in.SpotStatus, in.SpotStatusTime = "marked-for-termination", now
	in.action = &noticeDoc{Action: "terminate", Time: now.Add(after).Format("2006-01-02T15:04:05Z")}
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		// Close stops every instance itself: a notice still pending
		// (the manager terminated the instance first) holds it up no
		// longer.
		select {
		case <-time.After(after):
		case <-s.quit:
			return
		}
		s.stopInstance(in, "Server.SpotInstanceTermination", "Server.SpotInstanceTermination: Spot instance termination")
	}()
	return nil
}

// PowerOff is a guest's own shutdown of an instance that runs nothing:
// EC2 lists it shutting-down, as its shutdown behaviour terminates it,
// for as long as takes, then terminated.
func (s *Server) PowerOff(id string, takes time.Duration) {
	s.mu.Lock()
	in, ok := s.instances[id]
	if !ok || in.State == "terminated" {
		s.mu.Unlock()
		return
	}
	in.shutDown()
	in.ReasonCode, in.ReasonMessage = "Client.InstanceInitiatedShutdown", "Client.InstanceInitiatedShutdown: Instance initiated shutdown"
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		time.Sleep(takes)
		s.finish(in, "", "")
	}()
}

// Rebalance gives an instance a rebalance recommendation.
func (s *Server) Rebalance(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if in, ok := s.instances[id]; ok {
		now := time.Now().UTC()
		in.rebalance = &now
	}
}

// Instances returns copies of every instance, in launch order.
func (s *Server) Instances() []Instance {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Instance, 0, len(s.order))
	for _, id := range s.order {
		c := *s.instances[id]
		c.action, c.machine = nil, nil
		out = append(out, c)
	}
	return out
}

// Container returns the container of a running instance.
func (s *Server) Container(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if in, ok := s.instances[id]; ok && in.State == "running" && in.machine != nil {
		return in.machine.Container
	}
	return ""
}

type noticeDoc struct {
	Action string `json:"action"`
	Time   string `json:"time"`
}

// MetadataHandler is an instance's metadata service, for a test that
// plays the instance's side in process.
func (s *Server) MetadataHandler(id string) http.Handler {
	s.mu.Lock()
	in := s.instances[id]
	s.mu.Unlock()
	md := &metadata{tokens: map[string]time.Time{}}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.metadataAnswer(in, md, w, r) })
}

// metadata is an instance's metadata service's sessions (IMDSv2).
type metadata struct {
	mu     sync.Mutex
	tokens map[string]time.Time
}

// metadataAnswer follows IMDSv2: PUT /latest/api/token with a TTL of 1 to
// 21600 seconds gives a token; every read needs a live one (401
// otherwise); a path with nothing to say is 404.
func (s *Server) metadataAnswer(in *Instance, md *metadata, w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/latest/api/token" {
		if r.Method != http.MethodPut {
			http.Error(w, "", http.StatusMethodNotAllowed)
			return
		}
		ttl, err := strconv.Atoi(r.Header.Get("X-aws-ec2-metadata-token-ttl-seconds"))
		if err != nil || ttl < 1 || ttl > 21600 {
			http.Error(w, "", http.StatusBadRequest)
			return
		}
		tok := randHex(28)
		md.mu.Lock()
		md.tokens[tok] = time.Now().Add(time.Duration(ttl) * time.Second)
		md.mu.Unlock()
		w.Header().Set("X-aws-ec2-metadata-token-ttl-seconds", strconv.Itoa(ttl))
		_, _ = io.WriteString(w, tok)
		return
	}
	md.mu.Lock()
	exp, ok := md.tokens[r.Header.Get("X-aws-ec2-metadata-token")]
	md.mu.Unlock()
	if !ok || time.Now().After(exp) {
		http.Error(w, "", http.StatusUnauthorized)
		return
	}
	if r.Method != http.MethodGet {
		http.Error(w, "", http.StatusMethodNotAllowed)
		return
	}
	p := strings.TrimPrefix(r.URL.Path, "/latest/")
	s.mu.Lock()
	body, found := in.metadataPath(p)
	s.mu.Unlock()
	if role, ok := strings.CutPrefix(p, "meta-data/iam/security-credentials/"); ok && role != "" {
		// An instance's role credentials, its own (EC2 User Guide,
		// "Retrieve security credentials from instance metadata").
		found = false
		if in.Profile != "" && role == roleName(in.Profile) {
			body, found = s.roleCredentials(in)
		}
	}
	if p == "dynamic/instance-identity/signature" {
		s.mu.Lock()
		doc := in.identityDocument()
		s.identities++
		s.mu.Unlock()
		body, found = s.SignIdentity([]byte(doc)), true
	}
	if !found {
		http.Error(w, "", http.StatusNotFound)
		return
	}
	_, _ = io.WriteString(w, body)
}

// metadataPath answers one metadata path. Called with s.mu held.
func (in *Instance) metadataPath(p string) (string, bool) {
	switch p {
	case "meta-data/instance-id":
		return in.ID, true
	case "meta-data/instance-type":
		return in.Type, true
	case "meta-data/placement/availability-zone":
		return in.Zone, true
	case "meta-data/instance-life-cycle":
		if in.Spot {
			return "spot", true
		}
		return "on-demand", true
	case "user-data":
		return string(in.UserData), len(in.UserData) > 0
	case "dynamic/instance-identity/document":
		return in.identityDocument(), true
	case "meta-data/placement/region":
		return "us-east-1", true
	case "meta-data/iam/security-credentials/":
		return roleName(in.Profile), in.Profile != ""
	case "meta-data/spot/instance-action":
		if in.action == nil {
			return "", false
		}
		b, _ := json.Marshal(in.action)
		return string(b), true
	case "meta-data/events/recommendations/rebalance":
		if in.rebalance == nil {
			return "", false
		}
		b, _ := json.Marshal(map[string]string{"noticeTime": in.rebalance.Format("2006-01-02T15:04:05Z")})
		return string(b), true
	}
	return "", false
}
