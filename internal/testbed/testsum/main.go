// Command testsum reads `go test -json` on stdin and writes what `go test`
// would have written, each package's output together once it ends, then a
// summary: the wall time of every package, the ten slowest tests and every
// skipped test, so that what each driver's tests cost is visible in CI. It
// exits 1 when a test or package failed. The JSON is test2json's (go doc
// cmd/test2json); gotestsum does more, but cannot be had here.
package main

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"
)

// event is one line of test2json's output.
type event struct {
	Action     string
	Package    string
	ImportPath string // the package, in build-output and build-fail events
	Test       string
	Elapsed    float64 // seconds
	Output     string
}

type result struct {
	pkg, test string
	elapsed   time.Duration
	action    string
}

func main() {
	failed, err := summarize(os.Stdin, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsum:", err)
		os.Exit(2)
	}
	if failed {
		os.Exit(1)
	}
}

// summarize copies each package's output to w when the package ends and
// then writes the summary; failed reports whether anything failed.
func summarize(r io.Reader, w io.Writer) (failed bool, err error) {
	start := time.Now()
	pending := map[string]*strings.Builder{}
	var pkgs, tests, skipped []result
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<26)
	for sc.Scan() {
		var e event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			// Not JSON (go vet's or the build's own words): pass it on.
			fmt.Fprintln(w, sc.Text())
			continue
		}
		if e.Package == "" {
			e.Package = e.ImportPath
		}
		buf := pending[e.Package]
		if buf == nil {
			buf = &strings.Builder{}
			pending[e.Package] = buf
		}
		switch e.Action {
		case "output", "build-output":
			buf.WriteString(e.Output)
		case "pass", "fail", "skip", "build-fail":
			res := result{e.Package, e.Test, time.Duration(e.Elapsed * float64(time.Second)), e.Action}
			if e.Action == "fail" || e.Action == "build-fail" {
				failed = true
			}
			switch {
			case e.Action == "build-fail":
				io.WriteString(w, buf.String())
				delete(pending, e.Package)
			case e.Test == "":
				io.WriteString(w, buf.String())
				delete(pending, e.Package)
				pkgs = append(pkgs, res)
			case e.Test != "" && e.Action == "skip":
				skipped = append(skipped, res)
			case e.Test != "" && !strings.Contains(e.Test, "/"):
				tests = append(tests, res)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return true, err
	}
	for pkg, buf := range pending { // a package cut off before its end
		fmt.Fprintf(w, "%s(%s ended without a result)\n", buf.String(), pkg)
		failed = true
	}
	report(w, time.Since(start), pkgs, tests, skipped)
	return failed, nil
}

func report(w io.Writer, wall time.Duration, pkgs, tests, skipped []result) {
	slowest := func(a, b result) int { return cmp.Compare(b.elapsed, a.elapsed) }
	slices.SortFunc(pkgs, slowest)
	slices.SortFunc(tests, slowest)
	var sum time.Duration
	for _, p := range pkgs {
		sum += p.elapsed
	}
	fmt.Fprintf(w, "\n== test summary: %s wall for %s of package time (%d packages)\n", wall.Round(time.Second), sum.Round(time.Second), len(pkgs))
	fmt.Fprintln(w, "wall time per package, slowest first:")
	for _, p := range pkgs {
		if p.elapsed < time.Second && p.action != "fail" { // no tests, or quick ones
			continue
		}
		fmt.Fprintf(w, "  %8s  %-4s  %s\n", p.elapsed.Round(100*time.Millisecond), p.action, p.pkg)
	}
	fmt.Fprintln(w, "ten slowest tests:")
	for _, t := range tests[:min(10, len(tests))] {
		fmt.Fprintf(w, "  %8s  %-4s  %s %s\n", t.elapsed.Round(100*time.Millisecond), t.action, short(t.pkg), t.test)
	}
	fmt.Fprintf(w, "skipped tests: %d\n", len(skipped))
	for _, t := range skipped {
		fmt.Fprintf(w, "  %s %s\n", short(t.pkg), t.test)
	}
}

// short drops the module path, which every package shares.
func short(pkg string) string {
	return strings.TrimPrefix(pkg, "github.com/runfleet/runfleet/")
}
