package tooltest

import (
	"io"
	"log/slog"
	"strings"
	"testing"
)

// LogWriter is an io.Writer that logs each write to t without its trailing newline: a slog
// handler's lines, or a program's, in the test's log.
func LogWriter(t testing.TB) io.Writer { return testLog{t} }

type testLog struct{ t testing.TB }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// Logger is the logger a test gives the code it runs: lines at WARN and above, as text, to the
// test's log and to each of also, and a record that repeats a key fails the test (UniqueKeys).
func Logger(t testing.TB, also ...io.Writer) *slog.Logger {
	w := io.MultiWriter(append([]io.Writer{LogWriter(t)}, also...)...)
	return slog.New(UniqueKeys(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}), t.Errorf))
}
