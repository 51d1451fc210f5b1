package admin

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ledger/store"
)

// TestBackupUnderLoadThenRestore takes a backup with `cfguard backup` while records stream in
// and the daemon applies them, lets that daemon finish, then moves its ledger aside, installs
// the backup with `cfguard restore` and starts again: the restored daemon must resume from the
// backup's offsets and end with exactly the records and, bit for bit, the posterior of the
// uninterrupted run (increments have a fixed size and updates are seeded by posterior version),
// so that no record was lost or applied twice.
func TestBackupUnderLoadThenRestore(t *testing.T) {
	if testing.Short() {
		t.Skip("starts daemon processes")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := proc.StartBroker(t)
	dir := t.TempDir()
	set, _, modelDir := proc.TrainModel(t, t.TempDir())
	cfg := proc.WriteConfig(t, dir, b.Addrs()[0], proc.AnyPort, "backup", modelDir)
	proc.EditConfig(t, cfg, "http:\n", "http:\n  token: s3cret\n")
	c := proc.StartChild(t, cfg, proc.AnyPort)
	c.Token = "s3cret"

	// 24 increments of 16 records, produced at a pace so that records stream in while the backup
	// is taken; the last 4 wait for the backup, so that it lands mid-stream however slowly the
	// daemon and the backup command run.
	const good, per, held = 384, 16, 4 * 16
	produced, backedUp := make(chan error, 1), make(chan struct{})
	go func() {
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()[0]), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll, BatchSize: per}
		defer w.Close()
		for i := 0; i < good; i += per {
			if i == good-held {
				select {
				case <-backedUp:
				case <-ctx.Done():
					produced <- ctx.Err()
					return
				}
			}
			var msgs []kafka.Message
			for j := i; j < i+per; j++ {
				v, _ := json.Marshal(map[string]any{"id": fmt.Sprint(j), "features": set.X[j], "label": set.Y[j]})
				msgs = append(msgs, kafka.Message{Value: v})
			}
			if err := w.WriteMessages(ctx, msgs...); err != nil {
				produced <- err
				return
			}
			time.Sleep(40 * time.Millisecond)
		}
		produced <- nil
	}()
	c.WaitApplied(t, 4*per, "the daemon")

	out := filepath.Join(t.TempDir(), "cfguard.backup")
	code, stdout, stderr := proc.RunCLI(t, "backup", "--config", cfg, "--url", "http://"+c.Addr(), "--out", out)
	if code != 0 {
		t.Fatalf("cfguard backup: exit %d: %s", code, stderr)
	}
	close(backedUp)
	var info ledger.Info
	if err := json.Unmarshal([]byte(stdout), &info); err != nil {
		t.Fatalf("cfguard backup printed %q: %v", stdout, err)
	}
	if err := <-produced; err != nil {
		t.Fatal(err)
	}
	c.WaitApplied(t, good, "the daemon")
	if info.PosteriorVersion < 4 || info.PosteriorVersion > (good-held)/per {
		t.Fatalf("the backup holds posterior version %d; want one taken mid-stream (4..%d)", info.PosteriorVersion, (good-held)/per)
	}
	if got, want := info.Offsets[0], int64(info.PosteriorVersion*per); got != want {
		t.Fatalf("the backup's offset %d does not match its posterior version %d (want %d): offsets and posterior must be one snapshot", got, info.PosteriorVersion, want)
	}
	t.Logf("backup at posterior version %d, offset %d, %d bytes", info.PosteriorVersion, info.Offsets[0], info.Size)

	c.Cmd.Process.Signal(syscall.SIGTERM)
	if err := c.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v; log:\n%s", err, c.Log.String())
	}
	refState, refModel := proc.FinalState(t, dir)

	// A ledger is never replaced: restore refuses until it is moved aside.
	db := filepath.Join(dir, "state", ledger.FileName)
	if code, _, stderr := proc.RunCLI(t, "restore", "--config", cfg, "--from", out); code != 1 || !strings.Contains(stderr, db) {
		t.Fatalf("restore over a ledger: exit %d, %q; want 1 naming %s", code, stderr, db)
	}
	if err := os.Rename(db, db+".old"); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := proc.RunCLI(t, "restore", "--config", cfg, "--from", out); code != 0 {
		t.Fatalf("cfguard restore: exit %d: %s", code, stderr)
	}
	c = proc.StartChild(t, cfg, proc.AnyPort)
	c.Token = "s3cret"
	c.WaitApplied(t, good, "the daemon")
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if err := c.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v; log:\n%s", err, c.Log.String())
	}
	st, model := proc.FinalState(t, dir)
	if st.Applied != good || refState.Applied != good || st.PosteriorVersion != refState.PosteriorVersion {
		t.Fatalf("restored run: applied %d, version %d; uninterrupted: applied %d, version %d; want %d records each",
			st.Applied, st.PosteriorVersion, refState.Applied, refState.PosteriorVersion, good)
	}
	if !bytes.Equal(model, refModel) {
		t.Fatal("the restored run's posterior differs from the uninterrupted run's")
	}
}

