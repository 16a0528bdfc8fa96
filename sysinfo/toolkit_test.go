package sysinfo

import (
	"os"
	"path/filepath"
	"testing"
)

// The toolkit's version as each of its commands prints it.
func TestNvidiaToolkit(t *testing.T) {
	for _, c := range []struct{ out, want string }{
		{"NVIDIA Container Toolkit CLI version 1.17.4\ncommit: 9b69590c7428470a72f2ae05f826412976af1395\n", "1.17.4"},
		{"cli-version: 1.16.2\nlib-version: 1.16.2\nbuild date: 2024-09-24T20:23+00:00\n", "1.16.2"},
		{"nothing here\n", ""},
	} {
		m := toolkitVersion.FindStringSubmatch(c.out)
		got := ""
		if m != nil {
			got = m[1]
		}
		if got != c.want {
			t.Errorf("%q: %q, want %q", c.out, got, c.want)
		}
	}
	// Read from nvidia-ctk on the PATH, once.
	dir := t.TempDir()
	script := "#!/bin/sh\necho 'NVIDIA Container Toolkit CLI version 1.17.4'\necho 'commit: abc'\n"
	if err := os.WriteFile(filepath.Join(dir, "nvidia-ctk"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir)
	if v := NvidiaToolkit(t.Context()); v != "1.17.4" {
		t.Errorf("NvidiaToolkit: %q, want 1.17.4", v)
	}
}
