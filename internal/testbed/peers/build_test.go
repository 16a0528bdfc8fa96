package peers

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestCachedBuildsOnce: test packages run as processes side by side, and
// several may ask for the same peer at once; it is built once, and each
// gets the one build.
func TestCachedBuildsOnce(t *testing.T) {
	if dir := os.Getenv("PEERS_TEST_CHILD"); dir != "" {
		bin, err := cached(context.Background(), nil, "peer-v1", "peer", func(_ context.Context, out string) error {
			f, err := os.OpenFile(filepath.Join(dir, "builds"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
			if err != nil {
				return err
			}
			fmt.Fprintln(f, os.Getpid())
			f.Close()
			time.Sleep(300 * time.Millisecond) // a build takes a while
			return os.WriteFile(out, []byte("built"), 0o755)
		})
		if err != nil {
			t.Fatal(err)
		}
		fmt.Println("BIN", bin)
		return
	}
	cache, log := t.TempDir(), t.TempDir()
	var wg sync.WaitGroup
	outs := make([]string, 4)
	for i := range outs {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^TestCachedBuildsOnce$")
			cmd.Env = append(os.Environ(), "PEERS_TEST_CHILD="+log, "RUNFLEET_CACHE="+cache)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Errorf("process %d: %v\n%s", i, err, out)
			}
			outs[i] = string(out)
		})
	}
	wg.Wait()
	b, _ := os.ReadFile(filepath.Join(log, "builds"))
	if n := strings.Count(string(b), "\n"); n != 1 {
		t.Errorf("%d builds by 4 processes asking at once, want 1", n)
	}
	want := "BIN " + filepath.Join(cache, "peer-v1", "peer")
	for i, out := range outs {
		if !strings.Contains(out, want) {
			t.Errorf("process %d got %q, want %q", i, out, want)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(cache, "peer-v1", "*.tmp")); len(left) > 0 {
		t.Errorf("half-built files left: %v", left)
	}
}
