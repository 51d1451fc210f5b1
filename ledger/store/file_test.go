package store

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

var bucket = []byte("b")

func testOptions() Options {
	return Options{
		Init:   func(tx *bolt.Tx) error { _, err := tx.CreateBucket(bucket); return err },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

func openTest(t *testing.T, dir string, opts Options) *File {
	t.Helper()
	f, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func put(f *File, k, v string) error {
	return f.Update(func(tx *bolt.Tx) error { return Put(tx.Bucket(bucket), []byte(k), []byte(v)) })
}

func get(t *testing.T, f *File, k string) string {
	t.Helper()
	v, err := read(f, k)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// read is get for any goroutine: the value, or the error.
func read(f *File, k string) (string, error) {
	var v []byte
	err := f.View(func(tx *bolt.Tx) (err error) {
		v, err = Get(tx.Bucket(bucket), []byte(k), k)
		v = bytes.Clone(v)
		return err
	})
	return string(v), err
}

// An existing empty file is a damaged ledger, not a first start: Open refuses it, names it,
// says how to recover and does not write to it. (bbolt alone initialises a 0-byte file, which is
// how state was once wiped.) Only a missing file is created.
func TestOpenEmptyFileRefused(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Open(dir, testOptions())
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Path != path || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Open of an empty file: %v, want a *CorruptError naming %s", err, path)
	}
	for _, want := range []string{"empty (0 bytes)", "mv " + path, "cfguard restore"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if fi, _ := os.Stat(path); fi.Size() != 0 {
		t.Fatalf("the empty file now has %d bytes", fi.Size())
	}
	os.Remove(path)
	f, err := Open(dir, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	if !f.Created() {
		t.Error("Created() = false after creating a missing file")
	}
	if err := put(f, "k", "v"); err != nil {
		t.Fatalf("the bucket Init made: %v", err)
	}
	f.Close()
	f = openTest(t, dir, testOptions())
	if f.Created() {
		t.Error("Created() = true when opening an existing file")
	}
	if got := get(t, f, "k"); got != "v" {
		t.Errorf("after reopening: %q, want v", got)
	}
	if left := temporaries(path); len(left) != 0 {
		t.Errorf("creation left temporary files: %v", left)
	}
}

// A second Open of the same state directory fails at once with ErrLocked naming the file and
// this process, in the same process (flock is per open file description).
func TestSecondOpenLockedAtOnce(t *testing.T) {
	dir := t.TempDir()
	f, err := Open(dir, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	// f holds the lock until the test ends: Open returns at all only because it does not wait
	// for it, and ErrLocked comes only from a lock attempt that would have blocked (LOCK_NB).
	_, err = Open(dir, testOptions())
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second Open: %v, want ErrLocked", err)
	}
	if msg := err.Error(); !strings.Contains(msg, f.Path()) || !strings.Contains(msg, strconv.Itoa(os.Getpid())) {
		t.Errorf("ErrLocked does not name the file and pid %d: %v", os.Getpid(), err)
	}
	if _, err := Verify(f.Path(), func(*bolt.Tx) error { return nil }); !errors.Is(err, ErrLocked) {
		t.Errorf("Verify of an open file: %v, want ErrLocked", err)
	}
	f.Close()
	f2, err := Open(dir, testOptions())
	if err != nil {
		t.Fatalf("Open after Close: %v", err)
	}
	f2.Close()
}

const lockHolderEnv = "CFGUARD_STORE_LOCK_DIR"

// TestLockHolder is the child of TestLockedByAnotherProcess: it opens the file, says so, and
// holds it until its stdin closes.
func TestLockHolder(t *testing.T) {
	dir := os.Getenv(lockHolderEnv)
	if dir == "" {
		t.Skip("child process of TestLockedByAnotherProcess")
	}
	f, err := Open(dir, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fmt.Println("holding")
	bufio.NewReader(os.Stdin).ReadString('\n')
}

func TestLockedByAnotherProcess(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestLockHolder$", "-test.count=1")
	cmd.Env = append(os.Environ(), lockHolderEnv+"="+dir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	sc := bufio.NewScanner(stdout)
	for sc.Scan() && sc.Text() != "holding" {
	}
	// The child holds the lock until the test ends: Open returns at all only because it does not
	// wait for it.
	_, err = Open(dir, testOptions())
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("Open while another process holds the file: %v, want ErrLocked", err)
	}
	if !strings.Contains(err.Error(), "pid "+strconv.Itoa(cmd.Process.Pid)) {
		t.Errorf("ErrLocked does not name the holder, pid %d: %v", cmd.Process.Pid, err)
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("lock holder: %v", err)
	}
	f, err := Open(dir, testOptions())
	if err != nil {
		t.Fatalf("Open after the holder exited: %v", err)
	}
	f.Close()
}

// A commit that fails after bbolt wrote it (as a failed final fsync does) is ErrWrite and leaves
// nothing of itself: the File reads what it held before, the file on disk does too, and the next
// commit succeeds.
func TestFailedCommitLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	opts := testOptions()
	var fail error
	opts.AfterCommit = func() error { return fail }
	f := openTest(t, dir, opts)
	if err := put(f, "k", "before"); err != nil {
		t.Fatal(err)
	}
	fail = errors.New("injected fsync failure")
	if err := put(f, "k", "lost"); !errors.Is(err, ErrWrite) || !errors.Is(err, fail) {
		t.Fatalf("a failed commit: %v, want ErrWrite wrapping the failure", err)
	}
	fail = nil
	if got := get(t, f, "k"); got != "before" {
		t.Fatalf("after a failed commit the File reads %q, want before", got)
	}
	if err := put(f, "other", "v"); err != nil {
		t.Fatalf("the commit after a failed one: %v", err)
	}
	f.Close()
	f = openTest(t, dir, testOptions())
	if got := get(t, f, "k"); got != "before" {
		t.Fatalf("after reopening the file reads %q, want before", got)
	}
	if got := get(t, f, "other"); got != "v" {
		t.Fatalf("after reopening the file reads %q for the later commit, want v", got)
	}
}

// A View that starts while a commit is written but its final fsync has not returned (AfterCommit
// stands for that fsync) does not read the commit: it waits for the outcome, then reads what the
// file holds for good, the value before a commit that failed and the new one of a commit that
// succeeded.
func TestViewWaitsForTheCommitsOutcome(t *testing.T) {
	for _, c := range []struct {
		name string
		fail error
		want string
	}{
		{"failed", errors.New("injected: the commit's final fsync failed"), "before"},
		{"succeeded", nil, "after"},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := testOptions()
			var hook func() error
			opts.AfterCommit = func() error {
				if hook != nil {
					return hook()
				}
				return nil
			}
			f := openTest(t, t.TempDir(), opts)
			if err := put(f, "k", "before"); err != nil {
				t.Fatal(err)
			}
			got := make(chan string, 1)
			early := ""
			hook = func() error {
				// The commit is in the file (bbolt wrote its meta page); a View now would read
				// it. It must wait until this returns.
				go func() {
					v, err := read(f, "k")
					if err != nil {
						v = err.Error()
					}
					got <- v
				}()
				for f.ViewsWaiting() == 0 && early == "" {
					select {
					case early = <-got:
					case <-time.After(time.Millisecond):
					}
				}
				return c.fail
			}
			if err := put(f, "k", "after"); !errors.Is(err, c.fail) || (c.fail == nil) != (err == nil) {
				t.Fatalf("the commit: %v, want %v", err, c.fail)
			}
			hook = nil
			if early != "" {
				t.Fatalf("a View during the commit read %q before the commit's outcome", early)
			}
			if v := <-got; v != c.want {
				t.Fatalf("the View that waited read %q, want %q", v, c.want)
			}
			if n := f.ViewsWaiting(); n != 0 {
				t.Fatalf("%d Views still waiting", n)
			}
		})
	}
}

// A damaged value is a *CorruptError naming the file, from View as from Get.
func TestDamagedValueNamesTheFile(t *testing.T) {
	f := openTest(t, t.TempDir(), testOptions())
	err := f.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put([]byte("k"), []byte("not sealed")) })
	if err != nil {
		t.Fatal(err)
	}
	err = f.View(func(tx *bolt.Tx) error { _, err := Get(tx.Bucket(bucket), []byte("k"), `value "k"`); return err })
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Path != f.Path() || !strings.Contains(err.Error(), `value "k": checksum mismatch`) {
		t.Fatalf("a damaged value: %v, want a *CorruptError naming %s and the value", err, f.Path())
	}
}

// recorder keeps the level and message of every log record.
type recorder struct {
	mu    *sync.Mutex
	lines *[]string
}

func (h recorder) Enabled(context.Context, slog.Level) bool { return true }
func (h recorder) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h recorder) WithGroup(string) slog.Handler            { return h }
func (h recorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	*h.lines = append(*h.lines, r.Level.String()+" "+r.Message)
	return nil
}

