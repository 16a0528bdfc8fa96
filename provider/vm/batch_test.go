package vm

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// Creates that arrive while a launch is under way go out together in the
// next, one launch per market and at most Max at a time; a Create whose
// context ended by its launch's turn is answered so, not launched.
func TestBatcherGathers(t *testing.T) {
	first := make(chan struct{})
	var mu sync.Mutex
	var launches []string
	b := &Batcher{Max: 4,
		Market: func(s provider.Spec) (bool, bool) { return s.Request.Spot != nil && *s.Request.Spot, false },
		Launch: func(batch []*Request, spot, _ bool) {
			if batch[0].Spec.Name == "r0" {
				<-first // the first launch holds until the rest wait
			}
			mu.Lock()
			launches = append(launches, fmt.Sprintf("%d spot=%t", len(batch), spot))
			mu.Unlock()
			for _, r := range batch {
				r.Done(provider.Instance{ID: "i-" + r.Spec.Name, Name: r.Spec.Name}, nil)
			}
		},
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		if inst, err := b.Do(context.Background(), provider.Spec{Name: "r0"}); err != nil || inst.ID != "i-r0" {
			t.Errorf("r0: %+v %v", inst, err)
		}
	})
	waiting := func() (int, bool) {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.waiting), b.busy
	}
	// r0 taken into its launch, which holds.
	for n, busy := waiting(); !busy || n > 0; n, busy = waiting() {
		time.Sleep(time.Millisecond)
	}
	yes := true
	for i := 1; i <= 6; i++ {
		spec := provider.Spec{Name: fmt.Sprintf("r%d", i)}
		if i%2 == 0 {
			spec.Request.Spot = &yes
		}
		wg.Go(func() {
			if inst, err := b.Do(context.Background(), spec); err != nil || inst.ID != "i-"+spec.Name {
				t.Errorf("%s: %+v %v", spec.Name, inst, err)
			}
		})
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	wg.Go(func() {
		if _, err := b.Do(gone, provider.Spec{Name: "late"}); err != context.Canceled {
			t.Errorf("a Create whose context ended: %v", err)
		}
	})
	for n, _ := waiting(); n < 7; n, _ = waiting() {
		time.Sleep(time.Millisecond)
	}
	close(first)
	wg.Wait()
	// r0 alone; then 4 of the 7 waiting (the cancelled one answered, 3
	// launched by market), then the last 3.
	if len(launches) < 3 || launches[0] != "1 spot=false" {
		t.Errorf("launches %v", launches)
	}
	n := 0
	for _, l := range launches {
		var k int
		fmt.Sscanf(l, "%d", &k)
		n += k
	}
	if n != 7 {
		t.Errorf("launches %v: %d launched, want 7", launches, n)
	}
}

// Runners of one market but of different sizes (a dynamic pool's jobs
// asking gpus=1 and gpus=4) launch apart, each launch of one size, so
// that each is asked of the types that fit it; those of one size go
// together.
func TestBatcherLaunchesBySize(t *testing.T) {
	first := make(chan struct{})
	var mu sync.Mutex
	sizes := map[string][]int{} // size -> the launches' lengths
	b := &Batcher{Max: 10,
		Market: func(provider.Spec) (bool, bool) { return false, false },
		Size:   func(s provider.Spec) string { return fmt.Sprint(s.Request.GPUs) },
		Launch: func(batch []*Request, _, _ bool) {
			if batch[0].Spec.Name == "r0" {
				<-first
			}
			size := fmt.Sprint(batch[0].Spec.Request.GPUs)
			mu.Lock()
			sizes[size] = append(sizes[size], len(batch))
			mu.Unlock()
			for _, r := range batch {
				if got := fmt.Sprint(r.Spec.Request.GPUs); got != size {
					t.Errorf("a launch of size %s holds %s of size %s", size, r.Spec.Name, got)
				}
				r.Done(provider.Instance{ID: "i-" + r.Spec.Name}, nil)
			}
		},
	}
	var wg sync.WaitGroup
	do := func(name string, gpus int) {
		wg.Go(func() {
			spec := provider.Spec{Name: name}
			spec.Request.GPUs = gpus
			if _, err := b.Do(context.Background(), spec); err != nil {
				t.Errorf("%s: %v", name, err)
			}
		})
	}
	do("r0", 1)
	for busy := false; !busy; {
		b.mu.Lock()
		busy = b.busy && len(b.waiting) == 0
		b.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
	for i, gpus := range []int{1, 4, 1, 4, 1} {
		do(fmt.Sprintf("r%d", i+1), gpus)
	}
	for n := 0; n < 5; {
		b.mu.Lock()
		n = len(b.waiting)
		b.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
	close(first)
	wg.Wait()
	if fmt.Sprint(sizes["1"]) != "[1 3]" || fmt.Sprint(sizes["4"]) != "[2]" {
		t.Errorf("launches by size %v, want r0 alone, then the three of 1 GPU together and the two of 4 together", sizes)
	}
}
