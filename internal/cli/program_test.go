package cli

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"testing"
)

func TestProgramExitCodes(t *testing.T) {
	errBadConfig := errors.New("bad config")
	p := Program{Name: "prog", Intro: "prog does things.", Outro: "See the README.",
		IsUsage: func(err error) bool { return errors.Is(err, errBadConfig) },
		Commands: []Command{
			{Name: "ok", Help: "succeeds", Run: func(context.Context, []string, io.Writer, io.Writer) error { return nil }},
			{Name: "help", Run: func(context.Context, []string, io.Writer, io.Writer) error { return flag.ErrHelp }},
			{Name: "flags", Run: func(context.Context, []string, io.Writer, io.Writer) error { return fmt.Errorf("%w: --x", ErrUsage) }},
			{Name: "config", Run: func(context.Context, []string, io.Writer, io.Writer) error { return errBadConfig }},
			{Name: "fail", Run: func(context.Context, []string, io.Writer, io.Writer) error { return errors.New("boom") }},
		}}
	for _, tc := range []struct {
		args   []string
		code   int
		stderr string
	}{
		{nil, ExitUsage, ""},
		{[]string{"--help"}, ExitOK, ""},
		{[]string{"ok"}, ExitOK, ""},
		{[]string{"help"}, ExitOK, ""}, // "help" is the usage, before any command of that name
		{[]string{"flags"}, ExitUsage, "prog flags: usage: --x"},
		{[]string{"config"}, ExitUsage, "prog config: bad config"},
		{[]string{"fail"}, ExitError, "prog fail: boom"},
		{[]string{"nosuch"}, ExitUsage, `prog: unknown command "nosuch"`},
	} {
		var out, errs bytes.Buffer
		if code := p.Run(context.Background(), tc.args, &out, &errs); code != tc.code || !strings.Contains(errs.String(), tc.stderr) {
			t.Errorf("%v: exit %d, stderr %q; want %d, %q", tc.args, code, errs.String(), tc.code, tc.stderr)
		}
	}
	// help CMD runs CMD --help; help of an unknown command is an unknown command.
	var got []string
	p.Commands = append(p.Commands, Command{Name: "flagged", Run: func(_ context.Context, args []string, _, stderr io.Writer) error {
		got = args
		fmt.Fprintln(stderr, "Usage of flagged:")
		return flag.ErrHelp
	}})
	var hout, herrs bytes.Buffer
	if code := p.Run(context.Background(), []string{"help", "flagged"}, &hout, &herrs); code != ExitOK || len(got) != 1 || got[0] != "--help" ||
		herrs.String() != "Usage of flagged:\n" || strings.Contains(hout.String(), "prog does things.") {
		t.Errorf("help flagged: exit %d, args %q, stdout %q, stderr %q; want flagged run with --help alone", code, got, hout.String(), herrs.String())
	}
	herrs.Reset()
	if code := p.Run(context.Background(), []string{"help", "nosuch"}, &hout, &herrs); code != ExitUsage || !strings.Contains(herrs.String(), `prog: unknown command "nosuch"`) {
		t.Errorf("help nosuch: exit %d, stderr %q", code, herrs.String())
	}
	var out bytes.Buffer
	p.Usage(&out)
	if !strings.Contains(out.String(), "prog does things.") || !strings.Contains(out.String(), "  prog ok \n      succeeds") || !strings.Contains(out.String(), "See the README.") {
		t.Errorf("usage:\n%s", out.String())
	}
}

type ctxKey struct{}

// Run hands the command its context, the arguments after its name and the program's stdout and
// stderr; -h and --help print the usage on stdout, an unknown command prints it on stderr; a
// command's flag.ErrHelp exits ExitOK; a program without IsUsage exits ExitError on other errors.
func TestProgramRunsTheCommand(t *testing.T) {
	var gotArgs []string
	var gotCtx any
	p := Program{Name: "prog", Intro: "prog does things.", Outro: "See the README.",
		Commands: []Command{
			{Name: "echo", Run: func(ctx context.Context, args []string, stdout, stderr io.Writer) error {
				gotArgs, gotCtx = args, ctx.Value(ctxKey{})
				io.WriteString(stdout, "to stdout")
				io.WriteString(stderr, "to stderr")
				return nil
			}},
			{Name: "h", Run: func(context.Context, []string, io.Writer, io.Writer) error {
				return fmt.Errorf("parsing: %w", flag.ErrHelp)
			}},
			{Name: "fail", Run: func(context.Context, []string, io.Writer, io.Writer) error { return errors.New("boom") }},
		}}
	ctx := context.WithValue(context.Background(), ctxKey{}, "mine")
	var out, errs bytes.Buffer
	if code := p.Run(ctx, []string{"echo", "a", "-b"}, &out, &errs); code != ExitOK || out.String() != "to stdout" || errs.String() != "to stderr" {
		t.Errorf("echo: exit %d, stdout %q, stderr %q", code, out.String(), errs.String())
	}
	if strings.Join(gotArgs, " ") != "a -b" || gotCtx != "mine" {
		t.Errorf("echo got args %q and context value %v, want [a -b] and mine", gotArgs, gotCtx)
	}
	for _, tc := range []struct {
		args           []string
		code           int
		stdout, stderr string // contained
	}{
		{[]string{"-h"}, ExitOK, "prog does things.", ""},
		{[]string{"--help"}, ExitOK, "prog does things.", ""},
		{[]string{"h"}, ExitOK, "", ""},
		{[]string{"fail"}, ExitError, "", "prog fail: boom"},
		{[]string{"nosuch"}, ExitUsage, "", "prog does things."},
	} {
		var out, errs bytes.Buffer
		code := p.Run(context.Background(), tc.args, &out, &errs)
		if code != tc.code || !strings.Contains(out.String(), tc.stdout) || !strings.Contains(errs.String(), tc.stderr) {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want %d, %q in stdout, %q in stderr", tc.args, code, out.String(), errs.String(), tc.code, tc.stdout, tc.stderr)
		}
	}
}