// count is the number of records at level whose message starts with prefix.
func (h recorder) count(level slog.Level, prefix string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, l := range *h.lines {
		if strings.HasPrefix(l, level.String()+" "+prefix) {
			n++
		}
	}
	return n
}

// Failures and successes that alternate (a full disk where small commits still reuse pages the
// file holds) are one episode: one WARN at its first failure, one INFO at the first success a
// FailureQuiet after its last failure, and the failures in between at debug level.
func TestAlternatingFailuresAreOneEpisode(t *testing.T) {
	opts := testOptions()
	rec := recorder{mu: new(sync.Mutex), lines: new([]string)}
	opts.Logger = slog.New(rec)
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	now := start
	opts.Now = func() time.Time { return now }
	var fail error
	opts.AfterCommit = func() error { return fail }
	f := openTest(t, t.TempDir(), opts)
	step := func(at time.Duration, failing bool, wantWarn, wantDebug, wantInfo int) {
		t.Helper()
		now, fail = start.Add(at), nil
		if failing {
			fail = errors.New("injected: no space left on device")
		}
		if err := put(f, "k", at.String()); (err != nil) != failing {
			t.Fatalf("commit at %v: %v, want failing %v", at, err, failing)
		}
		w, d := rec.count(slog.LevelWarn, "ledger: commit failed"), rec.count(slog.LevelDebug, "ledger: commit failed")
		i := rec.count(slog.LevelInfo, "ledger: commits succeed again")
		if w != wantWarn || d != wantDebug || i != wantInfo {
			t.Fatalf("after the commit at %v (failing %v): %d WARN, %d debug failure lines, %d INFO; want %d, %d, %d",
				at, failing, w, d, i, wantWarn, wantDebug, wantInfo)
		}
	}
	step(0, true, 1, 0, 0)
	step(10*time.Second, false, 1, 0, 0)
	step(20*time.Second, true, 1, 1, 0)
	step(30*time.Second, false, 1, 1, 0)
	step(20*time.Second+FailureQuiet-time.Millisecond, false, 1, 1, 0)
	step(20*time.Second+FailureQuiet, false, 1, 1, 1)
	step(90*time.Second, false, 1, 1, 1)
	step(100*time.Second, true, 2, 1, 1)
	// A success within the minute leaves the episode open; a failure an idle hour later begins
	// another.
	step(110*time.Second, false, 2, 1, 1)
	step(time.Hour, true, 3, 1, 1)
	if got := f.WriteFailures(); got.Count != 4 || !got.At.Equal(now) {
		t.Fatalf("WriteFailures: %+v, want 4, the latest at %v", got, now)
	}
}

