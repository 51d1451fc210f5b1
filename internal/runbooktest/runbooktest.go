// Package runbooktest runs the commands of docs/RUNBOOK.md in tests, as an on-call engineer
// would: each "## Alert" section's ```sh blocks, one command per line, with bash -o pipefail,
// the documented addresses and placeholders replaced by a test's, and what each prints checked
// against what the section says it shows. A command without a check fails the test, so a new
// runbook command comes with its check.
package runbooktest

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/tooltest"
)

// Section is one "## Alert" section of the runbook: the lines of its ```sh blocks.
type Section struct {
	Name     string
	Commands []string
}

// Check says what one runbook command (the one containing Cmd) must print in the state of its
// alert: Want, a regular expression, matches its output (stdout and stderr, trimmed).
type Check struct {
	Cmd  string
	Want string
}

// Sections reads the fenced ```sh blocks of the runbook at path, section by section; every
// non-empty line of a block is one command.
func Sections(t testing.TB, path string) []Section {
	t.Helper()
	doc, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []Section
	in := false
	sc := bufio.NewScanner(bytes.NewReader(doc))
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "## "):
			out = append(out, Section{Name: strings.TrimSpace(l[3:])})
		case l == "```sh":
			in = true
		case in && l == "```":
			in = false
		case in && strings.TrimSpace(l) != "":
			if len(out) == 0 {
				t.Fatalf("%s: command %q before the first section", path, l)
			}
			out[len(out)-1].Commands = append(out[len(out)-1].Commands, l)
		}
	}
	if in {
		t.Fatalf("%s: a ```sh block is not closed", path)
	}
	return out
}

// Named returns the section of the runbook at path named name, failing without one.
func Named(t testing.TB, path, name string) Section {
	t.Helper()
	for _, s := range Sections(t, path) {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("%s has no section %s", path, name)
	return Section{}
}

// Matching returns the checks whose Cmd command contains.
func Matching(checks []Check, command string) []Check {
	var out []Check
	for _, ch := range checks {
		if strings.Contains(command, ch.Cmd) {
			out = append(out, ch)
		}
	}
	return out
}

// Covered fails t unless every command of s matches exactly one of checks and every check
// matches a command of s.
func Covered(t testing.TB, s Section, checks []Check) {
	t.Helper()
	for _, c := range s.Commands {
		if n := len(Matching(checks, c)); n != 1 {
			t.Errorf("%s: command %q matches %d checks, want 1", s.Name, c, n)
		}
	}
	for _, ch := range checks {
		found := false
		for _, c := range s.Commands {
			found = found || strings.Contains(c, ch.Cmd)
		}
		if !found {
			t.Errorf("%s: the checks expect a command containing %q that the section does not have", s.Name, ch.Cmd)
		}
	}
}

// Run runs the commands of s with bash against the state subst points them at and checks their
// output with checks. notRun names, by check, commands not run here and the test that covers
// each.
func Run(t testing.TB, s Section, checks []Check, subst *strings.Replacer, notRun map[string]string) {
	t.Helper()
	for _, c := range s.Commands {
		m := Matching(checks, c)
		if len(m) != 1 {
			t.Errorf("%s: command %q matches %d checks, want 1", s.Name, c, len(m))
			continue
		}
		ch := m[0]
		if why, skip := notRun[ch.Cmd]; skip {
			t.Logf("%s: not run: %s (%s)", s.Name, c, why)
			continue
		}
		line := subst.Replace(c)
		out, err := runLine(line, commandTimeout)
		if err != nil {
			t.Errorf("%s: %s: %v\n%s", s.Name, line, err, out)
			continue
		}
		if !regexp.MustCompile(ch.Want).Match(bytes.TrimSpace(out)) {
			t.Errorf("%s: %s printed\n%s\nwant it to match %s", s.Name, line, clip(out), ch.Want)
			continue
		}
		t.Logf("%s: ran %s (%d bytes of output, as the runbook says)", s.Name, c, len(out))
	}
}

// commandTimeout bounds one runbook command.
const commandTimeout = 2 * time.Minute

// runLine runs line with bash (pipefail) in a process group of its own and returns its combined
// output. At timeout the whole group is killed, every process of a pipeline with it (killing bash
// alone would leave a curl or kcat holding the output, and the wait would last as long as it
// does). The output goes to a file, not a pipe: a process that outlives bash in another process
// group (timeout(1) makes one for its command) holds nothing the wait must wait for, and no
// goroutine must copy a pipe within a deadline, which a starved core misses.
func runLine(line string, timeout time.Duration) ([]byte, error) {
	f, err := os.CreateTemp("", "runbook-command-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", line)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.Stdout, cmd.Stderr = f, f
	err = cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("killed after %v: %w", timeout, err)
	}
	out, rerr := os.ReadFile(f.Name())
	if rerr != nil && err == nil {
		err = rerr
	}
	return out, err
}

// Tools reports whether the tools the runbook's commands use are on PATH; when one is not, it
// calls tooltest.Missing (a skip, or a failure with CFGUARD_REQUIRE_TOOLS=1) unless quiet, in
// which case it only reports false.
func Tools(t testing.TB, quiet bool) bool {
	t.Helper()
	for _, tool := range []string{"bash", "curl", "kcat", "jq", "df", "sort", "uniq"} {
		if _, err := exec.LookPath(tool); err != nil {
			if !quiet || os.Getenv(tooltest.RequireEnv) == "1" {
				tooltest.Missing(t, tool+" not on PATH", "apt-get install kcat curl jq")
			}
			return false
		}
	}
	return true
}

// clip shortens a command's output for an error message.
func clip(b []byte) string {
	if len(b) > 2000 {
		return fmt.Sprintf("%s ... (%d bytes)", b[:2000], len(b))
	}
	return string(b)
}
