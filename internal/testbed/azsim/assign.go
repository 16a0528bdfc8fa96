package azsim

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
)

// assign gives queued job requests, oldest first, to online, enabled
// agents without a job whose capabilities meet their demands. Called with
// s.mu held.
func (s *Server) assign() {
	for _, id := range slices.Sorted(maps.Keys(s.requests)) {
		req := s.requests[id]
		if req.AgentID != 0 || req.Result != "" {
			continue
		}
		for _, aid := range slices.Sorted(maps.Keys(s.agents)) {
			a := s.agents[aid]
			if a.Deleted || !a.Enabled || !a.Online || a.ShuttingDown || a.Request != 0 || a.PoolID != req.PoolID || !meets(a.capabilities(), req.Demands) {
				continue
			}
			sess := s.sessionOfAgent(a.ID)
			if sess == nil {
				continue
			}
			s.give(req, a, sess)
			break
		}
	}
}

func (s *Server) sessionOfAgent(id int) *session {
	for _, sess := range s.sessions {
		if sess.agentID == id {
			return sess
		}
	}
	return nil
}

// give assigns a request to an agent and queues its message. Called with
// s.mu held.
func (s *Server) give(req *Request, a *Agent, sess *session) {
	now := time.Now().UTC()
	req.AgentID, req.AgentName, req.Assigned = a.ID, a.Name, now
	req.LockedUntil = now.Add(s.opt.LockTimeout)
	req.jobToken = "job." + randHex(24)
	a.Request = req.ID
	a.Jobs++
	s.nextMsg++
	body, _ := json.Marshal(s.jobMessage(req))
	sess.messages = append(sess.messages, message{ID: s.nextMsg, Type: "PipelineAgentJobRequest", Body: string(body)})
	close(sess.wake)
	sess.wake = make(chan struct{})
}

// jobMessage is the part of a PipelineAgentJobRequest message (the
// pipeline's AgentJobRequestMessage) that the stand-in agent reads: the
// request, the plan, the job's name, its connection with its own token,
// and its script step.
func (s *Server) jobMessage(req *Request) map[string]any {
	return map[string]any{
		"messageType":    "PipelineAgentJobRequest",
		"plan":           map[string]any{"scopeIdentifier": "5f3c0a9e-0000-4000-8000-000000000002", "planType": "Build", "version": 9, "planId": req.PlanID},
		"timeline":       map[string]any{"id": req.PlanID},
		"jobId":          req.JobID,
		"jobDisplayName": req.Name,
		"jobName":        "__default",
		"requestId":      req.ID,
		"lockedUntil":    "0001-01-01T00:00:00",
		"resources": map[string]any{"endpoints": []map[string]any{{
			"name": "SystemVssConnection", "url": s.runnerURL + "/",
			"authorization": map[string]any{"scheme": "OAuth", "parameters": map[string]any{"AccessToken": req.jobToken}},
		}}},
		"variables": map[string]any{
			"system.teamProjectId": map[string]any{"value": "5f3c0a9e-0000-4000-8000-000000000002"},
			"build.buildId":        map[string]any{"value": strconv.Itoa(req.BuildID)},
		},
		"steps": []map[string]any{{
			"type": "task", "name": "CmdLine", "displayName": "Script",
			"reference": map[string]any{"id": "d9bafed4-0b18-4f58-968d-86655b4d2ce9", "name": "CmdLine", "version": "2.250.1"},
			"inputs":    map[string]any{"script": req.Script},
		}},
	}
}