// TestBackupRefusals: a wrong token, an existing --out and a daemon that is not running are
// refused with errors that say what to do, and leave no file behind.
func TestBackupRefusals(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	// A port this test holds, where nothing answers HTTP: each connection is closed at once.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			conn.Close()
		}
	}()
	os.WriteFile(cfg, []byte(fmt.Sprintf("http:\n  listen: %s\nstate_dir: %s\n", ln.Addr(), filepath.Join(dir, "state"))), 0o644)
	existing := filepath.Join(dir, "taken")
	os.WriteFile(existing, []byte("mine"), 0o644)
	if code, _, stderr := proc.RunCLI(t, "backup", "--config", cfg, "--out", existing); code != 2 || !strings.Contains(stderr, "never overwrites") {
		t.Fatalf("existing --out: exit %d, %q", code, stderr)
	}
	if b, _ := os.ReadFile(existing); string(b) != "mine" {
		t.Fatal("an existing --out was changed")
	}
	out := filepath.Join(dir, "new")
	if code, _, stderr := proc.RunCLI(t, "backup", "--config", cfg, "--out", out); code != 1 || !strings.Contains(stderr, "is the daemon running") {
		t.Fatalf("no daemon: exit %d, %q", code, stderr)
	}
	if code, _, stderr := proc.RunCLI(t, "backup", "--config", cfg); code != 2 || !strings.Contains(stderr, "--out") {
		t.Fatalf("no --out: exit %d, %q", code, stderr)
	}
	if code, _, stderr := proc.RunCLI(t, "restore", "--config", cfg, "--from", existing); code != 1 || !strings.Contains(stderr, existing) {
		t.Fatalf("restore of a file that is no ledger: exit %d, %q", code, stderr)
	}
	// A snapshot that does not verify (a daemon answering with a truncated ledger) is removed,
	// with advice for a backup, not the advice for a damaged ledger (move it aside, start over).
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/backup" {
			http.NotFound(w, r)
			return
		}
		w.Write(bytes.Repeat([]byte{0x5a}, 20000))
	}))
	defer srv.Close()
	code, _, stderr := proc.RunCLI(t, "backup", "--config", cfg, "--out", out, "--url", srv.URL)
	if code != 1 || !strings.Contains(stderr, "did not verify") || !strings.Contains(stderr, "run cfguard backup again") ||
		strings.Contains(stderr, "mv ") || strings.Contains(stderr, "start over") {
		t.Fatalf("a snapshot that does not verify: exit %d, %q", code, stderr)
	}
	// A daemon of a newer cfguard sends a ledger of a newer schema: not damage, a version skew.
	newer := filepath.Join(t.TempDir(), "newer")
	l, err := ledger.Open(newer, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	db, err := bolt.Open(filepath.Join(newer, ledger.FileName), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error { return store.PutU64(tx.Bucket([]byte("meta")), []byte("schema"), 99) })
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	body, err := os.ReadFile(filepath.Join(newer, ledger.FileName))
	if err != nil {
		t.Fatal(err)
	}
	srv2 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(body) }))
	defer srv2.Close()
	code, _, stderr = proc.RunCLI(t, "backup", "--config", cfg, "--out", out, "--url", srv2.URL)
	if code != 1 || !strings.Contains(stderr, "daemon's own cfguard") || strings.Contains(stderr, "did not verify") {
		t.Fatalf("a snapshot of a newer schema: exit %d, %q; want the daemon's own cfguard named", code, stderr)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Name() != "config.yaml" && e.Name() != "taken" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}

