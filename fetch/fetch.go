// Package fetch installs a pinned release of a program that a host lacks:
// a forge's runner agent for `runfleet runner`, which, like CML, needs
// nothing installed beforehand. A release is named by its version and the
// SHA-256 of each platform's file, as the forge publishes them; what is
// fetched is checked against that before anything of it is unpacked, and
// kept in a cache keyed by name, version and platform.
//
// Hand-written: no Go library fetches, verifies and unpacks a release
// archive this way; the standard library does each step.
package fetch

import (
	"archive/tar"
	"bytes"
	"cmp"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/runfleet/runfleet/version"
)

// Release is one pinned release of a program.
type Release struct {
	// Name is the program's ("actions-runner"), for the cache and errors.
	Name    string
	Version string
	// File is the release's file for a platform, with {version} and
	// {arch} (the release's own spelling of it, Arch).
	File string
	// Arch spells Go's GOARCH as the release does ("amd64": "x64"); a
	// platform missing from it has no file.
	Arch map[string]string
	// URL is where the forge publishes the files, with {version}.
	URL string
	// SHA256 is each platform's file's SHA-256, by GOARCH, as the
	// forge publishes it with the release.
	SHA256 map[string]string
	// Sums, where the forge publishes a checksum list beside its files
	// and runfleet pins no SHA-256 for a platform, is that list's path
	// relative to URL, with {file} ("release.sha256", "{file}.sha256"):
	// lines as sha256sum prints them. It is read from the same place as
	// the file, the mirror included, before the file is fetched.
	Sums string
	// Program is the file to run in a tarball ("run.sh"); "" when the
	// file is the program itself.
	Program string
}

// Options say where a release comes from and goes.
type Options struct {
	// Cache is the directory releases are kept in.
	Cache string
	// Mirror, when set, is fetched from instead of the release's URL: a
	// mirror holding the same files (an air-gapped site's).
	Mirror string
	// SHA256, when set, is the file's checksum instead of the pinned one:
	// for a mirror that serves a build of the site's own.
	SHA256 string
	// Arch is the platform's GOARCH (this host's when empty).
	Arch string
	// Client makes the request (one with a 10-minute timeout when nil).
	Client *http.Client
}

// ErrChecksum is the error of a file whose SHA-256 is not the release's.
var ErrChecksum = errors.New("checksum mismatch")

// DefaultCache is runfleet's cache of releases: $XDG_CACHE_HOME/runfleet
// (~/.cache/runfleet), releases/ in it.
func DefaultCache() string {
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	return filepath.Join(base, "runfleet", "releases")
}

// URLFor returns the file's URL for a platform, from the mirror when
// there is one.
func (r Release) URLFor(arch, mirror string) (string, error) {
	if _, ok := r.Arch[arch]; !ok {
		return "", fmt.Errorf("%s %s has no release for linux/%s", r.Name, r.Version, arch)
	}
	file := r.file(arch)
	base := strings.ReplaceAll(r.URL, "{version}", r.Version)
	if mirror != "" {
		base = mirror
	}
	return strings.TrimRight(base, "/") + "/" + file, nil
}

