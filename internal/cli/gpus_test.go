package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// smi writes a stand-in nvidia-smi that prints out.
func smi(t *testing.T, out string) string {
	t.Helper()
	dir := t.TempDir()
	data := filepath.Join(dir, "out.xml")
	if err := os.WriteFile(data, []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "nvidia-smi")
	if err := os.WriteFile(path, []byte("#!/bin/sh\ncat "+data+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// `runfleet gpus` tells a host without GPUs (exit 0) from output it cannot
// read (exit 1, and an error field in -o json), and an empty output says
// so.
func TestGPUsUnreadableIsAnError(t *testing.T) {
	noGPU, err := os.ReadFile("../../gpu/testdata/nogpu-v12.xml")
	if err != nil {
		t.Fatal(err)
	}
	full, err := os.ReadFile("../../gpu/testdata/h100x4-v12.xml")
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, out string
		code      int
		field     string
	}{
		{"no GPU", string(noGPU), 0, ""},
		{"truncated", string(full[:len(full)/2]), 1, "XML syntax error"},
		{"empty", "", 1, "printed nothing"},
	} {
		var out, errOut bytes.Buffer
		code := Main([]string{"gpus", "-o", "json", "--nvidia-smi", smi(t, tt.out)}, &out, &errOut)
		var rep struct {
			Error  string `json:"error"`
			Reason string `json:"reason"`
		}
		if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
			t.Fatalf("%s: %v\n%s", tt.name, err, out.String())
		}
		if code != tt.code || (tt.field == "") != (rep.Error == "") || !strings.Contains(rep.Error, tt.field) {
			t.Errorf("%s: exit %d, error %q (stderr %s); want exit %d and an error with %q", tt.name, code, rep.Error, errOut.String(), tt.code, tt.field)
		}
	}
}

// A driver that is there and fails, or an nvidia-smi named that is not
// there, exits 1 saying which; before, both read as a host without GPUs.
func TestGPUsFailingDriverIsAnError(t *testing.T) {
	failing := filepath.Join(t.TempDir(), "nvidia-smi")
	script := "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\nexit 9\n"
	if err := os.WriteFile(failing, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		failing:              "couldn't communicate with the NVIDIA driver",
		"/nonexistent/nvsmi": "/nonexistent/nvsmi: no such program",
	} {
		var out bytes.Buffer
		if code := Main([]string{"gpus", "--nvidia-smi", path}, &out, &out); code != ExitFailure || !strings.Contains(out.String(), want) {
			t.Errorf("gpus --nvidia-smi %s: exit %d:\n%s", path, code, out.String())
		}
	}
}