// TestOpenRemovesLeftoversOfAnInterruptedCreation: a creation interrupted before its link leaves
// cfguard.db.new-<pid>; the next Open that creates the file (under the directory's lock, so the
// leftover is no other process's work in progress) removes it, and touches nothing else.
func TestOpenRemovesLeftoversOfAnInterruptedCreation(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	leftover, other := path+".new-999999", filepath.Join(dir, "cfguard.db.damaged")
	for _, p := range []string{leftover, other} {
		if err := os.WriteFile(p, []byte("half a ledger"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f := openTest(t, dir, testOptions())
	if !f.Created() {
		t.Fatal("Open did not create the missing file")
	}
	if _, err := os.Stat(leftover); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the leftover %s is still there: %v", leftover, err)
	}
	if b, err := os.ReadFile(other); err != nil || string(b) != "half a ledger" {
		t.Errorf("another file of the directory changed: %q, %v", b, err)
	}
}

// TestFailureExactlyAQuietAfterTheLastBeginsAnEpisode: a failure FailureQuiet or more after the
// previous one (with no success between) begins a new episode, logged at WARN; one a moment
// sooner is part of the same episode, at debug level.
func TestFailureExactlyAQuietAfterTheLastBeginsAnEpisode(t *testing.T) {
	opts := testOptions()
	rec := recorder{mu: new(sync.Mutex), lines: new([]string)}
	opts.Logger = slog.New(rec)
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	now := start
	opts.Now = func() time.Time { return now }
	opts.AfterCommit = func() error { return errors.New("injected: no space left on device") }
	f := openTest(t, t.TempDir(), opts)
	for i, tc := range []struct {
		at              time.Duration
		wantWarn, wantD int
	}{
		{0, 1, 0},
		{FailureQuiet - time.Millisecond, 1, 1},
		{2*FailureQuiet - time.Millisecond, 2, 1}, // exactly FailureQuiet after the previous failure
	} {
		now = start.Add(tc.at)
		if err := put(f, "k", "v"); !errors.Is(err, ErrWrite) {
			t.Fatalf("commit %d: %v, want ErrWrite", i, err)
		}
		w, d := rec.count(slog.LevelWarn, "ledger: commit failed"), rec.count(slog.LevelDebug, "ledger: commit failed")
		if w != tc.wantWarn || d != tc.wantD {
			t.Fatalf("after the failure at %v: %d WARN, %d debug; want %d, %d", tc.at, w, d, tc.wantWarn, tc.wantD)
		}
	}
}

// TestLockFileHoldsThePid: the lock file holds exactly the pid of the process that has the
// ledger open, whatever a previous holder left in it (a longer pid, a crashed process's line),
// so that ErrLocked names the holder; and a second Open in this process says it is this one.
func TestLockFileHoldsThePid(t *testing.T) {
	dir := t.TempDir()
	pidPath := filepath.Join(dir, PIDFileName)
	if err := os.WriteFile(pidPath, []byte("4194304123\nleft by a crashed holder\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := openTest(t, dir, testOptions())
	if b, err := os.ReadFile(pidPath); err != nil || string(b) != strconv.Itoa(os.Getpid())+"\n" {
		t.Fatalf("the lock file holds %q (%v), want this process's pid and a newline", b, err)
	}
	_, err := Open(dir, testOptions())
	want := fmt.Sprintf("this process (pid %d) already has %s open (lock file %s): use that Ledger, or Close it first", os.Getpid(), f.Path(), pidPath)
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), want) {
		t.Fatalf("a second Open in this process: %v, want ErrLocked saying %q", err, want)
	}
}

// TestRefusedUpdateIsNoWriteFailure: an Update whose function refuses (an invalid request, a
// damaged record found while writing) is rolled back and returns that error as it is: it is not
// a failed commit (ErrWrite), is not counted among the write failures, and logs nothing.
func TestRefusedUpdateIsNoWriteFailure(t *testing.T) {
	opts := testOptions()
	rec := recorder{mu: new(sync.Mutex), lines: new([]string)}
	opts.Logger = slog.New(rec)
	f := openTest(t, t.TempDir(), opts)
	logged := func() []string { rec.mu.Lock(); defer rec.mu.Unlock(); return append([]string(nil), *rec.lines...) }
	before := len(logged())
	refused := errors.New("refused by fn")
	err := f.Update(func(tx *bolt.Tx) error {
		if err := Put(tx.Bucket(bucket), []byte("k"), []byte("rolled back")); err != nil {
			return err
		}
		return refused
	})
	if !errors.Is(err, refused) || errors.Is(err, ErrWrite) {
		t.Fatalf("Update whose fn refused: %v, want that error and no ErrWrite", err)
	}
	if n := f.WriteFailures().Count; n != 0 {
		t.Errorf("a refused Update counted as %d write failures", n)
	}
	if lines := logged(); len(lines) != before {
		t.Errorf("a refused Update logged %q", lines[before:])
	}
	if got := get(t, f, "k"); got != "" {
		t.Errorf("the refused Update's value reads %q", got)
	}
}

// TestLockedWithoutAPid: a lock held by a process that has not written its pid (the lock taken,
// the pid not yet written) gives ErrLocked saying no pid is recorded, not an empty "pid ".
func TestLockedWithoutAPid(t *testing.T) {
	dir := t.TempDir()
	h, err := os.OpenFile(filepath.Join(dir, PIDFileName), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := syscall.Flock(int(h.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	_, err = Open(dir, testOptions())
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "no pid recorded") || strings.Contains(err.Error(), "(pid ") {
		t.Fatalf("Open beside a lock holder that wrote no pid: %v, want ErrLocked saying no pid is recorded", err)
	}
}

// TestOpenInitFailureCreatesNothing: when Init fails, Open returns its error and leaves no
// cfguard.db (a half-initialised ledger would open as an existing one) and no temporary file.
func TestOpenInitFailureCreatesNothing(t *testing.T) {
	dir := t.TempDir()
	opts := testOptions()
	refused := errors.New("injected: Init failed")
	opts.Init = func(*bolt.Tx) error { return refused }
	if _, err := Open(dir, opts); !errors.Is(err, refused) {
		t.Fatalf("Open with a failing Init: %v, want its error", err)
	}
	path := filepath.Join(dir, FileName)
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed Init left %s: %v", path, err)
	}
	if left := temporaries(path); len(left) != 0 {
		t.Errorf("a failed Init left temporary files: %v", left)
	}
}

// TestClosedFile: Close is idempotent (a second Close returns nil), and View and Update on a
// closed File return ErrClosed at once.
func TestClosedFile(t *testing.T) {
	f, err := Open(t.TempDir(), testOptions())
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("a second Close: %v, want nil", err)
	}
	if _, err := read(f, "k"); !errors.Is(err, ErrClosed) {
		t.Errorf("View after Close: %v, want ErrClosed", err)
	}
	if err := put(f, "k", "v"); !errors.Is(err, ErrClosed) {
		t.Errorf("Update after Close: %v, want ErrClosed", err)
	}
}

// TestPanicIsCorruptAndReopens: a panic inside a View or an Update (what bbolt does on a
// damaged page) is a *CorruptError naming the file, and the File reopens the file (a new bbolt
// handle, after the checks) before its next operation, which succeeds.
func TestPanicIsCorruptAndReopens(t *testing.T) {
	for _, c := range []struct {
		name string
		run  func(f *File, fn func(*bolt.Tx) error) error
	}{
		{"View", (*File).View},
		{"Update", (*File).Update},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := openTest(t, t.TempDir(), testOptions())
			if err := put(f, "k", "v"); err != nil {
				t.Fatal(err)
			}
			f.mu.RLock()
			before := f.db
			f.mu.RUnlock()
			err := c.run(f, func(*bolt.Tx) error { panic("injected: assertion failed") })
			var ce *CorruptError
			if !errors.As(err, &ce) || ce.Path != f.Path() || !strings.Contains(err.Error(), "injected: assertion failed") {
				t.Fatalf("%s that panicked: %v, want a *CorruptError naming %s and the panic", c.name, err, f.Path())
			}
			f.mu.RLock()
			after := f.db
			f.mu.RUnlock()
			if after == before {
				t.Errorf("the File kept its bbolt handle after a panic in %s", c.name)
			}
			if got := get(t, f, "k"); got != "v" {
				t.Errorf("after the panic the File reads %q, want v", got)
			}
		})
	}
}