// failUnmeetable fails a queued job request that no agent registered in
// its pool could ever take, whatever its state: Azure DevOps fails such a
// job at once with "No agent found in pool <pool> which satisfies the
// specified demands", rather than queue it, which is why a pool that
// scales from zero needs an agent registered and never run (KEDA's
// "placeholder agent": kedacore/keda-docs, scalers/azure-pipelines;
// kedacore/keda#5988; lippertmarkus.com/2023/02/26/keda-azure-pipelines-agent:
// "The Azure Pipeline needs at least one agent in the pool to not fail
// instantly with No agent found when we scale to zero"). Offline and
// disabled agents count: a job that only they meet waits, and the
// service says "All eligible agents are disabled or offline". Called with
// s.mu held.
func (s *Server) failUnmeetable(req *Request) {
	if req.AgentID != 0 || req.Result != "" {
		return
	}
	for _, a := range s.agents {
		if !a.Deleted && a.PoolID == req.PoolID && meets(a.capabilities(), req.Demands) {
			return
		}
	}
	req.Log = append(req.Log, fmt.Sprintf("##[error]No agent found in pool %s which satisfies the specified demands: %s\n",
		s.pools[req.PoolID].Name, strings.Join(req.Demands, ", "))...)
	s.finishRequest(req, "failed", false)
}

// failUnmeetableAll applies failUnmeetable to every queued request: an
// agent deleted, or its capabilities changed, may leave some that none
// meets. Called with s.mu held.
func (s *Server) failUnmeetableAll() {
	for _, id := range slices.Sorted(maps.Keys(s.requests)) {
		s.failUnmeetable(s.requests[id])
	}
}

// finishRequest ends a job request and frees its agent; an agent shutting
// down gets no other. Called with s.mu held.
func (s *Server) finishRequest(req *Request, result string, shuttingDown bool) {
	req.Result, req.Finished, req.jobToken = result, time.Now().UTC(), ""
	if a, ok := s.agents[req.AgentID]; ok && a.Request == req.ID {
		a.Request = 0
		a.ShuttingDown = a.ShuttingDown || shuttingDown
	}
	s.assign()
}

// offline takes an agent's session away. A job given to it that it never
// started fails, as the service fails a job whose agent went offline
// before taking it (azure-pipelines-agent issues 2332 and 4338). Called
// with s.mu held.
func (s *Server) offline(sess *session) {
	delete(s.sessions, sess.id)
	close(sess.wake)
	a := s.agents[sess.agentID]
	if a == nil {
		return
	}
	a.Online = false
	if req, ok := s.requests[a.Request]; ok && req.Result == "" && !req.Started {
		req.Log = append(req.Log, fmt.Sprintf("##[error]The agent %s went offline before it took the job.\n", a.Name)...)
		s.finishRequest(req, "failed", false)
	}
}

// expireLocks fails the jobs whose lock ran out (their agent died), and
// closes the sessions of agents that stopped asking for messages.
func (s *Server) expireLocks() {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		now := time.Now()
		s.mu.Lock()
		for _, req := range s.requests {
			if req.AgentID != 0 && req.Result == "" && now.After(req.LockedUntil) {
				s.finishRequest(req, "abandoned", false)
			}
		}
		for _, sess := range s.sessions {
			if now.Sub(sess.polled) > s.opt.LongPoll+30*time.Second {
				s.offline(sess)
			}
		}
		s.mu.Unlock()
	}
}

// meets decides whether capabilities meet demands as the service does:
// "name" wants the capability, "name -equals value" its value (both
// without regard to case), "name -gtVersion v" a version at least v.
func meets(caps map[string]string, demands []string) bool {
	find := func(name string) (string, bool) {
		for k, v := range caps {
			if strings.EqualFold(k, name) {
				return v, true
			}
		}
		return "", false
	}
	for _, d := range demands {
		f := strings.Fields(d)
		if len(f) == 0 {
			continue
		}
		v, ok := find(f[0])
		if !ok {
			return false
		}
		if len(f) < 3 {
			continue
		}
		want := strings.Join(f[2:], " ")
		switch strings.ToLower(f[1]) {
		case "-equals":
			if !strings.EqualFold(v, want) {
				return false
			}
		case "-gtversion":
			if versionLess(v, want) {
				return false
			}
		default:
			return false
		}
	}
	return true
}

func versionLess(a, b string) bool {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(pa) || i < len(pb); i++ {
		var x, y int
		if i < len(pa) {
			x, _ = strconv.Atoi(pa[i])
		}
		if i < len(pb) {
			y, _ = strconv.Atoi(pb[i])
		}
		if x != y {
			return x < y
		}
	}
	return false
}
