package tooltest

import (
	"bytes"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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

func TestOutputLogged(t *testing.T) {
	var o Output
	for _, line := range []string{
		`ts=2026-11-24T23:41:51.976Z caller=web.go:503 level=info component=web msg="Start listening for connections" address=127.0.0.1:0`,
		`ts=2026-11-24T23:41:51.977Z caller=tls_config.go:232 level=info component=web msg="Listening on" address=127.0.0.1:42667`,
		`time=2026-11-24T23:42:00.000Z level=INFO msg="embedded Kafka-protocol broker started" addrs=[127.0.0.1:40111]`,
		`time=2026-11-24T23:42:00.001Z level=INFO msg="HTTP API listening" addr=127.0.0.1:38123`,
		`{"time":"2026-11-24T23:42:00.002Z","level":"INFO","msg":"HTTP API listening","addr":"127.0.0.1:38999"}`,
		`{"time":"2026-11-24T23:42:00.003Z","level":"INFO","msg":"JSON broker","addrs":["127.0.0.1:40222","127.0.0.1:40223"]}`,
		`{"msg":"JSON broker"`, // cut short: skipped
	} {
		o.Write([]byte(line + "\n"))
	}
	for _, c := range []struct{ msg, key, want string }{
		{"Listening on", "address", "127.0.0.1:42667"},
		{"embedded Kafka-protocol broker started", "addrs", "127.0.0.1:40111"},
		{"HTTP API listening", "addr", "127.0.0.1:38123"},
		{"HTTP API listening", "port", ""},
		{"Listening", "address", ""}, // a whole message, not a prefix
		{"not logged", "addr", ""},
		{"JSON broker", "addrs", "127.0.0.1:40222"},
		{"JSON broker", "addr", ""},
	} {
		if got := o.Logged(c.msg, c.key); got != c.want {
			t.Errorf("Logged(%q, %q) = %q, want %q", c.msg, c.key, got, c.want)
		}
	}
	// A line still being written is not read: its port may be cut short.
	var p Output
	p.Write([]byte(`level=INFO msg="HTTP API listening" addr=127.0.0.1:38`))
	if got := p.Logged("HTTP API listening", "addr"); got != "" {
		t.Errorf("Logged on a line without its newline = %q, want \"\"", got)
	}
	p.Write([]byte("123\n"))
	if got := p.Logged("HTTP API listening", "addr"); got != "127.0.0.1:38123" {
		t.Errorf("Logged once the line is complete = %q, want 127.0.0.1:38123", got)
	}
}

func TestUniqueKeysReportsADuplicate(t *testing.T) {
	for _, tc := range []struct {
		name string
		log  func(l *slog.Logger)
		want int
		// quiet: the line is below the wrapped handler's level and must not reach it
		quiet bool
	}{
		{"distinct", func(l *slog.Logger) { l.Info("m", "a", 1, "b", 2) }, 0, false},
		{"twice in a record", func(l *slog.Logger) { l.Info("m", "a", 1, "a", 2) }, 1, false},
		{"in With and the record", func(l *slog.Logger) { l.With("a", 1).Debug("m", "a", 2) }, 1, true},
		{"twice in With", func(l *slog.Logger) { l.With("a", 1).With("a", 2).Info("m") }, 1, false},
		{"in another group", func(l *slog.Logger) { l.With("a", 1).WithGroup("g").Info("m", "a", 2) }, 0, false},
		{"in a group value", func(l *slog.Logger) { l.Info("m", "a", 1, slog.Group("g", "a", 2, "b", 3)) }, 0, false},
		{"twice in a group value", func(l *slog.Logger) { l.Info("m", slog.Group("g", "b", 2, "b", 3)) }, 1, false},
		{"an inline group", func(l *slog.Logger) { l.Info("m", "a", 1, slog.Group("", "a", 2)) }, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			var out bytes.Buffer
			h := UniqueKeys(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelInfo}), func(f string, a ...any) {
				got = append(got, fmt.Sprintf(f, a...))
			})
			tc.log(slog.New(h))
			if len(got) != tc.want {
				t.Errorf("reports %q, want %d", got, tc.want)
			}
			if passed := out.Len() != 0; passed == tc.quiet {
				t.Errorf("passed on to the wrapped handler: %v, want %v (%q)", passed, !tc.quiet, out.String())
			}
		})
	}
}

// CPU reads this process's CPU time: it grows while the process works, and a process that is
// gone is an error.
func TestCPUGrowsWithWork(t *testing.T) {
	before, err := CPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Work until the kernel has counted a tick more (on a busy core that takes longer).
	for start := time.Now(); ; {
		after, err := CPU(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if after > before {
			break
		}
		if time.Since(start) > time.Minute {
			t.Fatalf("CPU time still %v after a minute of work", after)
		}
		for x := 0; x < 1e6; x++ {
			_ = x * x
		}
	}
	if _, err := CPU(1 << 30); err == nil {
		t.Fatal("the CPU time of a process that does not exist")
	}
}

// RepoRoot, from this package's directory, is two levels up: the directory holding go.mod and
// internal/tooltest.
func TestRepoRoot(t *testing.T) {
	root := RepoRoot(t)
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Dir(filepath.Dir(wd)); root != want {
		t.Fatalf("RepoRoot = %s, want %s", root, want)
	}
}

// SelfCPU moves with this process's work: it grows while a loop spins (checked as it spins, for
// at most 30 s of wall time, which on a starved core may hold little CPU time).
func TestSelfCPUCountsThisProcess(t *testing.T) {
	before, ok := SelfCPU()
	if !ok {
		t.Skip("getrusage gives no CPU time here")
	}
	x := 0.0
	for start := time.Now(); time.Since(start) < 30*time.Second; {
		for range 100000 {
			x += math.Sqrt(x + 1)
		}
		if after, _ := SelfCPU(); after > before {
			return
		}
	}
	t.Errorf("SelfCPU stayed at %v while a loop spun for 30 s (x = %v)", before, x)
}
