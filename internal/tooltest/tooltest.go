// Package tooltest helps tests that drive external programs (kcat, promtool, Prometheus,
// PyTorch, cfguard itself, ...). It decides what a test does when a tool is missing: it skips,
// or it fails when CFGUARD_REQUIRE_TOOLS=1; CI installs the tools and sets it (.ci/run), so no
// such test can skip there unnoticed. And it collects a started program's output (Output),
// from which a test reads the address the program bound.
package tooltest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// RequireEnv is the environment variable that turns a missing tool into a failure.
const RequireEnv = "CFGUARD_REQUIRE_TOOLS"

// Missing skips the test, or fails it when RequireEnv is 1, saying what is missing and how to
// install it.
func Missing(t testing.TB, what, install string) {
	t.Helper()
	msg := fmt.Sprintf("%s (install: %s)", what, install)
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%s, and %s=1", msg, RequireEnv)
	}
	t.Skipf("%s; set %s=1 to make this a failure", msg, RequireEnv)
}

// Command returns the path of the first of names found on PATH, or calls Missing.
func Command(t testing.TB, install string, names ...string) string {
	t.Helper()
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	Missing(t, strings.Join(names, " or ")+" not on PATH", install)
	return ""
}

// PythonTorch returns Debian's python3 when it imports torch and numpy, or calls Missing.
func PythonTorch(t testing.TB) string {
	t.Helper()
	const py = "/usr/bin/python3"
	out, err := exec.Command(py, "-c", "import torch, numpy").CombinedOutput()
	if err == nil {
		return py
	}
	Missing(t, fmt.Sprintf("%s cannot import torch and numpy: %s %v", py, strings.TrimSpace(string(out)), err),
		"apt-get install python3-torch python3-numpy")
	return ""
}

// TorchCommand is exec.Command(py, args...) with torch on one thread (OMP_NUM_THREADS=1). By
// default torch runs an OpenMP thread per core and every parallel operation waits at a barrier
// for all of them; beside other busy processes (a loaded CI machine, the suite's other
// packages) each operation waits for the slowest thread to be scheduled. Exporting the bundled
// model with examples/export_torchbnn.py took 88 s beside 20 busy loops on two cores, and 22 s
// on one thread, for the same CPU time.
func TorchCommand(py string, args ...string) *exec.Cmd {
	cmd := exec.Command(py, args...)
	cmd.Env = append(os.Environ(), "OMP_NUM_THREADS=1")
	return cmd
}

// RepoRoot is the repository's root: the nearest directory at or above the test's working
// directory (its package's) that holds go.mod. Tests read docs, assets and examples from it
// whatever the depth of their package.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod at or above the test's working directory")
		}
		dir = parent
	}
}