// metaPages is the bytes of the two meta pages of the file at path.
func metaPages(t *testing.T, path string) []byte {
	t.Helper()
	fh, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	lo, err := Inspect(fh)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 2*lo.PageSize)
	if _, err := fh.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestFailedCommitRestoresTheMetaPage: after a commit that failed once its meta page was
// written, both meta pages hold, byte for byte, what they held before the call: the page the
// commit overwrote is the one put back.
func TestFailedCommitRestoresTheMetaPage(t *testing.T) {
	opts := testOptions()
	var fail error
	opts.AfterCommit = func() error { return fail }
	f := openTest(t, t.TempDir(), opts)
	for _, v := range []string{"1", "2"} {
		if err := put(f, "k", v); err != nil {
			t.Fatal(err)
		}
	}
	before := metaPages(t, f.Path())
	fail = errors.New("injected fsync failure")
	if err := put(f, "k", "lost"); !errors.Is(err, ErrWrite) {
		t.Fatalf("a failed commit: %v, want ErrWrite", err)
	}
	if after := metaPages(t, f.Path()); !bytes.Equal(before, after) {
		t.Fatal("after a failed commit the meta pages differ from what they were before it")
	}
}

// TestFailedCommitThatTornItsMetaPage: a commit that fails after writing part of its meta page
// leaves a damaged page where the newest transaction would be, which a file read cold refuses
// (it may hold an acknowledged transaction). This File reported that commit failed and saved the
// page it overwrote, so it puts that page back: the failed Update is a write failure, not a
// damaged ledger, the next View reads the last committed value, and the meta pages are as
// before the commit, which later commits go on from.
func TestFailedCommitThatTornItsMetaPage(t *testing.T) {
	opts := testOptions()
	var hook func() error
	opts.AfterCommit = func() error {
		if hook != nil {
			return hook()
		}
		return nil
	}
	f := openTest(t, t.TempDir(), opts)
	for _, v := range []string{"1", "2"} {
		if err := put(f, "k", v); err != nil {
			t.Fatal(err)
		}
	}
	before := metaPages(t, f.Path())
	ps := f.geom.pageSize
	hook = func() error {
		data, err := os.ReadFile(f.Path())
		if err != nil {
			return err
		}
		_, newest := metaTxids(t, f.Path(), ps)
		data[newest*ps+16+40] ^= 0xff // inside the meta's fields: its checksum no longer holds
		if err := os.WriteFile(f.Path(), data, 0o600); err != nil {
			return err
		}
		return errors.New("injected write failure")
	}
	err := put(f, "k", "lost")
	hook = nil
	if !errors.Is(err, ErrWrite) || errors.Is(err, ErrCorrupt) {
		t.Fatalf("the failed commit: %v, want ErrWrite and no damaged ledger", err)
	}
	if v, err := read(f, "k"); err != nil || v != "2" {
		t.Fatalf("a View after it: %q, %v; want the last committed value", v, err)
	}
	if after := metaPages(t, f.Path()); !bytes.Equal(before, after) {
		t.Fatal("after the failed commit the meta pages differ from what they were before it")
	}
	if err := put(f, "k", "3"); err != nil {
		t.Fatal(err)
	}
	if v, err := read(f, "k"); err != nil || v != "3" {
		t.Fatalf("after a later commit: %q, %v", v, err)
	}
}

