package main

import (
	"strings"
	"testing"
)

const run = `{"Action":"start","Package":"m/a"}
{"Action":"run","Package":"m/a","Test":"TestFast"}
{"Action":"output","Package":"m/a","Test":"TestFast","Output":"=== RUN   TestFast\n"}
{"Action":"start","Package":"m/b"}
{"Action":"output","Package":"m/b","Test":"TestSlow","Output":"b says hello\n"}
{"Action":"pass","Package":"m/a","Test":"TestFast","Elapsed":1.5}
{"Action":"skip","Package":"m/a","Test":"TestNeedsGPU","Elapsed":0}
{"Action":"output","Package":"m/a","Output":"ok  \tm/a\t1.6s\n"}
{"Action":"pass","Package":"m/a","Elapsed":1.6}
{"Action":"fail","Package":"m/b","Test":"TestSlow","Elapsed":90.2}
{"Action":"pass","Package":"m/b","Test":"TestSlow/sub","Elapsed":90.1}
{"Action":"fail","Package":"m/b","Elapsed":91}
`

// TestSummary: each package's output comes together, a failure is
// reported, and the summary ranks packages and top-level tests by time
// and lists what was skipped.
func TestSummary(t *testing.T) {
	var out strings.Builder
	failed, err := summarize(strings.NewReader(run), &out)
	if err != nil || !failed {
		t.Fatalf("summarize = %v, %v; want failed", failed, err)
	}
	got := out.String()
	t.Log(got)
	for _, want := range []string{
		"=== RUN   TestFast\nok  \tm/a\t1.6s\n",
		"1m31s  fail  m/b\n",
		"1.6s  pass  m/a\n",
		"1m30.2s  fail  m/b TestSlow\n",
		"1.5s  pass  m/a TestFast\n",
		"skipped tests: 1\n  m/a TestNeedsGPU\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("summary lacks %q", want)
		}
	}
	if strings.Index(got, "m/b TestSlow") > strings.Index(got, "m/a TestFast") {
		t.Error("the slower test is not ranked first")
	}
	if strings.Contains(got, "TestSlow/sub") {
		t.Error("a subtest is ranked with the top-level tests")
	}
}

// TestBuildFailure: a package that does not build fails the run and its
// compiler output is shown.
func TestBuildFailure(t *testing.T) {
	in := `{"ImportPath":"m/c","Action":"build-output","Output":"c.go:1: syntax error\n"}
{"ImportPath":"m/c","Action":"build-fail"}
{"Action":"fail","Package":"m/c","Elapsed":0,"FailedBuild":"m/c"}
`
	var out strings.Builder
	failed, err := summarize(strings.NewReader(in), &out)
	if err != nil || !failed || !strings.Contains(out.String(), "c.go:1: syntax error") {
		t.Fatalf("summarize = %v, %v:\n%s", failed, err, out.String())
	}
}
