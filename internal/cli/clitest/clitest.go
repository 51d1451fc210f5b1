// Package clitest checks a command line (cli.Program) against what documents it: that its
// overview and a document's synopsis name every flag each command lists in its -h output, name
// no flag or command it lacks, and show no default other than the flag's own.
package clitest

import (
	"bytes"
	"context"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/cli"
)

var (
	// flagLine is a flag in the output of a flag.FlagSet's PrintDefaults: two spaces, a dash,
	// the name.
	flagLine = regexp.MustCompile(`(?m)^  -(\S+)`)
	// comment begins a comment in a synopsis line: a # after a space or a tab.
	comment = regexp.MustCompile(`\s#`)
	// defaultRE is the default PrintDefaults appends to a flag's usage when it is not the zero
	// value: (default "text") for a string, (default 1m0s) for the others.
	defaultRE = regexp.MustCompile(`\(default ("(?:[^"\\]|\\.)*"|[^\s():]+)\)\s*$`)
	// namedFlag is a flag a synopsis names, with the value written after it, if any: "--name"
	// or "--name VALUE", the value up to a space or a bracket; a dash begins no value (a flag
	// after a flag is a flag).
	namedFlag = regexp.MustCompile(`--([a-z0-9][a-z0-9-]*)(?: ([^\s\[\]-][^\s\[\]]*))?`)
)

// Flags returns the flags command name of p lists when run with -h; it fails t when the output
// is not a flag set's usage.
func Flags(t testing.TB, p cli.Program, name string) []string {
	t.Helper()
	var flags []string
	for _, f := range flagDefaults(t, p, name) {
		flags = append(flags, f.name)
	}
	return flags
}

// flagDefault is a flag of a command's -h output and the default it prints ("" when it prints
// none: the zero value).
type flagDefault struct{ name, def string }

// flagDefaults returns the flags command name of p lists when run with -h, in order, each with
// the default it prints; it fails t when the output is not a flag set's usage.
func flagDefaults(t testing.TB, p cli.Program, name string) []flagDefault {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := p.Run(context.Background(), []string{name, "-h"}, &stdout, &stderr)
	help := stdout.String() + stderr.String()
	if code != 0 || !strings.Contains(help, "Usage of "+name) {
		t.Fatalf("%s %s -h: exit %d, not a usage:\n%s", p.Name, name, code, help)
	}
	var out []flagDefault
	starts := flagLine.FindAllStringSubmatchIndex(help, -1)
	for i, m := range starts {
		end := len(help)
		if i+1 < len(starts) {
			end = starts[i+1][0]
		}
		f := flagDefault{name: help[m[2]:m[3]]}
		if d := defaultRE.FindStringSubmatch(help[m[1]:end]); d != nil {
			f.def = d[1]
			if u, err := strconv.Unquote(d[1]); err == nil {
				f.def = u
			}
		}
		out = append(out, f)
	}
	return out
}

// shownDefault returns the default a synopsis shows for a flag, the value written after it
// ("--nodes 1", "--mode paper|tight": the first choice), and whether it shows one: a
// placeholder (a value with a capital letter, "N", "FILE.csv") or another flag shows none.
func shownDefault(value string) (string, bool) {
	if value == "" || strings.HasPrefix(value, "-") || strings.HasPrefix(value, "|") ||
		strings.ToLower(value) != value {
		return "", false
	}
	first, _, _ := strings.Cut(value, "|")
	return first, true
}

// sameDefault reports whether a default shown in a synopsis is the flag's: as durations when
// both are ("60s", "1m0s"), as numbers when both are ("1e-5", "1e-05"), else as text.
func sameDefault(shown, def string) bool {
	if a, err := time.ParseDuration(shown); err == nil {
		if b, err := time.ParseDuration(def); err == nil {
			return a == b
		}
	}
	if a, err := strconv.ParseFloat(shown, 64); err == nil {
		if b, err := strconv.ParseFloat(def, 64); err == nil {
			return a == b
		}
	}
	return shown == def
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

// namedFlags returns the flags text names, each as namedFlag's submatches (the whole match, the
// name, the value written after it). A flag given as the other choice of a value
// ("--scaler-from CSV|--no-scaler") is named too, not read as part of that value.
func namedFlags(text string) [][]string {
	return namedFlag.FindAllStringSubmatch(strings.ReplaceAll(text, "|--", "| --"), -1)
}

// CheckSynopsis reports through t every flag a command of p lists in its -h output that p's
// overview (the command's Args) or doc's synopsis of the command (Synopsis) does not name, as
// --flag followed by anything but a letter, a digit or a dash; every flag either names that the
// command lacks, and every command doc's synopses name that p lacks; and every default either
// shows ("[--nodes 1]") that is not the one -h prints. A flag whose -h prints no default (its
// zero value, or a default its usage explains) is not held to the value written after it.
func CheckSynopsis(t testing.TB, p cli.Program, doc []byte, docName string) {
	t.Helper()
	synopsis := Synopsis(doc, p.Name)
	for name := range synopsis {
		if !slices.ContainsFunc(p.Commands, func(c cli.Command) bool { return c.Name == name }) {
			t.Errorf("%s: a synopsis of %s %s, which is no command of %s", docName, p.Name, name, p.Name)
		}
	}
	for _, c := range p.Commands {
		if synopsis[c.Name] == "" {
			t.Errorf("%s has no synopsis of %s %s", docName, p.Name, c.Name)
		}
		flags := flagDefaults(t, p, c.Name)
		for _, f := range flags {
			named := regexp.MustCompile(`--` + regexp.QuoteMeta(f.name) + `(?:[^a-z0-9-]|$)`)
			if !named.MatchString(c.Args) {
				t.Errorf("%s --help: %s %s lacks --%s", p.Name, c.Name, c.Args, f.name)
			}
			if !named.MatchString(synopsis[c.Name]) {
				t.Errorf("%s: the synopsis of %s %s lacks --%s", docName, p.Name, c.Name, f.name)
			}
		}
		for where, text := range map[string]string{p.Name + " --help": c.Args, docName: synopsis[c.Name]} {
			for _, m := range namedFlags(text) {
				i := slices.IndexFunc(flags, func(f flagDefault) bool { return f.name == m[1] })
				if i < 0 {
					t.Errorf("%s: %s %s names --%s, which %s %s -h does not list", where, p.Name, c.Name, m[1], p.Name, c.Name)
					continue
				}
				if shown, ok := shownDefault(m[2]); ok && flags[i].def != "" && !sameDefault(shown, flags[i].def) {
					t.Errorf("%s: %s %s shows --%s %s, but its default is %s", where, p.Name, c.Name, m[1], shown, flags[i].def)
				}
			}
		}
	}
}
