package agent

import (
	"testing"
)

func TestBaseEnvIsBuiltNotInherited(t *testing.T) {
	t.Setenv("GITEA_TOKEN", "secret")
	t.Setenv("PATH", "/opt/bin:/usr/bin")
	env := BaseEnv(map[string]string{"HF_HOME": "/data"})
	if env["PATH"] != "/opt/bin:/usr/bin" || env["LANG"] != "C.UTF-8" || env["HF_HOME"] != "/data" || len(env) != 3 {
		t.Errorf("env = %v", env)
	}
	t.Setenv("PATH", "")
	if BaseEnv(nil)["PATH"] != DefaultPath {
		t.Error("no PATH: the default search path")
	}
}

func TestLastPhase(t *testing.T) {
	m := map[Phase][]byte{PhaseReady: []byte("ready"), PhaseBusy: []byte("job started"), PhaseDone: []byte("job done")}
	for out, want := range map[string]Phase{
		"":                                  PhaseUnknown,
		"hello\n":                           PhaseUnknown,
		"ready\n":                           PhaseReady,
		"ready\njob started\n":              PhaseBusy,
		"ready\njob started\njob done\n":    PhaseDone,
		"ready\njob started\nnoise after\n": PhaseBusy,
		"job done\nready\n":                 PhaseReady, // the last telling line wins
	} {
		if got := LastPhase([]byte(out), m); got != want {
			t.Errorf("LastPhase(%q) = %s, want %s", out, got, want)
		}
	}
}
