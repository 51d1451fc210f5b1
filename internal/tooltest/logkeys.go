package tooltest

import (
	"context"
	"log/slog"
	"maps"
)

// UniqueKeys wraps h in a handler that reports through errorf every log record with two
// attributes of one key in one group, counting those its logger was given with With: a line
// such as writer=a writer=b says two things under one name, and a reader (or a log pipeline that
// keeps the last) sees only one of them. It checks records of every level and passes on to h
// those h is enabled for.
func UniqueKeys(h slog.Handler, errorf func(format string, args ...any)) slog.Handler {
	return &uniqueKeys{h: h, errorf: errorf, keys: map[string]bool{}}
}

type uniqueKeys struct {
	h      slog.Handler
	errorf func(format string, args ...any)
	keys   map[string]bool // keys of the current group given with With
}

func (u *uniqueKeys) Enabled(context.Context, slog.Level) bool { return true }

func (u *uniqueKeys) Handle(ctx context.Context, r slog.Record) error {
	keys := maps.Clone(u.keys)
	r.Attrs(func(a slog.Attr) bool {
		u.check(r.Message, keys, a)
		return true
	})
	if !u.h.Enabled(ctx, r.Level) {
		return nil
	}
	return u.h.Handle(ctx, r)
}

// check records a's key in keys, reporting it when it is there already, and checks the
// attributes of a group value in their own namespace. msg is the record's message, "" for
// attributes given with With.
func (u *uniqueKeys) check(msg string, keys map[string]bool, a slog.Attr) {
	v := a.Value.Resolve()
	if v.Kind() == slog.KindGroup {
		if a.Key == "" { // an inline group: its attributes are the enclosing group's
			for _, g := range v.Group() {
				u.check(msg, keys, g)
			}
			return
		}
		inner := map[string]bool{}
		for _, g := range v.Group() {
			u.check(msg, inner, g)
		}
	}
	if a.Key == "" {
		return
	}
	switch {
	case keys[a.Key] && msg == "":
		u.errorf("a logger is given the key %q twice (With)", a.Key)
	case keys[a.Key]:
		u.errorf("log line %q has the key %q twice", msg, a.Key)
	}
	keys[a.Key] = true
}

func (u *uniqueKeys) WithAttrs(as []slog.Attr) slog.Handler {
	keys := maps.Clone(u.keys)
	for _, a := range as {
		u.check("", keys, a)
	}
	return &uniqueKeys{h: u.h.WithAttrs(as), errorf: u.errorf, keys: keys}
}

func (u *uniqueKeys) WithGroup(name string) slog.Handler {
	if name == "" {
		return u
	}
	return &uniqueKeys{h: u.h.WithGroup(name), errorf: u.errorf, keys: map[string]bool{}}
}
