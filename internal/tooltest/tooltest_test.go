package tooltest

import (
	"strings"
	"testing"
)

// recorder is a testing.TB that records how the test would have ended.
type recorder struct {
	testing.TB
	ended string // "fatal" or "skip"
	msg   string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.ended, r.msg = "fatal", format
	panic(r)
}
func (r *recorder) Skipf(format string, args ...any) {
	r.ended, r.msg = "skip", format
	panic(r)
}

func run(t *testing.T, f func(r *recorder)) *recorder {
	r := &recorder{TB: t}
	func() {
		defer func() {
			if v := recover(); v != nil && v != r {
				panic(v)
			}
		}()
		f(r)
	}()
	return r
}

func TestMissingToolSkipsOrFails(t *testing.T) {
	t.Setenv(RequireEnv, "")
	if r := run(t, func(r *recorder) { Command(r, "apt-get install nothing", "no-such-tool-cfguard") }); r.ended != "skip" {
		t.Fatalf("without %s: ended %q, want skip", RequireEnv, r.ended)
	}
	t.Setenv(RequireEnv, "1")
	if r := run(t, func(r *recorder) { Command(r, "apt-get install nothing", "no-such-tool-cfguard") }); r.ended != "fatal" || !strings.Contains(r.msg, "%s=1") {
		t.Fatalf("with %s=1: ended %q (%q), want fatal", RequireEnv, r.ended, r.msg)
	}
}

func TestCommandFindsATool(t *testing.T) {
	if p := Command(t, "coreutils", "no-such-tool-cfguard", "sh"); !strings.HasSuffix(p, "/sh") {
		t.Fatalf("found %q, want the path of sh", p)
	}
}
