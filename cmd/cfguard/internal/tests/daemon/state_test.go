package daemon

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// embeddedConfig writes a config for a daemon with its embedded broker, the bundled model (a
// few training epochs) and its state under dir, on the given loopback addresses.
func embeddedConfig(t *testing.T, dir, stateDir, httpAddr, brokerAddr, extra string) string {
	t.Helper()
	text := fmt.Sprintf(`http:
  listen: %s
state_dir: %s
model:
  dataset: breast_cancer
  epochs: 5
kafka:
  embedded_listen: %s
  max_records: 16
  max_wait: 500ms
certify:
  samples: 400
audit:
  schedule: ""
%s`, httpAddr, stateDir, brokerAddr, extra)
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// firstStart runs a daemon on a new state directory until it serves, then stops it with
// SIGTERM; it returns the config path and the ledger's path.
func firstStart(t *testing.T) (cfg, db string) {
	t.Helper()
	dir := t.TempDir()
	httpAddr := proc.AnyPort
	cfg = embeddedConfig(t, dir, filepath.Join(dir, "state"), httpAddr, proc.AnyPort, "")
	c := proc.StartChild(t, cfg, httpAddr)
	c.WaitUp(t)
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if code := proc.ExitOf(t, c, 30*time.Second); code != 0 {
		t.Fatalf("first start: exit %d; log:\n%s", code, c.Log.String())
	}
	return cfg, filepath.Join(dir, "state", "cfguard.db")
}

// newestMeta is the bbolt meta page (0 or 1) with the larger transaction id: each is a 16-byte
// page header, then magic, version, page size, flags, root (16 bytes), freelist, high-water mark
// and txid (native byte order), at 4096-byte pages.
func newestMeta(t *testing.T, b []byte) int {
	t.Helper()
	if len(b) < 2*4096 {
		t.Fatalf("a %d-byte ledger", len(b))
	}
	txid := func(p int) uint64 { return binary.NativeEndian.Uint64(b[p*4096+16+48:]) }
	if txid(1) > txid(0) {
		return 1
	}
	return 0
}

func fileSum(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// TestDamagedLedgerStopsTheDaemon: only a missing ledger means "first start". An existing one
// that is empty, truncated or has flipped bytes stops the daemon with exit code 1 and an error
// that names the ledger file and how to recover, without a panic, and nothing is written over
// it (no training, no export).
func TestDamagedLedgerStopsTheDaemon(t *testing.T) {
	if testing.Short() {
		t.Skip("starts daemon processes")
	}
	cfg, db := firstStart(t)
	good, err := os.ReadFile(db)
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Dir(db)
	for name, damage := range map[string]func() error{
		"empty":     func() error { return os.WriteFile(db, nil, 0o600) },
		"truncated": func() error { return os.WriteFile(db, good[:len(good)/2], 0o600) },
		"truncated to a page": func() error {
			return os.WriteFile(db, good[:4096], 0o600)
		},
		"meta pages zeroed": func() error {
			b := bytes.Clone(good)
			clear(b[:2*4096])
			return os.WriteFile(db, b, 0o600)
		},
		// bbolt would open the previous transaction in silence.
		"newest meta page flipped": func() error {
			b := bytes.Clone(good)
			b[newestMeta(t, b)*4096+16+16] ^= 0x01 // its root page id
			return os.WriteFile(db, b, 0o600)
		},
	} {
		t.Run(name, func(t *testing.T) {
			if err := damage(); err != nil {
				t.Fatal(err)
			}
			os.RemoveAll(filepath.Join(state, "export"))
			before := fileSum(t, db)
			c := proc.StartChild(t, cfg, proc.AnyPort)
			code := proc.ExitOf(t, c, 30*time.Second)
			log := c.Log.String()
			if code != 1 {
				t.Fatalf("exit %d, want 1; log:\n%s", code, log)
			}
			if !strings.Contains(log, db) || strings.Contains(log, "model.json") {
				t.Fatalf("the error does not name %s (or blames model.json); log:\n%s", db, log)
			}
			if !strings.Contains(log, "restore") || !strings.Contains(log, "move") {
				t.Fatalf("the error does not say how to recover (restore a backup, or move the file aside); log:\n%s", log)
			}
			if strings.Contains(log, "panic") || strings.Contains(log, "goroutine ") {
				t.Fatalf("the daemon panicked; log:\n%s", log)
			}
			if strings.Contains(log, "training the bundled model") {
				t.Fatalf("the daemon treated a damaged ledger as a first start; log:\n%s", log)
			}
			if fileSum(t, db) != before {
				t.Fatal("the damaged ledger was written to")
			}
			if _, err := os.Stat(filepath.Join(state, "export")); err == nil {
				t.Fatal("an export was written from a damaged ledger")
			}
		})
	}
}

// TestSecondDaemonOnOneStateDirExitsAtOnce: a second daemon on the same state_dir must say that
// another process holds the ledger and exit at once, not after a lock timeout.
func TestSecondDaemonOnOneStateDirExitsAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts daemon processes")
	}
	dir := t.TempDir()
	httpAddr := proc.AnyPort
	cfg := embeddedConfig(t, dir, filepath.Join(dir, "state"), httpAddr, proc.AnyPort, "")
	first := proc.StartChild(t, cfg, httpAddr)
	first.WaitUp(t)
	// Same state_dir, other ports, so that only the ledger can collide.
	cfg2 := embeddedConfig(t, t.TempDir(), filepath.Join(dir, "state"), proc.AnyPort, proc.AnyPort, "")
	// The state directory's lock is taken without blocking (LOCK_NB), so the second daemon exits
	// at once; one that waited for the lock would wait for the first daemon, which stays up until
	// after this check, and proc.ExitOf would fail.
	second := proc.StartChild(t, cfg2, proc.AnyPort)
	code := proc.ExitOf(t, second, 2*time.Minute)
	log := second.Log.String()
	if code != 1 || !strings.Contains(log, "another process") || !strings.Contains(log, filepath.Join(dir, "state")) {
		t.Fatalf("second daemon: exit %d; want 1 saying another process holds the state dir; log:\n%s", code, log)
	}
	first.AppliedAnswer(t) // it still answers
	first.Cmd.Process.Signal(syscall.SIGTERM)
	if code := proc.ExitOf(t, first, 30*time.Second); code != 0 {
		t.Fatalf("first daemon exit %d", code)
	}
}