// freshLedger returns the bytes of a new, empty ledger file.
func freshLedger(t *testing.T) []byte {
	t.Helper()
	dir := t.TempDir()
	l, err := ledger.Open(dir, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	body, err := os.ReadFile(filepath.Join(dir, ledger.FileName))
	if err != nil {
		t.Fatal(err)
	}
	return body
}

// TestBackupTalksToTheConfiguredDaemon: without --url, cfguard backup asks http.listen of its
// configuration for GET /v1/backup with http.token, and prints what it verified with --out as
// its path; a URL with a trailing slash names the same endpoint. An answer other than 200 is
// refused by its status and body, and a snapshot the daemon reports as failed in its
// Cfguard-Backup-Error trailer is refused even when it verifies; neither leaves a file.
func TestBackupTalksToTheConfiguredDaemon(t *testing.T) {
	body := freshLedger(t)
	var mu sync.Mutex
	var requests []string
	answer := "ok"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		requests = append(requests, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		a := answer
		mu.Unlock()
		switch a {
		case "503":
			http.Error(w, "the daemon is stopping", http.StatusServiceUnavailable)
		case "trailer":
			w.Header().Set("Trailer", "Cfguard-Backup-Error")
			w.Write(body)
			w.Header().Set("Cfguard-Backup-Error", "the ledger could not be read")
		default:
			w.Write(body)
		}
	}))
	defer srv.Close()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("http:\n  listen: "+srv.Listener.Addr().String()+"\n  token: tok\nstate_dir: "+filepath.Join(dir, "state")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	outDir := t.TempDir()
	for _, tc := range []struct {
		name, answer string
		url          []string
		code         int
		want         string
	}{
		{"from the configuration", "ok", nil, 0, ""},
		{"trailing slash", "ok", []string{"--url", srv.URL + "/"}, 0, ""},
		{"503", "503", nil, 1, "503 Service Unavailable: the daemon is stopping"},
		{"error trailer", "trailer", nil, 1, "the daemon reported: the ledger could not be read"},
	} {
		mu.Lock()
		answer, requests = tc.answer, nil
		mu.Unlock()
		out := filepath.Join(outDir, strings.ReplaceAll(tc.name, " ", "-"))
		code, stdout, stderr := proc.RunCLI(t, append([]string{"backup", "--config", cfg, "--out", out}, tc.url...)...)
		if code != tc.code || !strings.Contains(stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q; want %d naming %q", tc.name, code, stderr, tc.code, tc.want)
		}
		mu.Lock()
		if len(requests) != 1 || requests[0] != "GET /v1/backup Bearer tok" {
			t.Errorf("%s: the daemon was asked %q, want one GET /v1/backup with Bearer tok", tc.name, requests)
		}
		mu.Unlock()
		got, err := os.ReadFile(out)
		if tc.code != 0 {
			if !os.IsNotExist(err) {
				t.Errorf("%s: a refused backup left %s: %v", tc.name, out, err)
			}
			continue
		}
		var info ledger.Info
		if err := json.Unmarshal([]byte(stdout), &info); err != nil || info.Path != out || !bytes.Equal(got, body) {
			t.Errorf("%s: printed %s (%v), %d bytes written; want the path %s and the daemon's %d bytes", tc.name, stdout, err, len(got), out, len(body))
		}
	}
	if entries, _ := os.ReadDir(outDir); len(entries) != 2 {
		t.Errorf("%d files in --out's directory, want the 2 backups", len(entries))
	}
}

