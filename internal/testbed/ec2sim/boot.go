package ec2sim

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"
)

// Labels of an instance's container.
const (
	LabelServer   = "ec2sim.server"
	LabelInstance = "ec2sim.instance"
)

// InitPath is the image's stand-in for cloud-init: it runs
// /var/lib/cloud/instance/user-data.txt once, and the machine stays up
// until something powers it off (PID 1 exits).
const InitPath = "/sbin/ec2-init"

// boot brings an instance up: a container of its AMI's image with its
// user data and a metadata service of its own, or, without an image,
// nothing but the state.
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
	if err := s.start(in, image); err != nil {
		s.opt.Logger.Error("ec2sim: instance did not boot", "id", in.ID, "err", err)
		s.finish(in, "Server.InternalError", "Server.InternalError: Internal error on launch")
		return
	}
	res := s.opt.Docker.ContainerWait(context.Background(), in.container, client.ContainerWaitOptions{Condition: container.WaitConditionNotRunning})
	select {
	case <-res.Result:
	case <-res.Error:
	}
	// An instance whose own shutdown ended it: terminated, as its
	// shutdown behaviour says (the stand-in does not keep stopped ones).
	s.finish(in, "Client.InstanceInitiatedShutdown", "Client.InstanceInitiatedShutdown: Instance initiated shutdown")
}

func (s *Server) start(in *Instance, image string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	md, err := s.serveMetadata(in)
	if err != nil {
		return err
	}
	s.mu.Lock()
	in.imds = md
	s.mu.Unlock()
	created, err := s.opt.Docker.ContainerCreate(ctx, client.ContainerCreateOptions{
		Name: "ec2sim-" + in.ID,
		Config: &container.Config{
			Image: image, Cmd: []string{InitPath}, Hostname: in.hostname,
			Env:    []string{"AWS_EC2_METADATA_SERVICE_ENDPOINT=" + md.url},
			Labels: map[string]string{LabelServer: s.id, LabelInstance: in.ID},
		},
		HostConfig: &container.HostConfig{ExtraHosts: []string{"host.docker.internal:host-gateway"}},
	})
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	s.mu.Lock()
	in.container = created.ID
	s.mu.Unlock()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"var/", "var/lib/", "var/lib/cloud/", "var/lib/cloud/instance/"} {
		_ = tw.WriteHeader(&tar.Header{Name: d, Typeflag: tar.TypeDir, Mode: 0o755})
	}
	_ = tw.WriteHeader(&tar.Header{Name: "var/lib/cloud/instance/user-data.txt", Mode: 0o700, Size: int64(len(in.UserData))})
	_, _ = tw.Write(in.UserData)
	_ = tw.Close()
	if _, err := s.opt.Docker.CopyToContainer(ctx, created.ID, client.CopyToContainerOptions{DestinationPath: "/", Content: &buf}); err != nil {
		return fmt.Errorf("user data: %w", err)
	}
	if _, err := s.opt.Docker.ContainerStart(ctx, created.ID, client.ContainerStartOptions{}); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	s.mu.Lock()
	if in.State == "pending" {
		in.State = "running"
	}
	s.mu.Unlock()
	return nil
}

// stopInstance shuts an instance down (a termination, an interruption):
// its container is stopped, and its end is recorded by boot, or here
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
	id := in.container
	s.mu.Unlock()
	if id == "" || s.opt.Docker == nil {
		s.finish(in, code, msg)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	timeout := 2
	_, _ = s.opt.Docker.ContainerStop(ctx, id, client.ContainerStopOptions{Timeout: &timeout})
}

// finish records the end of an instance once: its console kept, its
// container and metadata service gone, and only then terminated, as EC2
// lists an instance terminated once it is gone.
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
	id, md := in.container, in.imds
	s.mu.Unlock()
	if md != nil {
		_ = md.srv.Close()
	}
	var console string
	if id != "" && s.opt.Docker != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if logs, err := s.opt.Docker.ContainerLogs(ctx, id, client.ContainerLogsOptions{ShowStdout: true, ShowStderr: true, Tail: "500"}); err == nil {
			b, _ := io.ReadAll(io.LimitReader(logs, 1<<20))
			logs.Close()
			console = string(b)
		}
		_, _ = s.opt.Docker.ContainerRemove(ctx, id, client.ContainerRemoveOptions{Force: true})
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	in.Console = console
	in.State = "terminated"
	in.Ended = time.Now()
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
		time.Sleep(after)
		s.stopInstance(in, "Server.SpotInstanceTermination", "Server.SpotInstanceTermination: Spot instance termination")
	}()
	return nil
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
		c.action, c.imds = nil, nil
		out = append(out, c)
	}
	return out
}

// Container returns the container of a running instance.
func (s *Server) Container(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if in, ok := s.instances[id]; ok && in.State == "running" {
		return in.container
	}
	return ""
}

type noticeDoc struct {
	Action string `json:"action"`
	Time   string `json:"time"`
}

// metadata is an instance's metadata service, IMDSv2 only.
type metadata struct {
	srv    *http.Server
	url    string
	mu     sync.Mutex
	tokens map[string]time.Time
}

func (s *Server) serveMetadata(in *Instance) (*metadata, error) {
	ln, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	md := &metadata{url: "http://" + s.opt.HostAddr + ":" + strconv.Itoa(port), tokens: map[string]time.Time{}}
	md.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.metadataAnswer(in, md, w, r) }), ReadHeaderTimeout: 10 * time.Second}
	go md.srv.Serve(ln)
	return md, nil
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
	s.mu.Lock()
	body, found := in.metadataPath(strings.TrimPrefix(r.URL.Path, "/latest/"))
	s.mu.Unlock()
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
