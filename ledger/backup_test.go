package ledger

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger/store"
)

// slowWriter writes to w, pausing after every chunk, so that a backup spans many commits.
type slowWriter struct {
	w     io.Writer
	pause time.Duration
}

func (s *slowWriter) Write(p []byte) (int, error) {
	time.Sleep(s.pause)
	return s.w.Write(p)
}

// offsetFor is the offset the load test checkpoints together with posterior version v.
func offsetFor(v uint64) int64 { return int64(v)*7 + 3 }

// Backups taken while a writer keeps committing are consistent snapshots: each verifies, and
// its (posterior version, offset) pair is one a single checkpoint committed together.
func TestBackupUnderLoad(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(31, 31))
	for b := 0; b < 10; b++ {
		var ces []*CE
		for i := 0; i < 200; i++ {
			ces = append(ces, newCE(t, m, rng))
		}
		if err := l.Put(bg, ces...); err != nil {
			t.Fatal(err)
		}
	}
	var (
		committed sync.Map // posterior version -> offset committed with it
		last      atomic.Uint64
		stop      = make(chan struct{})
		wg        sync.WaitGroup
		werr      error
	)
	committed.Store(m.Version, int64(-1)) // installed without an offset
	wg.Add(1)
	go func() {
		defer wg.Done()
		cur := m
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			next := drift(cur, 1e-5*float64(1-2*(i%2)))
			if _, _, err := l.Commit(bg, &Checkpoint{Model: next, Offsets: map[int]int64{0: offsetFor(next.Version)}, Applied: 1,
				Update: &UpdateRecord{Version: next.Version, KL: 1e-8, Outcome: certify.OutcomePromoted}}); err != nil {
				werr = err
				return
			}
			committed.Store(next.Version, offsetFor(next.Version))
			last.Store(next.Version)
			cur = next
		}
	}()
	dir := t.TempDir()
	spanned := 0
	for b := 0; b < 4; b++ {
		path := filepath.Join(dir, fmt.Sprintf("backup-%d.db", b))
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		before := last.Load()
		info, err := l.Backup(bg, &slowWriter{w: f, pause: 2 * time.Millisecond})
		after := last.Load()
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		if after > before+1 {
			spanned++
		}
		v, err := Verify(path)
		if err != nil {
			t.Fatalf("backup %d: %v", b, err)
		}
		want, ok := committed.Load(v.PosteriorVersion)
		got, hasOff := v.Offsets[0]
		switch {
		case !ok:
			t.Fatalf("backup %d holds posterior version %d, which was never committed", b, v.PosteriorVersion)
		case want.(int64) == -1 && hasOff, want.(int64) != -1 && got != want.(int64):
			t.Fatalf("backup %d: posterior version %d with offset %d; that checkpoint committed offset %v", b, v.PosteriorVersion, got, want)
		case v.PosteriorVersion != info.PosteriorVersion || v.Size != info.Size || v.TxID != info.TxID ||
			!equalCounts(v.Counts, info.Counts) || fmt.Sprint(v.Offsets) != fmt.Sprint(info.Offsets):
			t.Fatalf("backup %d: Backup said %+v, Verify found %+v", b, info, v)
		}
		t.Logf("backup %d: %d bytes at posterior version %d (writer went from %d to %d meanwhile)", b, info.Size, info.PosteriorVersion, before, after)
	}
	close(stop)
	wg.Wait()
	if werr != nil {
		t.Fatal(werr)
	}
	if spanned == 0 {
		t.Fatal("no backup overlapped a commit: the test did not exercise concurrency")
	}
	// A backup restores into a working ledger holding what Verify said.
	state := filepath.Join(t.TempDir(), "state")
	info, err := Restore(filepath.Join(dir, "backup-3.db"), state)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	st, err := r.State()
	if err != nil || st.PosteriorVersion != info.PosteriorVersion || !equalCounts(st.Counts, info.Counts) {
		t.Fatalf("restored state %+v (%v), verified %+v", st, err, info)
	}
	if cur, err := r.Current(); err != nil || cur.Version != info.PosteriorVersion {
		t.Fatalf("restored posterior: %v, %v", cur, err)
	}
}

