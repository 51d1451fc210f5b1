package stream

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// logLines is a slog.Handler that keeps every line (and, when t is set, logs it to the test).
type logLines struct {
	t     testing.TB
	mu    *sync.Mutex
	lines *[]slog.Record
	attrs []slog.Attr
}

func newLogLines(t testing.TB) (*slog.Logger, logLines) {
	h := logLines{t: t, mu: new(sync.Mutex), lines: new([]slog.Record)}
	return slog.New(h), h
}

func (h logLines) Enabled(context.Context, slog.Level) bool { return true }

func (h logLines) Handle(_ context.Context, r slog.Record) error {
	r = r.Clone()
	r.AddAttrs(h.attrs...) // those of log.With(...), so that a check on attributes sees them
	h.mu.Lock()
	*h.lines = append(*h.lines, r)
	h.mu.Unlock()
	if h.t != nil && r.Level >= slog.LevelInfo {
		var sb strings.Builder
		r.Attrs(func(a slog.Attr) bool { sb.WriteString(" " + a.String()); return true })
		h.t.Logf("%s %s%s", r.Level, r.Message, sb.String())
	}
	return nil
}

func (h logLines) WithAttrs(as []slog.Attr) slog.Handler {
	h.attrs = append(append([]slog.Attr(nil), h.attrs...), as...)
	return h
}

func (h logLines) WithGroup(string) slog.Handler { return h }

// count returns the number of lines at level whose message contains substr ("" matches all).
func (h logLines) count(level slog.Level, substr string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range *h.lines {
		if r.Level == level && strings.Contains(r.Message, substr) {
			n++
		}
	}
	return n
}

// atLeast returns the number of lines at level or above.
func (h logLines) atLeast(level slog.Level) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range *h.lines {
		if r.Level >= level {
			n++
		}
	}
	return n
}

// attr returns the value of key in the first line at level containing substr.
func (h logLines) attr(level slog.Level, substr, key string) (slog.Value, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range *h.lines {
		if r.Level != level || !strings.Contains(r.Message, substr) {
			continue
		}
		var v slog.Value
		found := false
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == key {
				v, found = a.Value, true
				return false
			}
			return true
		})
		return v, found
	}
	return slog.Value{}, false
}
