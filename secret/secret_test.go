package secret

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

func TestNeverFormats(t *testing.T) {
	s := String("glpat-very-secret")
	type holder struct{ Token String }
	var buf strings.Builder
	slog.New(slog.NewTextHandler(&buf, nil)).Info("x", "token", s, "holder", holder{s})
	b, _ := json.Marshal(holder{s})
	for _, out := range []string{fmt.Sprint(s), fmt.Sprintf("%v %+v %#v %s %q", s, holder{s}, s, s, s), buf.String(), string(b)} {
		if strings.Contains(out, "very-secret") {
			t.Errorf("secret revealed: %s", out)
		}
	}
	if s.Reveal() != "glpat-very-secret" {
		t.Error("Reveal")
	}
	var back String
	if err := json.Unmarshal([]byte(`"abc"`), &back); err != nil || back.Reveal() != "abc" {
		t.Errorf("unmarshal: %q %v", back.Reveal(), err)
	}
	if err := json.Unmarshal([]byte(`42`), &back); err == nil {
		t.Error("a number was taken for a secret")
	}
}
