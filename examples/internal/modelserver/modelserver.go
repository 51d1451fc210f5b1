// Package modelserver starts examples/model_server.py for a test and stops it when the test
// ends. The tests of the server are in package examples (it follows the posterior cfguard
// exports) and in examples/internal/tests/requests (its answers to good and bad requests): each
// starts Python and imports torch, seconds of CPU, so they are two go test processes, each within
// go test's time limit on a busy core.
package modelserver

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/tooltest"
)

// Script is the path of examples/model_server.py.
func Script(t testing.TB) string {
	t.Helper()
	return filepath.Join(tooltest.RepoRoot(t), "examples", "model_server.py")
}

// Start runs model_server.py with the Python py on dir, with samples draws per request, and
// returns its URL and its log (stderr). The server binds 127.0.0.1 port 0 itself and prints its
// address (no race for a free port). The test's cleanup stops it with SIGTERM. Its start
// (importing torch) and its exit take seconds of CPU, which a busy core stretches to tens of
// seconds: a server that prints no address, or does not exit, while its CPU time stands still
// for stall fails the test (and is killed).
func Start(t testing.TB, py, dir string, samples int) (url string, log *tooltest.Output) {
	t.Helper()
	cmd := exec.Command(py, Script(t), "--model-dir", dir, "--listen", "127.0.0.1", "--port", "0",
		"--samples", fmt.Sprint(samples))
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	log = &tooltest.Output{}
	cmd.Stderr = log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		err, stuck := waitWorking(cmd.Process.Pid, exited)
		if stuck != nil {
			cmd.Process.Kill()
			<-exited
			t.Errorf("model server did not stop after SIGTERM: %v\n%s", stuck, log.String())
			return
		}
		if err != nil {
			t.Errorf("model server: %v\n%s", err, log.String())
		}
	})
	first := make(chan string, 1)
	go func() {
		r := bufio.NewReader(stdout)
		line, _ := r.ReadString('\n')
		first <- line
		io.Copy(io.Discard, r) // until the process closes stdout
		exited <- cmd.Wait()
	}()
	var hello struct {
		Listening string `json:"listening"`
	}
	line, stuck := waitWorking(cmd.Process.Pid, first)
	if stuck != nil {
		t.Fatalf("model server printed no address: %v\n%s", stuck, log.String())
	}
	if err := json.Unmarshal([]byte(line), &hello); err != nil || hello.Listening == "" {
		t.Fatalf("model server's first line %q: %v\n%s", line, err, log.String())
	}
	return "http://" + hello.Listening, log
}

// stall is how long the server's CPU time may stand still while a test waits for it.
const stall = 30 * time.Second

// waitWorking waits for a value on ch from process pid while the process works: it returns the
// value, or an error (stuck) once pid's CPU time has not moved for stall.
func waitWorking[T any](pid int, ch <-chan T) (v T, stuck error) {
	last, since := time.Duration(-1), time.Now()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case v := <-ch:
			return v, nil
		case <-tick.C:
		}
		cpu, err := tooltest.CPU(pid)
		if err != nil {
			continue // exited: its value is on its way
		}
		if cpu != last {
			last, since = cpu, time.Now()
		} else if time.Since(since) > stall {
			return v, fmt.Errorf("its CPU time stood at %v for %v", cpu, stall)
		}
	}
}