// TestRestoreMeta: the meta page a failed commit overwrote is put back only when the file shows
// that very commit, in the page it was written to, and the saved page has the file's page size;
// otherwise the file is left as it is and the mismatch is an error wrapping ErrCorrupt. After
// putting the page back the geometry returned is the file's read again, not the failed one's.
func TestRestoreMeta(t *testing.T) {
	data, lo := walkFixture(t)
	ps, slot := lo.PageSize, lo.MetaPage
	other := append([]byte(nil), data[(1-slot)*ps:(2-slot)*ps]...) // transaction TxID-1
	refused := "after a failed commit of transaction"
	for _, c := range []struct {
		name     string
		pending  metaRestore
		wantErr  string
		wantTxid uint64 // when the page is put back or nothing is to be done
		restored bool
	}{
		{"the failed commit in the file", metaRestore{lo.TxID, slot, other}, "", lo.TxID - 1, true},
		{"the failed commit never reached the file", metaRestore{lo.TxID + 1, 1 - slot, other}, "", lo.TxID, false},
		{"an older transaction in its page", metaRestore{lo.TxID - 2, slot, other}, refused, 0, false},
		{"the failed commit in the other page", metaRestore{lo.TxID, 1 - slot, other}, refused, 0, false},
		{"a saved page of another size", metaRestore{lo.TxID, slot, other[:ps/2]}, refused, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), FileName)
			if err := os.WriteFile(path, data, 0o600); err != nil {
				t.Fatal(err)
			}
			fh, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			g, err := readMetas(fh)
			if err != nil {
				t.Fatal(err)
			}
			pending := c.pending
			s := &File{path: path, log: testOptions().Logger, pending: &pending}
			g, err = s.restoreMeta(fh, g, nil)
			got, rerr := os.ReadFile(path)
			if rerr != nil {
				t.Fatal(rerr)
			}
			if c.wantErr != "" {
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("restoreMeta: %v, want an error wrapping ErrCorrupt saying %q", err, c.wantErr)
				}
				if !bytes.Equal(got, data) {
					t.Fatal("a refused restore wrote to the file")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if g.meta.txid != c.wantTxid || s.pending != nil {
				t.Errorf("restoreMeta: transaction %d, pending %v; want %d and nothing pending", g.meta.txid, s.pending, c.wantTxid)
			}
			if wrote := !bytes.Equal(got, data); wrote != c.restored {
				t.Errorf("restoreMeta wrote to the file: %v, want %v", wrote, c.restored)
			}
			if c.restored && !bytes.Equal(got[slot*ps:(slot+1)*ps], other) {
				t.Errorf("meta page %d is not the saved page", slot)
			}
		})
	}
}