// TestConfigNamingAnotherModelIsRefused: once a ledger exists, a config whose model differs from
// the one the ledger started from is refused (exit 2) with a message that says how to start
// over, instead of being silently ignored, and the ledger is not written to: not even when the
// config also names another certificate policy, which would rebuild the indexes.
func TestConfigNamingAnotherModelIsRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("starts daemon processes")
	}
	for name, policy := range map[string]string{"the same policy": "", "another policy": "\n  mode: tight"} {
		t.Run(name, func(t *testing.T) {
			cfg, db := firstStart(t)
			text, _ := os.ReadFile(cfg)
			changed := strings.Replace(string(text), "dataset: breast_cancer", "dataset: german_credit", 1)
			changed = strings.Replace(changed, "samples: 400", "samples: 400"+policy, 1)
			if changed == string(text) || !strings.Contains(changed, "samples: 400"+policy) {
				t.Fatal("the config edit did not apply")
			}
			os.WriteFile(cfg, []byte(changed), 0o644)
			before := fileSum(t, db)
			c := proc.StartChild(t, cfg, proc.AnyPort)
			code := proc.ExitOf(t, c, 30*time.Second)
			log := c.Log.String()
			if code != 2 || !strings.Contains(log, "german_credit") || !strings.Contains(log, "breast_cancer") || !strings.Contains(log, "state_dir") {
				t.Fatalf("exit %d; want 2 naming both models and how to start over; log:\n%s", code, log)
			}
			if fileSum(t, db) != before || strings.Contains(log, "policy changed") {
				t.Fatalf("the ledger was written to; log:\n%s", log)
			}
		})
	}
}

