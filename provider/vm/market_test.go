package vm

import (
	"slices"
	"testing"
)

func TestMarket(t *testing.T) {
	no, yes := false, true
	for _, c := range []struct {
		poolSpot, poolFallback bool
		req                    *bool
		spot, fallback         bool
	}{
		{true, true, nil, true, true},
		{true, true, &no, false, false},  // the job wants a standard machine
		{true, false, &yes, true, false}, // Spot, as the pool
		{false, false, &yes, false, false},
	} {
		spot, fallback := Market(c.poolSpot, c.poolFallback, c.req)
		if spot != c.spot || fallback != c.fallback {
			t.Errorf("Market(%v, %v, %v) = %v, %v; want %v, %v", c.poolSpot, c.poolFallback, c.req, spot, fallback, c.spot, c.fallback)
		}
	}
	if len(Honours(false, false)) != 0 || !slices.Equal(Honours(true, false), []string{"spot"}) || !slices.Equal(Honours(false, true), []string{"cpu", "mem", "gpus", "gpu"}) {
		t.Error("Honours")
	}
}
