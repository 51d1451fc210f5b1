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
	var out bytes.Buffer
	p.Usage(&out)
	if !strings.Contains(out.String(), "prog does things.") || !strings.Contains(out.String(), "  prog ok \n      succeeds") || !strings.Contains(out.String(), "See the README.") {
		t.Errorf("usage:\n%s", out.String())
	}
}
