package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/server"
)

// syncBuffer is a bytes.Buffer the watch writes while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestStatusWatchRedraws: --watch draws what the manager's status
// listener shows (with its token), again each interval, until
// interrupted, and exits 0.
func TestStatusWatchRedraws(t *testing.T) {
	const token = "watch-token-0123456789"
	var asked sync.WaitGroup
	asked.Add(2)
	var once sync.Map
	manager := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/status.json" || r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		n, _ := once.LoadOrStore("n", new(int))
		*n.(*int)++
		if *n.(*int) <= 2 {
			asked.Done()
		}
		json.NewEncoder(w).Encode(server.Page{
			Manager: "m1", Now: time.Now(),
			Forges: []server.ForgeView{{Name: "local", Words: []string{"Gitea (forge local), reading its queue: unreachable"}}},
			Pools: []server.PoolView{{Name: "gpu", Forge: "local", Provider: "docker", Size: 1, Max: 2, Queued: 3, CostDay: "1.50 USD", CostWeek: "9.00 USD",
				Words:   []string{"3 jobs queued, and the pool has its most runners (max 2): they wait for a runner to end."},
				Runners: []server.RunnerRow{{Name: "gpu-1", State: "busy", Age: "2m", GPUs: "GPU-1", Job: "train (1)"}}}},
			GPUs: &server.GPUView{Summary: "driver 550, CUDA 12.4, 1 GPUs", Units: []server.GPURow{{Index: "0", Name: "NVIDIA H100", Memory: "80 GiB", Use: "87% · 40.3 GiB of 80 GiB", Runner: "gpu-1", Job: "train (1)"}}},
		})
	}))
	defer manager.Close()
	cfg := jobsConfig(t, filepath.Join(t.TempDir(), "history.db"))
	b, _ := os.ReadFile(cfg)
	os.WriteFile(cfg, []byte("status_listen: "+strings.TrimPrefix(manager.URL, "http://")+"\nstatus_token: "+token+"\n"+string(b)), 0o600)

	var out syncBuffer
	root := New()
	root.SetOut(&out)
	root.SetArgs([]string{"status", "-c", cfg, "--watch", "--interval", "1s"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	asked.Wait()
	time.Sleep(100 * time.Millisecond) // the second frame written
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("interrupted: %v, want 0", err)
	}
	got := out.String()
	if n := strings.Count(got, "runfleet · m1"); n < 2 {
		t.Errorf("%d frames, want 2 or more:\n%s", n, got)
	}
	for _, want := range []string{"3 jobs queued", "! Gitea (forge local), reading its queue: unreachable", "gpu (local, docker): size 1, max 2, 3 queued · today 1.50 USD, this week 9.00 USD",
		"  ! 3 jobs queued, and the pool has its most runners", "gpu-1  busy", "87% · 40.3 GiB of 80 GiB  gpu-1 train (1)"} {
		if !strings.Contains(got, want) {
			t.Errorf("the frame lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, clearScreen) {
		t.Error("a frame cleared a screen that is not a terminal")
	}
}
