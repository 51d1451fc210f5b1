package runbooktest

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// A command that outlives its timeout is killed with every process of its pipeline: the first
// stage here (a sleep of a minute, its pid written to a file) is gone soon after runLine
// returns, not a minute later.
func TestRunLineKillsTheWholePipelineAtTimeout(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "pid")
	out, err := runLine("sh -c 'echo $$ > "+pidFile+"; exec sleep 60' | cat", 300*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "killed after 300ms") {
		t.Fatalf("runLine: %v (%s), want the timeout named", err, out)
	}
	raw, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	waitfor.Cond(t, 10*time.Second, "the pipeline's sleep to be gone", func() bool {
		return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
	})
}

// A command that ends in time gives its output and no error.
func TestRunLineReturnsTheOutput(t *testing.T) {
	out, err := runLine("echo one | tr a-z A-Z", time.Minute)
	if err != nil || strings.TrimSpace(string(out)) != "ONE" {
		t.Fatalf("runLine: %q, %v", out, err)
	}
}