func TestRestoreRefuses(t *testing.T) {
	src := t.TempDir()
	richLedger(t, src)
	backup := filepath.Join(src, FileName)
	// Two Verifies side by side: shared locks.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); _, errs[i] = Verify(backup) }()
	}
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatalf("concurrent Verify: %v, %v", errs[0], errs[1])
	}
	// Into a state dir that holds a ledger: never replaced.
	state := t.TempDir()
	l, err := Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Restore(backup, state); !errors.Is(err, ErrLocked) {
		t.Errorf("restore into a running ledger's dir: %v, want ErrLocked", err)
	}
	l.Close()
	before := fileHash(t, filepath.Join(state, FileName))
	_, err = Restore(backup, state)
	if !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), "mv ") {
		t.Errorf("restore over an existing ledger: %v, want fs.ErrExist saying to move it aside", err)
	}
	if fileHash(t, filepath.Join(state, FileName)) != before {
		t.Fatal("restore changed the existing ledger")
	}
	// A damaged backup is refused, naming it; nothing is installed.
	data, _ := os.ReadFile(backup)
	bad := filepath.Join(t.TempDir(), "bad.db")
	os.WriteFile(bad, data[:len(data)/3], 0o600)
	empty := filepath.Join(t.TempDir(), "state")
	// What it says is about the backup: not to move it aside and start over, as for a ledger.
	if _, err := Restore(bad, empty); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), bad) ||
		!strings.Contains(err.Error(), "Restore another backup") || strings.Contains(err.Error(), "mv ") || strings.Contains(err.Error(), "start over") ||
		strings.Contains(err.Error(), "cfguard backup") {
		t.Errorf("restore of a truncated backup: %v; want a corrupt error naming it that says to restore another backup", err)
	}
	if _, err := os.Stat(filepath.Join(empty, FileName)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused restore installed a file: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(empty, "*.restore-*")); len(left) != 0 {
		t.Errorf("restore left temporary files: %v", left)
	}
	// The good one installs and opens.
	info, err := Restore(backup, empty)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(empty, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if o, _ := r.Origin(); o != info.Origin || o != "test:testModel(4)" {
		t.Errorf("restored origin %q, verified %q", o, info.Origin)
	}
}

// A backup is a bbolt snapshot: its transaction T on meta page 0 and T-1 on page 1, whatever T,
// where bbolt's commits put transaction t on page t mod 2. Restored, the file gets bbolt's order,
// so that after the next commit a damaged older meta page costs nothing and is only reported, as
// on any ledger (with T odd, it was two transactions behind and refused).
func TestRestoredLedgerToleratesADamagedOlderMeta(t *testing.T) {
	for _, parity := range []uint64{0, 1} {
		t.Run(fmt.Sprintf("backup transaction mod 2 = %d", parity), func(t *testing.T) {
			l, _ := openTest(t, Options{Policy: testPolicy()})
			m := testModel(4)
			install(t, l, m)
			rng := rand.New(rand.NewPCG(5, 5))
			backup := backupOfParity(t, l, m, rng, parity)
			state := t.TempDir()
			if _, err := Restore(backup, state); err != nil {
				t.Fatal(err)
			}
			r, err := Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			if err := r.Put(bg, newCE(t, m, rng)); err != nil {
				t.Fatal(err)
			}
			r.Close()
			path := filepath.Join(state, FileName)
			info, err := Verify(path)
			if err != nil {
				t.Fatal(err)
			}
			older := int64(1 - info.TxID%2) // bbolt's order: the newest transaction t on page t mod 2
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			b[older*int64(info.PageSize)+16+16] ^= 0x04 // the older meta's root page: its checksum fails
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			got, err := Verify(path)
			if err != nil || got.TxID != info.TxID || got.MetaDamaged == "" {
				t.Fatalf("a restored ledger with its older meta page damaged: %+v, %v; want transaction %d, the damage reported", got, err, info.TxID)
			}
			r, err = Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
			if err != nil {
				t.Fatalf("a restored ledger with its older meta page damaged does not open: %v", err)
			}
			r.Close()
		})
	}
}