// cfguard restore needs --from (exit 2). A backup that cannot be restored is refused with the
// command to restore another, naming the configuration it was given as an absolute path, quoted
// for a shell, so that the command works as printed from any directory.
func TestRestoreRefusalsNameTheConfig(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "my deploy")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("state_dir: "+filepath.Join(dir, "state")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	notLedger := filepath.Join(dir, "backup")
	if err := os.WriteFile(notLedger, bytes.Repeat([]byte{0x5a}, 20000), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	if code, _, stderr := proc.RunCLI(t, "restore", "--config", "config.yaml"); code != 2 || !strings.Contains(stderr, "--from") {
		t.Errorf("restore without --from: exit %d, %q; want 2 naming --from", code, stderr)
	}
	code, _, stderr := proc.RunCLI(t, "restore", "--config", "config.yaml", "--from", notLedger)
	if want := "cfguard restore --config " + ledger.ShellQuote(cfg) + " --from BACKUP"; code != 1 || !strings.Contains(stderr, want) {
		t.Errorf("restore of a file that is no ledger: exit %d, %q; want 1 with %q", code, stderr, want)
	}
	if _, err := os.Stat(filepath.Join(dir, "state", ledger.FileName)); !os.IsNotExist(err) {
		t.Errorf("a refused restore installed a ledger: %v", err)
	}
}

// A backup whose only damage is a counterfactual's record is restored by cfguard restore as a
// start of cfguard makes it: the CE quarantined, named with its reason in the JSON printed
// (under "repaired") and on stderr with what to do about it; the other CEs are installed as they
// were and the backup is not written to.
func TestRestoreReportsQuarantinedCEs(t *testing.T) {
	src := t.TempDir()
	l, err := ledger.Open(src, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		l.Close()
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var ces []*ledger.CE
	for i := range 5 {
		x := []float64{rng.Float64(), rng.Float64(), rng.Float64()}
		xcf := []float64{rng.Float64(), rng.Float64(), rng.Float64()}
		p, err := m.Predict([][]float64{xcf}, 200, uint64(i))
		if err != nil {
			l.Close()
			t.Fatal(err)
		}
		ces = append(ces, &ledger.CE{ID: fmt.Sprintf("ce-%d", i), X: x, XCF: xcf, Target: 1, AnchorVersion: m.Version,
			P1: p.P(0, 1), Var1: p.V(0, 1), Samples: 200, Delta: 0.05, Epsilon: 0.01})
	}
	if err := l.Put(context.Background(), ces...); err != nil {
		l.Close()
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	// One bit of ce-2's body flipped, through bbolt: the file's structure stays intact.
	db, err := bolt.Open(filepath.Join(src, ledger.FileName), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("ce_body"))
		v := bytes.Clone(b.Get([]byte("ce-2")))
		v[len(v)/2] ^= 0x20
		return b.Put([]byte("ce-2"), v)
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	backup := filepath.Join(dir, "backup.db")
	if err := store.CopyFile(filepath.Join(src, ledger.FileName), backup); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(backup)
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	state := filepath.Join(dir, "state")
	if err := os.WriteFile(cfg, []byte("state_dir: "+state+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := proc.RunCLI(t, "restore", "--config", cfg, "--from", backup)
	if code != 0 {
		t.Fatalf("cfguard restore of a backup with a damaged CE body: exit %d: %s", code, stderr)
	}
	var info ledger.Info
	if err := json.Unmarshal([]byte(stdout), &info); err != nil {
		t.Fatalf("cfguard restore printed %q: %v", stdout, err)
	}
	want := []ledger.QuarantinedCE{{ID: "ce-2", Reason: "body checksum mismatch"}}
	if info.Repaired == nil || fmt.Sprint(info.Repaired.Quarantined) != fmt.Sprint(want) || info.CEs != 4 {
		t.Errorf("cfguard restore printed %s; want %d CEs and %+v quarantined under \"repaired\"", stdout, 4, want)
	}
	for _, s := range []string{backup, "does not verify", "repairing a copy of it in " + state, `counterfactual "ce-2" quarantined: body checksum mismatch`, "register the 1 again"} {
		if !strings.Contains(stderr, s) {
			t.Errorf("cfguard restore's stderr does not say %q: %s", s, stderr)
		}
	}
	if after, _ := os.ReadFile(backup); !bytes.Equal(after, before) {
		t.Error("cfguard restore wrote to the backup")
	}
	r, err := ledger.Open(state, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if n := r.Damaged(); n != 1 {
		t.Errorf("the restored ledger's Damaged() = %d, want 1", n)
	}
	if _, err := r.Get("ce-2"); !errors.Is(err, ledger.ErrQuarantined) {
		t.Errorf("Get(ce-2) on the restored ledger: %v, want ErrQuarantined", err)
	}
	for _, id := range []string{"ce-0", "ce-1", "ce-3", "ce-4"} {
		if _, err := r.Get(id); err != nil {
			t.Errorf("Get(%s) on the restored ledger: %v", id, err)
		}
	}
}
