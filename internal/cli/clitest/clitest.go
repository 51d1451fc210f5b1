// Package clitest checks a command line (cli.Program) against what documents it: that its
// overview and a document's synopsis name every flag each command lists in its -h output.
package clitest

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/cli"
)

var (
	// flagLine is a flag in the output of a flag.FlagSet's PrintDefaults: two spaces, a dash,
	// the name.
	flagLine = regexp.MustCompile(`(?m)^  -(\S+)`)
	// comment begins a comment in a synopsis line: a # after a space or a tab.
	comment = regexp.MustCompile(`\s#`)
)

// Flags returns the flags command name of p lists when run with -h; it fails t when the output
// is not a flag set's usage.
func Flags(t testing.TB, p cli.Program, name string) []string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := p.Run(context.Background(), []string{name, "-h"}, &stdout, &stderr)
	help := stdout.String() + stderr.String()
	if code != 0 || !strings.Contains(help, "Usage of "+name) {
		t.Fatalf("%s %s -h: exit %d, not a usage:\n%s", p.Name, name, code, help)
	}
	var flags []string
	for _, m := range flagLine.FindAllStringSubmatch(help, -1) {
		flags = append(flags, m[1])
	}
	return flags
}

// Synopsis returns, for each command of the program named program, its synopsis in doc: in the
// document's fenced blocks, the first line that begins with the program's name and the
// command's, with the indented lines that follow it, without comments (from a # after a space
// or a tab). A later line for the same command (an example) is not its synopsis.
func Synopsis(doc []byte, program string) map[string]string {
	out := map[string]string{}
	parts := strings.Split(string(doc), "```")
	for i := 1; i < len(parts); i += 2 { // the odd parts are inside fences
		name := "" // the command whose synopsis the lines are, if any
		for _, line := range strings.Split(parts[i], "\n") {
			text := line
			if loc := comment.FindStringIndex(line); loc != nil {
				text = line[:loc[0]]
			}
			switch f := strings.Fields(text); {
			case len(f) > 1 && f[0] == program:
				name = ""
				if _, seen := out[f[1]]; !seen {
					name = f[1]
				}
			case name != "" && len(f) > 0 && (line[0] == ' ' || line[0] == '\t'):
			default:
				name = ""
			}
			if name != "" {
				out[name] += " " + text
			}
		}
	}
	return out
}

// CheckSynopsis reports through t every flag a command of p lists in its -h output that p's
// overview (the command's Args) or doc's synopsis of the command (Synopsis) does not name, as
// --flag followed by anything but a letter, a digit or a dash.
func CheckSynopsis(t testing.TB, p cli.Program, doc []byte, docName string) {
	t.Helper()
	synopsis := Synopsis(doc, p.Name)
	for _, c := range p.Commands {
		if synopsis[c.Name] == "" {
			t.Errorf("%s has no synopsis of %s %s", docName, p.Name, c.Name)
		}
		for _, f := range Flags(t, p, c.Name) {
			named := regexp.MustCompile(`--` + regexp.QuoteMeta(f) + `(?:[^a-z0-9-]|$)`)
			if !named.MatchString(c.Args) {
				t.Errorf("%s --help: %s %s lacks --%s", p.Name, c.Name, c.Args, f)
			}
			if !named.MatchString(synopsis[c.Name]) {
				t.Errorf("%s: the synopsis of %s %s lacks --%s", docName, p.Name, c.Name, f)
			}
		}
	}
}