// Get returns the path of the release's program on this host: from the
// cache, or fetched, checked and unpacked into it first.
func (r Release) Get(ctx context.Context, o Options) (string, error) {
	arch := o.Arch
	if arch == "" {
		arch = runtime.GOARCH
	}
	url, err := r.URLFor(arch, o.Mirror)
	if err != nil {
		return "", err
	}
	want, err := r.Checksum(ctx, arch, o)
	if err != nil {
		return "", err
	}
	// Keyed by the checksum too: a mirror's own build is not the forge's.
	dir := filepath.Join(o.Cache, r.Name, r.Version+"-linux-"+arch+"-"+strings.ToLower(want)[:12])
	program := filepath.Join(dir, filepath.FromSlash(r.program()))
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err == nil {
		return program, nil
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", fmt.Errorf("%s: %w", r.Name, err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".fetch-")
	if err != nil {
		return "", fmt.Errorf("%s: %w", r.Name, err)
	}
	defer os.RemoveAll(tmp)
	file := filepath.Join(tmp, path.Base(url))
	if err := download(ctx, o.Client, url, file, want); err != nil {
		return "", fmt.Errorf("%s %s: %w", r.Name, r.Version, err)
	}
	unpacked := filepath.Join(tmp, "release")
	if err := r.unpack(file, unpacked); err != nil {
		return "", fmt.Errorf("%s %s: unpack %s: %w", r.Name, r.Version, url, err)
	}
	if _, err := os.Stat(filepath.Join(unpacked, filepath.FromSlash(r.program()))); err != nil {
		return "", fmt.Errorf("%s %s: %s holds no %s", r.Name, r.Version, url, r.program())
	}
	if err := os.WriteFile(filepath.Join(unpacked, ".complete"), []byte(url+"\n"), 0o644); err != nil {
		return "", err
	}
	// Another run may have made it meanwhile: theirs is as good.
	if err := os.Rename(unpacked, dir); err != nil {
		if _, serr := os.Stat(filepath.Join(dir, ".complete")); serr != nil {
			return "", fmt.Errorf("%s: %w", r.Name, err)
		}
	}
	return program, nil
}

// Checksum returns the SHA-256 the platform's file must have: the one
// given in o, else the one runfleet pins, else the one the release's
// checksum list (Sums) gives for the file.
func (r Release) Checksum(ctx context.Context, arch string, o Options) (string, error) {
	url, err := r.URLFor(arch, o.Mirror)
	if err != nil {
		return "", err
	}
	want := cmp.Or(o.SHA256, r.SHA256[arch])
	if want == "" && r.Sums != "" {
		if want, err = r.listed(ctx, arch, o); err != nil {
			return "", fmt.Errorf("%s %s: %w", r.Name, r.Version, err)
		}
	}
	if want == "" {
		return "", fmt.Errorf("%s %s: no SHA-256 is pinned for linux/%s; give the checksum of the file at %s", r.Name, r.Version, arch, url)
	}
	if b, err := hex.DecodeString(want); err != nil || len(b) != sha256.Size {
		return "", fmt.Errorf("%s: %q is not a SHA-256 (64 hexadecimal digits)", r.Name, want)
	}
	return strings.ToLower(want), nil
}

// listed reads the platform's file's SHA-256 from the release's checksum
// list: a line "<sha256>  <file>" (or " *<file>", or the file's path
// under the list's directory), or a list of one file holding the digest
// alone.
func (r Release) listed(ctx context.Context, arch string, o Options) (string, error) {
	file := r.file(arch)
	base := cmp.Or(o.Mirror, strings.ReplaceAll(r.URL, "{version}", r.Version))
	url := strings.TrimRight(base, "/") + "/" + strings.ReplaceAll(r.Sums, "{file}", file)
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var list bytes.Buffer
	if err := get(ctx, o.Client, url, &list, 1<<20); err != nil {
		return "", fmt.Errorf("the release's checksums: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(list.String()), "\n")
	if f := strings.Fields(lines[0]); len(lines) == 1 && len(f) == 1 && strings.Contains(r.Sums, "{file}") {
		return f[0], nil
	}
	// The file's own path first, then its name alone (a list written
	// from inside the files' directory).
	for _, same := range []func(string) bool{
		func(name string) bool { return name == file },
		func(name string) bool { return path.Base(name) == path.Base(file) },
	} {
		for _, line := range lines {
			if f := strings.Fields(line); len(f) == 2 && same(strings.TrimPrefix(strings.TrimPrefix(f[1], "*"), "./")) {
				return f[0], nil
			}
		}
	}
	return "", fmt.Errorf("the release's checksums (%s) list no %s", url, file)
}

// file is the release's file for a platform, as the forge names it.
func (r Release) file(arch string) string {
	return strings.NewReplacer("{version}", r.Version, "{arch}", r.Arch[arch]).Replace(r.File)
}

// Archive reports whether the release's file is a tarball to unpack,
// rather than the program itself.
func (r Release) Archive() bool {
	return strings.HasSuffix(r.File, ".tar.gz") || strings.HasSuffix(r.File, ".tgz")
}

// program is the path of the program within the unpacked release.
func (r Release) program() string {
	if r.Program != "" {
		return r.Program
	}
	return r.Name
}

// download writes url's body to file, checking its SHA-256 as it goes;
// a body that does not match is removed and reported.
func download(ctx context.Context, client *http.Client, url, file, want string) error {
	f, err := os.OpenFile(file, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	h := sha256.New()
	err = get(ctx, client, url, io.MultiWriter(f, h), -1)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if got := hex.EncodeToString(h.Sum(nil)); !strings.EqualFold(got, want) {
		os.Remove(file)
		return fmt.Errorf("%w: the SHA-256 of %s is %s, the release's is %s: not installed", ErrChecksum, url, got, want)
	}
	return nil
}

// get copies url's body to w, at most limit bytes of it when limit >= 0.
func get(ctx context.Context, client *http.Client, url string, w io.Writer, limit int64) error {
	if client == nil {
		client = &http.Client{Timeout: 10 * time.Minute}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("User-Agent", version.UserAgent())
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("fetch %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch %s: %s", url, resp.Status)
	}
	var body io.Reader = resp.Body
	if limit >= 0 {
		body = io.LimitReader(resp.Body, limit)
	}
	if _, err := io.Copy(w, body); err != nil {
		return fmt.Errorf("fetch %s: %w", url, err)
	}
	return nil
}

// unpack puts the release's program, or the tarball's files, in dir.
func (r Release) unpack(file, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if !r.Archive() {
		// A single binary.
		dst := filepath.Join(dir, r.program())
		if err := os.Rename(file, dst); err != nil {
			return err
		}
		return os.Chmod(dst, 0o755)
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		return err
	}
	tr := tar.NewReader(gz)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := extract(tr, h, dir); err != nil {
			return err
		}
	}
}

// extract writes one tar entry under dir; an entry that would land
// outside it, or a link out of it, is refused.
func extract(tr *tar.Reader, h *tar.Header, dir string) error {
	name := filepath.Clean(filepath.FromSlash(h.Name))
	if !filepath.IsLocal(name) {
		return fmt.Errorf("entry %q is outside the release", h.Name)
	}
	dst := filepath.Join(dir, name)
	switch h.Typeflag {
	case tar.TypeDir:
		return os.MkdirAll(dst, 0o755)
	case tar.TypeSymlink:
		if target := filepath.Join(filepath.Dir(name), h.Linkname); filepath.IsAbs(h.Linkname) || !filepath.IsLocal(target) {
			return fmt.Errorf("link %q points outside the release", h.Name)
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		return os.Symlink(h.Linkname, dst)
	case tar.TypeReg:
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&0o755|0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, tr)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		return err
	}
	return nil // hard links, devices: a runner release holds none
}
