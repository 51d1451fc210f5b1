// Package proc runs cfguard for tests: as a child process (Child, ReplicaProc, BrokerProc) that a
// test can SIGKILL, SIGSTOP or starve, or in process (RunCLI). A child is the test binary itself,
// re-executed with CFGUARD_TEST_MAIN=1: every test package that starts one has
//
//	func TestMain(m *testing.M) { proc.Main(m) }
//
// so that the binary acts as the cfguard command in the child and runs the tests otherwise.
package proc

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
)

// Main is a TestMain: in a child (CFGUARD_TEST_MAIN=1) it runs the cfguard command with the
// process's arguments and exits with its code; otherwise it runs the tests.
func Main(m *testing.M) {
	if os.Getenv("CFGUARD_TEST_MAIN") == "1" {
		command.Main()
	}
	os.Exit(m.Run())
}

// RunCLI runs cfguard with args in process and returns its exit code and what it printed.
func RunCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var o, e bytes.Buffer
	code = command.Run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}
