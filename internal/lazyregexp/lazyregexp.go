// Package lazyregexp is a regular expression compiled on first use, so
// that a package's patterns cost nothing when a program starts: a binary
// links every driver's config patterns, and most runs use a few. The Go
// command keeps its own for the same reason (cmd/go/internal/lazyregexp);
// the standard library exports none, hence this one.
package lazyregexp

import (
	"regexp"
	"sync"
)

// Regexp is a regexp.Regexp compiled the first time it is used. Its
// pattern is checked at build time by the tests of the packages that use
// it (New compiles at once under go test), as regexp.MustCompile's are.
type Regexp struct {
	str string
	rx  func() *regexp.Regexp
}

// New returns a pattern to be compiled on first use; it panics then if
// str does not compile, as regexp.MustCompile does.
func New(str string) *Regexp {
	r := &Regexp{str: str, rx: sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(str) })}
	if underTest() {
		r.rx()
	}
	return r
}

// Regexp returns the compiled expression.
func (r *Regexp) Regexp() *regexp.Regexp { return r.rx() }

func (r *Regexp) String() string                       { return r.str }
func (r *Regexp) MatchString(s string) bool            { return r.rx().MatchString(s) }
func (r *Regexp) FindString(s string) string           { return r.rx().FindString(s) }
func (r *Regexp) FindStringIndex(s string) []int       { return r.rx().FindStringIndex(s) }
func (r *Regexp) FindStringSubmatch(s string) []string { return r.rx().FindStringSubmatch(s) }
func (r *Regexp) FindAllString(s string, n int) []string {
	return r.rx().FindAllString(s, n)
}
func (r *Regexp) FindAllStringSubmatch(s string, n int) [][]string {
	return r.rx().FindAllStringSubmatch(s, n)
}
func (r *Regexp) ReplaceAllString(src, repl string) string {
	return r.rx().ReplaceAllString(src, repl)
}
func (r *Regexp) ReplaceAllStringFunc(src string, repl func(string) string) string {
	return r.rx().ReplaceAllStringFunc(src, repl)
}
func (r *Regexp) SubexpIndex(name string) int    { return r.rx().SubexpIndex(name) }
func (r *Regexp) FindSubmatch(b []byte) [][]byte { return r.rx().FindSubmatch(b) }
func (r *Regexp) FindAllStringSubmatchIndex(s string, n int) [][]int {
	return r.rx().FindAllStringSubmatchIndex(s, n)
}