// TestRestoreMetaOverATornPage: with the file refused by readMetas (readErr), the saved page is
// put back only when the refusal is the failed commit's own torn page: a damaged page in the slot
// the commit wrote, beside a valid transaction one before it, and a saved page of the file's page
// size. Otherwise readErr is returned and nothing is written.
func TestRestoreMetaOverATornPage(t *testing.T) {
	data, lo := walkFixture(t)
	ps, slot := lo.PageSize, lo.MetaPage
	saved := append([]byte(nil), data[(1-slot)*ps:(2-slot)*ps]...)
	readErr := Corruptf("bbolt meta page %d is damaged", 1-slot)
	torn := metaPage{read: true, why: "checksum"}
	for _, c := range []struct {
		name     string
		pending  metaRestore
		other    metaPage
		restored bool
	}{
		{"the failed commit's torn page", metaRestore{lo.TxID + 1, 1 - slot, saved}, torn, true},
		{"a commit two transactions on", metaRestore{lo.TxID + 2, 1 - slot, saved}, torn, false},
		{"the commit wrote the valid page's slot", metaRestore{lo.TxID + 1, slot, saved}, torn, false},
		{"a saved page of another size", metaRestore{lo.TxID + 1, 1 - slot, saved[:ps/2]}, torn, false},
		{"the other page past the file's end", metaRestore{lo.TxID + 1, 1 - slot, saved}, metaPage{why: "beyond the end of the file"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), FileName)
			if err := os.WriteFile(path, data, 0o600); err != nil {
				t.Fatal(err)
			}
			fh, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			g, err := readMetas(fh)
			if err != nil {
				t.Fatal(err)
			}
			g.other = c.other // as readMetas finds the page the commit tore
			pending := c.pending
			s := &File{path: path, log: testOptions().Logger, pending: &pending}
			g, err = s.restoreMeta(fh, g, readErr)
			got, rerr := os.ReadFile(path)
			if rerr != nil {
				t.Fatal(rerr)
			}
			if !c.restored {
				if err != readErr || !bytes.Equal(got, data) {
					t.Fatalf("restoreMeta: %v, wrote %v; want readErr and nothing written", err, !bytes.Equal(got, data))
				}
				return
			}
			if err != nil || s.pending != nil || g.meta.txid != lo.TxID {
				t.Fatalf("restoreMeta: %v, pending %v, transaction %d; want the file read again at %d and nothing pending", err, s.pending, g.meta.txid, lo.TxID)
			}
		})
	}
}