// TestDamagedLedgerRecoveryCommandsWork runs the recovery a damaged-ledger error prints, as
// printed: move the file aside, restore a backup taken from the running daemon, start. The
// daemon must then serve the backup's state.
func TestDamagedLedgerRecoveryCommandsWork(t *testing.T) {
	if testing.Short() {
		t.Skip("starts daemon processes")
	}
	dir := t.TempDir()
	cfg := embeddedConfig(t, dir, filepath.Join(dir, "state"), proc.AnyPort, proc.AnyPort, "")
	db := filepath.Join(dir, "state", "cfguard.db")
	c := proc.StartChild(t, cfg, proc.AnyPort)
	c.WaitUp(t)
	backup := filepath.Join(t.TempDir(), "my backup") // a space, so that quoting matters
	if code, _, stderr := proc.RunCLI(t, "backup", "--config", cfg, "--url", "http://"+c.Addr(), "--out", backup); code != 0 {
		t.Fatalf("cfguard backup: exit %d: %s", code, stderr)
	}
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if code := proc.ExitOf(t, c, 30*time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM; log:\n%s", code, c.Log.String())
	}
	good, err := os.ReadFile(db)
	if err != nil {
		t.Fatal(err)
	}
	b := bytes.Clone(good)
	clear(b[:2*4096])
	if err := os.WriteFile(db, b, 0o600); err != nil {
		t.Fatal(err)
	}
	c = proc.StartChild(t, cfg, proc.AnyPort)
	if code := proc.ExitOf(t, c, 30*time.Second); code != 1 {
		t.Fatalf("damaged ledger: exit %d, want 1; log:\n%s", code, c.Log.String())
	}
	log := c.Log.String()
	mv := regexp.MustCompile(`\((mv [^)]*)\)`).FindStringSubmatch(log)
	restore := regexp.MustCompile(`\((cfguard restore [^,]*), which`).FindStringSubmatch(log)
	if mv == nil || restore == nil {
		t.Fatalf("the error prints no mv or cfguard restore command; log:\n%s", log)
	}
	if strings.Contains(log, "BACKUP <") || strings.Contains(log, "CONFIG") || strings.Contains(log, "committed offsets)") && !strings.Contains(log, "not from the consumer group") {
		t.Fatalf("the error keeps a placeholder for the config or claims the group's offsets are used; log:\n%s", log)
	}
	t.Logf("printed: %s; %s", mv[1], restore[1])
	sh := func(line string) {
		t.Helper()
		// The printed command, with the test binary standing in for cfguard and a real backup
		// file for BACKUP.
		line = strings.Replace(line, "cfguard ", ledger.ShellQuote(os.Args[0])+" ", 1)
		line = strings.Replace(line, "--from BACKUP", "--from "+ledger.ShellQuote(backup), 1)
		cmd := exec.Command("sh", "-c", line)
		cmd.Env = append(os.Environ(), "CFGUARD_TEST_MAIN=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", line, err, out)
		}
	}
	sh(mv[1])
	if _, err := os.Stat(db); err == nil {
		t.Fatal("the printed mv left the damaged ledger in place")
	}
	sh(restore[1])
	c = proc.StartChild(t, cfg, proc.AnyPort)
	c.WaitUp(t)
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if code := proc.ExitOf(t, c, 30*time.Second); code != 0 {
		t.Fatalf("exit %d after the restore; log:\n%s", code, c.Log.String())
	}
	if strings.Contains(c.Log.String(), "training the bundled model") {
		t.Fatalf("the daemon started over instead of from the restored backup; log:\n%s", c.Log.String())
	}
	if fileSum(t, db+".damaged") != sha256.Sum256(b) {
		t.Fatal("the damaged ledger was changed")
	}
}

// A daemon process serves process_start_time_seconds, from which CfguardIngestStalled counts
// the stall of a daemon that never ingested: the time the process started, between the test's
// start of it and the first answer of its /metrics.
func TestDaemonProcessServesItsStartTime(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a daemon process")
	}
	dir := t.TempDir()
	// The metric is the boot time in whole seconds (/proc/stat's btime) plus the process's start
	// in clock ticks since boot: up to a second before the true start, never after it.
	before := float64(time.Now().Add(-time.Second).UnixNano()) / 1e9
	c := proc.StartChild(t, embeddedConfig(t, dir, filepath.Join(dir, "state"), proc.AnyPort, proc.AnyPort, ""), proc.AnyPort)
	c.WaitUp(t)
	// MetricValues gives -1 for a scrape not answered within a second (a poll's timeout): a
	// daemon that has just started may take longer to answer one on a busy machine.
	var start float64
	waitfor.Cond(t, 60*time.Second, "an answer of /metrics", func() bool {
		start = c.MetricValues("process_start_time_seconds")[0]
		return start >= 0
	})
	if after := float64(time.Now().UnixNano()) / 1e9; start < before || start > after {
		t.Errorf("process_start_time_seconds %v; want the process's start, in [%v, %v]", start, before, after)
	}
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if code := proc.ExitOf(t, c, 30*time.Second); code != 0 {
		t.Fatalf("daemon exit %d; log:\n%s", code, c.Log.String())
	}
}
