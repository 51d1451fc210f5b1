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

// A command that leaves a process behind in another process group (as timeout(1) makes one for
// its command) that still holds the command's output ends when bash does, with what it printed:
// the wait is for bash, not for whatever inherited its output.
func TestRunLineEndsWithBashNotWithWhatItLeft(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "pid")
	start := time.Now()
	out, err := runLine("setsid sh -c 'echo $$ > "+pidFile+"; exec sleep 60' & echo done", time.Minute)
	took := time.Since(start)
	waitfor.Cond(t, 60*time.Second, "the left process's pid", func() bool { _, err := os.Stat(pidFile); return err == nil })
	if raw, rerr := os.ReadFile(pidFile); rerr == nil {
		if pid, perr := strconv.Atoi(strings.TrimSpace(string(raw))); perr == nil && pid > 0 {
			t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
		}
	}
	if err != nil || strings.TrimSpace(string(out)) != "done" {
		t.Fatalf("runLine: %q, %v after %v; want done, no error", out, err, took)
	}
	if took > 50*time.Second {
		t.Fatalf("runLine returned after %v: it waited for the process the command left", took)
	}
}

// A command that ends in time gives its output and no error.
func TestRunLineReturnsTheOutput(t *testing.T) {
	out, err := runLine("echo one | tr a-z A-Z", time.Minute)
	if err != nil || strings.TrimSpace(string(out)) != "ONE" {
		t.Fatalf("runLine: %q, %v", out, err)
	}
}