// TestOpenRefusesADamagedFile: Open runs the structural checks before bbolt opens an existing
// file for writing: a damaged page tree, like a damaged newest meta page, is refused with a
// *CorruptError naming the file, saying what the check found and how to recover, and the file is
// left byte for byte as it was.
func TestOpenRefusesADamagedFile(t *testing.T) {
	data, lo := walkFixture(t)
	ps, newest := lo.PageSize, lo.MetaPage
	root := int(ne.Uint64(data[newest*ps+16+16:]))
	br := int(bucketRoot(data, lo))
	edit := func(f func(d []byte)) []byte {
		d := append([]byte(nil), data...)
		f(d)
		return d
	}
	for _, c := range []struct {
		name string
		data []byte
		want string
	}{
		{"newest meta page", edit(func(d []byte) { d[newest*ps+16+16] ^= 0x04 }), fmt.Sprintf("bbolt meta page %d is damaged (checksum mismatch)", newest)},
		{"page id", edit(func(d []byte) { ne.PutUint64(d[root*ps:], uint64(root+1)) }), fmt.Sprintf("bbolt page %d says it is page %d", root, root+1)},
		{"empty branch page", edit(func(d []byte) { ne.PutUint16(d[br*ps+10:], 0) }), fmt.Sprintf("bbolt branch page %d is empty", br)},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, FileName)
			if err := os.WriteFile(path, c.data, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := Open(dir, testOptions())
			var ce *CorruptError
			if !errors.As(err, &ce) || ce.Path != path || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "mv "+path) {
				t.Fatalf("Open: %v, want a *CorruptError naming %s, saying %q and how to recover", err, path, c.want)
			}
			if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, c.data) {
				t.Fatalf("the refused file changed (%v)", err)
			}
		})
	}
}

// TestOpenBesideAnotherLockOnTheFile: a process that holds a lock on cfguard.db itself, not on
// the state directory's lock file (a Verify of it, bbolt's own tools), makes Open fail at once
// with ErrLocked naming the file, before bbolt opens it.
func TestOpenBesideAnotherLockOnTheFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	data, _ := walkFixture(t)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	held, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if err := syscall.Flock(int(held.Fd()), syscall.LOCK_SH|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	_, err = Open(dir, testOptions())
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "another process holds bbolt's lock on "+path) {
		t.Fatalf("Open of a file another handle has locked: %v, want ErrLocked naming %s", err, path)
	}
	held.Close()
	f := openTest(t, dir, testOptions())
	if got := get(t, f, "key-0000"); got != "value 0 of round 1" {
		t.Fatalf("once the other lock is gone the file reads %q", got)
	}
}

