package config

import (
	"encoding/json"
	"testing"
	"time"
)

func TestDurationRoundTrip(t *testing.T) {
	var d Duration
	if err := json.Unmarshal([]byte(`"1h30m"`), &d); err != nil || d.Duration != 90*time.Minute || d.Check() != nil {
		t.Fatalf("%v %v", d, err)
	}
	b, err := json.Marshal(d)
	if err != nil || string(b) != `"1h30m0s"` {
		t.Fatalf("marshal: %s %v", b, err)
	}
	if err := json.Unmarshal([]byte(`"5x"`), &d); err != nil || d.Check() == nil || !d.Given() {
		t.Fatalf("a bad duration is kept for Check to name: %v", d.Check())
	}
}