// backupOfParity writes a backup of l whose transaction id is parity mod 2, storing a CE (one
// transaction) between tries, and returns its path.
func backupOfParity(t *testing.T, l *Ledger, m *bnn.Model, rng *rand.Rand, parity uint64) string {
	t.Helper()
	backup := filepath.Join(t.TempDir(), "backup.db")
	for range 10 {
		f, err := os.Create(backup)
		if err != nil {
			t.Fatal(err)
		}
		info, err := l.Backup(bg, f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		if info.TxID%2 == parity {
			return backup
		}
		if err := l.Put(bg, newCE(t, m, rng)); err != nil {
			t.Fatal(err)
		}
	}
	t.Fatalf("no backup with a transaction id of parity %d in 10 tries", parity)
	return ""
}

// A copy that differs from the backup Restore verified (here a backup given to Install
// directly, its newest transaction odd and its tree's root page damaged) is refused as a copy
// that does not verify before bbolt touches it (bbolt faults on such a file): nothing is
// installed and nothing left behind.
func TestInstallVerifiesACopyBeforeAligningIt(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	backup := backupOfParity(t, l, m, rand.New(rand.NewPCG(6, 6)), 1)
	data, err := os.ReadFile(backup)
	if err != nil {
		t.Fatal(err)
	}
	info, err := Verify(backup)
	if err != nil {
		t.Fatal(err)
	}
	ps := info.PageSize
	root := binary.NativeEndian.Uint64(data[16+16:])        // meta page 0 (the snapshot's newest): its root bucket's page
	binary.NativeEndian.PutUint16(data[int(root)*ps+8:], 0) // the page's flags: no page type
	damaged := filepath.Join(t.TempDir(), "damaged.db")
	if err := os.WriteFile(damaged, data, 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "state")
	err = store.Install(damaged, dir, func(path string) error { _, err := Verify(path); return err })
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "did not verify") {
		t.Errorf("Install of a damaged copy: %v, want it refused as a copy that does not verify", err)
	}
	if _, err := os.Stat(filepath.Join(dir, FileName)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a damaged copy was installed: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*.restore-*")); len(left) != 0 {
		t.Errorf("the damaged copy was left behind: %v", left)
	}
}

// firstWrite is a buffer that says when the first bytes arrive.
type firstWrite struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	started chan struct{}
}

func (f *firstWrite) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.buf.Len() == 0 && len(p) > 0 {
		close(f.started)
	}
	return f.buf.Write(p)
}

// TestBackupHoldsNoFailedCommit: a backup asked for while a commit's meta page is written and its
// final fsync fails (AfterCommit stands for that fsync, as in the store's tests) waits for the
// commit's outcome and holds the ledger without it: restored, it never brings back CEs whose
// registration was answered as failed.
func TestBackupHoldsNoFailedCommit(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(5, 5))
	before, err := l.Counts()
	if err != nil {
		t.Fatal(err)
	}
	snap := &firstWrite{started: make(chan struct{})}
	done := make(chan error, 1)
	l.opts.AfterCommit = func() error {
		go func() { _, err := l.Backup(bg, snap); done <- err }()
		// The backup's read transaction, started now, would take this commit and write at once;
		// it must wait for the outcome instead and write nothing before this returns.
		waitfor.Cond(t, time.Minute, "the backup writing or waiting for the commit's outcome", func() bool {
			select {
			case <-snap.started:
				return true
			default:
				return l.file.ViewsWaiting() == 1
			}
		})
		return errors.New("injected: the commit's final fsync failed")
	}
	ce1, ce2 := newCE(t, m, rng), newCE(t, m, rng)
	ce1.ID, ce2.ID = "w1", "w2"
	if _, err := l.PutEach(bg, []*CE{ce1, ce2}); !errors.Is(err, ErrWrite) {
		t.Fatalf("PutEach: %v, want ErrWrite", err)
	}
	l.opts.AfterCommit = nil
	if err := <-done; err != nil {
		t.Fatalf("backup: %v", err)
	}
	path := filepath.Join(t.TempDir(), "backup.db")
	if err := os.WriteFile(path, snap.buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	info, err := Verify(path)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(info.Counts, before) {
		t.Fatalf("the backup counts %v CEs, the ledger %v: it holds the commit that failed", info.Counts, before)
	}
}
