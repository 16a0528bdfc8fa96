package fetch

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// tarball makes a .tar.gz of the files given, by name.
func tarball(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	for name, body := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(body))
	}
	tw.Close()
	gz.Close()
	return buf.Bytes()
}

func sum(b []byte) string { h := sha256.Sum256(b); return hex.EncodeToString(h[:]) }

// server serves files by path and counts requests.
func server(t *testing.T, files map[string][]byte) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		b, ok := files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Write(b)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

// A tarball release is fetched once, checked, unpacked and kept: the
// second Get makes no request.
func TestGetTarball(t *testing.T) {
	tgz := tarball(t, map[string]string{"run.sh": "#!/bin/sh\necho runner\n", "bin/Runner.Listener": "x"})
	srv, n := server(t, map[string][]byte{"/v2.0.0/agent-linux-x64-2.0.0.tar.gz": tgz})
	r := Release{Name: "agent", Version: "2.0.0", File: "agent-linux-{arch}-{version}.tar.gz", Arch: map[string]string{"amd64": "x64"},
		URL: srv.URL + "/v{version}", SHA256: map[string]string{"amd64": sum(tgz)}, Program: "run.sh"}
	o := Options{Cache: t.TempDir(), Arch: "amd64"}
	p, err := r.Get(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(p); err != nil || !strings.Contains(string(b), "echo runner") || filepath.Base(p) != "run.sh" {
		t.Fatalf("program %s: %q %v", p, b, err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(p), "bin", "Runner.Listener")); err != nil {
		t.Error("the rest of the release is not beside the program")
	}
	if p2, err := r.Get(context.Background(), o); err != nil || p2 != p || n.Load() != 1 {
		t.Errorf("second Get: %s %v after %d requests, want the cached one after 1", p2, err, n.Load())
	}
}

// A file whose checksum is not the release's is refused, and nothing of
// it is kept; a mirror serves the same file; a platform the release
// lacks, or no checksum, is said.
func TestGetRefuses(t *testing.T) {
	bin := []byte("#!/bin/sh\necho gitlab-runner\n")
	srv, _ := server(t, map[string][]byte{"/v1/gitlab-runner-linux-amd64": []byte("tampered"), "/mirror/gitlab-runner-linux-amd64": bin})
	r := Release{Name: "gitlab-runner", Version: "1", File: "gitlab-runner-linux-{arch}", Arch: map[string]string{"amd64": "amd64"},
		URL: srv.URL + "/v{version}", SHA256: map[string]string{"amd64": sum(bin)}}
	cache := t.TempDir()
	_, err := r.Get(context.Background(), Options{Cache: cache, Arch: "amd64"})
	if !errors.Is(err, ErrChecksum) || !strings.Contains(err.Error(), "not installed") {
		t.Errorf("a tampered file: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(cache, "gitlab-runner", "*")); len(left) != 0 {
		t.Errorf("a refused file left %v", left)
	}
	p, err := r.Get(context.Background(), Options{Cache: cache, Arch: "amd64", Mirror: srv.URL + "/mirror"})
	if err != nil {
		t.Fatalf("from the mirror: %v", err)
	}
	if st, err := os.Stat(p); err != nil || st.Mode()&0o100 == 0 {
		t.Errorf("the binary %s is not executable: %v", p, err)
	}
	if _, err := r.Get(context.Background(), Options{Cache: cache, Arch: "riscv64"}); err == nil || !strings.Contains(err.Error(), "no release for linux/riscv64") {
		t.Errorf("a platform without a release: %v", err)
	}
	r.SHA256 = nil
	if _, err := r.Get(context.Background(), Options{Cache: cache, Arch: "amd64"}); err == nil || !strings.Contains(err.Error(), "no SHA-256 is pinned") {
		t.Errorf("no checksum: %v", err)
	}
}

// A tarball entry or link that would land outside the release is refused.
func TestGetRefusesEscapes(t *testing.T) {
	for name, tgz := range map[string][]byte{
		"entry": tarball(t, map[string]string{"../evil": "x", "run.sh": "x"}),
		"link": func() []byte {
			var buf bytes.Buffer
			gz := gzip.NewWriter(&buf)
			tw := tar.NewWriter(gz)
			tw.WriteHeader(&tar.Header{Name: "run.sh", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"})
			tw.Close()
			gz.Close()
			return buf.Bytes()
		}(),
	} {
		srv, _ := server(t, map[string][]byte{"/a.tar.gz": tgz})
		r := Release{Name: "a", Version: "1", File: "a.tar.gz", Arch: map[string]string{"amd64": "x"}, URL: srv.URL, SHA256: map[string]string{"amd64": sum(tgz)}, Program: "run.sh"}
		if _, err := r.Get(context.Background(), Options{Cache: t.TempDir(), Arch: "amd64"}); err == nil || !strings.Contains(err.Error(), "outside the release") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// Where runfleet pins no checksum, the release's own checksum list is
// read first, in the two layouts forges publish: one list for the whole
// release with paths under it (gitlab-runner's release.sha256, read with
// `sha256sum -c`), and a list per file (gitea-runner's <file>.sha256,
// from its Makefile's release-check). A file that the list does not
// match, or that the list does not name, is not installed.
func TestGetChecksumList(t *testing.T) {
	bin := []byte("#!/bin/sh\necho agent\n")
	for _, tc := range []struct {
		name  string
		r     Release
		files map[string][]byte
		want  string
	}{
		{"gitlab", Release{Name: "gitlab-runner", Version: "18.6.0", URL: "{url}/v{version}", File: "binaries/gitlab-runner-linux-{arch}", Sums: "release.sha256", Program: "gitlab-runner"},
			map[string][]byte{"/v18.6.0/binaries/gitlab-runner-linux-amd64": bin,
				"/v18.6.0/release.sha256": []byte(sum([]byte("other")) + " *binaries/gitlab-runner-linux-arm64\n" +
					sum([]byte("another")) + " *deb/gitlab-runner-linux-amd64\n" + sum(bin) + " *binaries/gitlab-runner-linux-amd64\n")}, ""},
		{"gitea", Release{Name: "gitea-runner", Version: "1.0.8", URL: "{url}/{version}", File: "gitea-runner-{version}-linux-{arch}", Sums: "{file}.sha256", Program: "gitea-runner"},
			map[string][]byte{"/1.0.8/gitea-runner-1.0.8-linux-amd64": bin,
				"/1.0.8/gitea-runner-1.0.8-linux-amd64.sha256": []byte(sum(bin) + "  gitea-runner-1.0.8-linux-amd64\n")}, ""},
		{"tampered", Release{Name: "gitea-runner", Version: "1.0.8", URL: "{url}/{version}", File: "gitea-runner-{version}-linux-{arch}", Sums: "{file}.sha256", Program: "gitea-runner"},
			map[string][]byte{"/1.0.8/gitea-runner-1.0.8-linux-amd64": append([]byte("evil"), bin...),
				"/1.0.8/gitea-runner-1.0.8-linux-amd64.sha256": []byte(sum(bin) + "  gitea-runner-1.0.8-linux-amd64\n")}, "checksum mismatch"},
		{"unlisted", Release{Name: "gitlab-runner", Version: "18.6.0", URL: "{url}/v{version}", File: "binaries/gitlab-runner-linux-{arch}", Sums: "release.sha256", Program: "gitlab-runner"},
			map[string][]byte{"/v18.6.0/binaries/gitlab-runner-linux-amd64": bin,
				"/v18.6.0/release.sha256": []byte(sum(bin) + " *binaries/gitlab-runner-linux-arm64\n")}, "list no binaries/gitlab-runner-linux-amd64"},
		{"no list", Release{Name: "gitlab-runner", Version: "18.6.0", URL: "{url}/v{version}", File: "binaries/gitlab-runner-linux-{arch}", Sums: "release.sha256", Program: "gitlab-runner"},
			map[string][]byte{"/v18.6.0/binaries/gitlab-runner-linux-amd64": bin}, "404 Not Found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := server(t, tc.files)
			r := tc.r
			r.URL = strings.ReplaceAll(r.URL, "{url}", srv.URL)
			r.Arch = map[string]string{"amd64": "amd64", "arm64": "arm64"}
			p, err := r.Get(context.Background(), Options{Cache: t.TempDir(), Arch: "amd64"})
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("err = %v, want %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if b, _ := os.ReadFile(p); !bytes.Equal(b, bin) || filepath.Base(p) != r.Program {
				t.Errorf("%s holds %q", p, b)
			}
		})
	}
}