// TestOpenKeepsAFileThatAppearsDuringCreation: Open links the file it built under a temporary
// name into place only if no cfguard.db appeared meanwhile (put there by another program that
// does not take the state directory's lock; here, by Init): that file is kept, not replaced,
// Created reports false, the File reads it, and the temporary file is removed.
func TestOpenKeepsAFileThatAppearsDuringCreation(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	data, _ := walkFixture(t)
	opts := testOptions()
	init := opts.Init
	opts.Init = func(tx *bolt.Tx) error {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return err
		}
		return init(tx)
	}
	f := openTest(t, dir, opts)
	if f.Created() {
		t.Error("Created() = true, though the file in place is not the one Open built")
	}
	if got := get(t, f, "key-0000"); got != "value 0 of round 1" {
		t.Fatalf("the File reads %q, want the file that appeared", got)
	}
	if left := temporaries(path); len(left) != 0 {
		t.Errorf("creation left temporary files: %v", left)
	}
}

// TestOpenWarnsOfADamagedOlderMetaPage: a file whose older meta page is damaged (the newest
// transaction whole) opens, reads its newest transaction, and Open logs one WARN naming the
// damage; a sound file logs none.
func TestOpenWarnsOfADamagedOlderMetaPage(t *testing.T) {
	data, lo := walkFixture(t)
	older := 1 - lo.MetaPage
	damaged := append([]byte(nil), data...)
	damaged[older*lo.PageSize+16+16] ^= 0x04
	const warning = "ledger: the older of the two bbolt meta pages is damaged"
	for _, c := range []struct {
		name  string
		data  []byte
		warns int
	}{
		{"sound", data, 0},
		{"older meta page damaged", damaged, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, FileName), c.data, 0o600); err != nil {
				t.Fatal(err)
			}
			opts := testOptions()
			rec := recorder{mu: new(sync.Mutex), lines: new([]string)}
			opts.Logger = slog.New(rec)
			f := openTest(t, dir, opts)
			if got := get(t, f, "key-0299"); got != "value 299 of round 1" {
				t.Fatalf("the File reads %q, want the newest transaction's value", got)
			}
			if n := rec.count(slog.LevelWarn, warning); n != c.warns {
				t.Fatalf("%d WARNs %q, want %d", n, warning, c.warns)
			}
		})
	}
}

// TestFailedCommitBesideAnotherWriterNamesTheFile: when the file reread after a failed commit
// shows a transaction this File did not write (another program wrote to the file), the meta page
// is not put back and nothing is written; the error, from the failed Update and from the View
// after it, is a *CorruptError naming the file and how to recover.
func TestFailedCommitBesideAnotherWriterNamesTheFile(t *testing.T) {
	opts := testOptions()
	var hook func() error
	opts.AfterCommit = func() error {
		if hook != nil {
			return hook()
		}
		return nil
	}
	f := openTest(t, t.TempDir(), opts)
	if err := put(f, "k", "before"); err != nil {
		t.Fatal(err)
	}
	ps := f.geom.pageSize
	var after []byte
	hook = func() error {
		// Another writer's transaction, one later than the failing commit, in the other meta page.
		data, err := os.ReadFile(f.Path())
		if err != nil {
			return err
		}
		txids, newest := metaTxids(t, f.Path(), ps)
		other := 1 - newest
		copy(data[other*ps:(other+1)*ps], data[newest*ps:(newest+1)*ps])
		ne.PutUint64(data[other*ps:], uint64(other))
		ne.PutUint64(data[other*ps+16+48:], txids[newest]+1)
		resealMeta(data, other, ps)
		if err := os.WriteFile(f.Path(), data, 0o600); err != nil {
			return err
		}
		after = data
		return errors.New("injected fsync failure")
	}
	err := put(f, "k", "lost")
	hook = nil
	var ce *CorruptError
	if !errors.Is(err, ErrWrite) || !errors.As(err, &ce) || ce.Path != f.Path() {
		t.Fatalf("the failed commit: %v, want ErrWrite and a *CorruptError naming %s", err, f.Path())
	}
	_, err = read(f, "k")
	if !errors.As(err, &ce) || ce.Path != f.Path() || !strings.Contains(err.Error(), "after a failed commit of transaction") ||
		!strings.Contains(err.Error(), "mv "+f.Path()) {
		t.Fatalf("a View after it: %v, want a *CorruptError naming %s and how to recover", err, f.Path())
	}
	if got, err := os.ReadFile(f.Path()); err != nil || !bytes.Equal(got, after) {
		t.Fatalf("the file changed after the other writer's transaction (%v)", err)
	}
}
