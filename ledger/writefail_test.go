package ledger

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// writeState is what a failed write must leave unchanged.
func writeState(t testing.TB, l *Ledger) string {
	t.Helper()
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	st.Generation = 0 // not part of the contract
	var ids []string
	for after := ""; ; {
		page, err := l.List(0, 10000, after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			break
		}
		for _, ce := range page {
			ids = append(ids, fmt.Sprintf("%s:%v", ce.ID, ce.Status))
		}
		after = page[len(page)-1].ID
	}
	out, err := l.Outbox(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := l.Current()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal([]any{st, ids, len(out), cur.Version, cur.Last().BiasMu})
	return string(b)
}

// failedWriteScenario runs against a ledger in dir: fill makes writes fail with a real kernel
// error, free lets them succeed again. Every failed write must return ErrWrite and leave the
// state exactly as before; the ledger must keep working; after free, the same checkpoint
// succeeds once: nothing lost, nothing doubled; the file then verifies.
func failedWriteScenario(t testing.TB, dir string, fill, free func(), wantErrno syscall.Errno) {
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(41, 41))
	batch := func(n int) []*CE {
		var ces []*CE
		for i := 0; i < n; i++ {
			ces = append(ces, newCE(t, m, rng))
		}
		return ces
	}
	if err := l.Put(bg, batch(100)...); err != nil {
		t.Fatal(err)
	}
	next := func(cur uint64) *Checkpoint {
		mm := drift(m, -0.0004*float64(cur%5))
		mm.Version = cur + 1
		return &Checkpoint{Model: mm, Offsets: map[int]int64{0: offsetFor(cur + 1)}, Applied: 1,
			Update: &UpdateRecord{Version: cur + 1, KL: 1e-6, Outcome: certify.OutcomePromoted},
			Events: []OutboxEntry{{Key: "update", Value: []byte(fmt.Sprintf("%d %0*d", cur+1, 16<<10, 0))}}} // grows the file
	}
	version := m.Version
	for i := 0; i < 3; i++ {
		if _, _, err := l.Commit(bg, next(version)); err != nil {
			t.Fatal(err)
		}
		version++
	}
	fill()
	failures, successes := 0, 0
	var failed *Checkpoint
	for i := 0; i < 400 && failures < 3; i++ {
		before := writeState(t, l)
		var err error
		var cp *Checkpoint
		if i%2 == 0 {
			err = l.Put(bg, batch(40)...) // grows the file
		} else {
			cp = next(version)
			_, _, err = l.Commit(bg, cp)
		}
		switch {
		case err == nil:
			successes++
			if cp != nil {
				version++
			}
			continue
		case !errors.Is(err, ErrWrite):
			t.Fatalf("attempt %d failed without ErrWrite: %v", i, err)
		case !strings.Contains(err.Error(), wantErrno.Error()):
			t.Fatalf("attempt %d: ErrWrite does not carry %q: %v", i, wantErrno, err)
		}
		failures++
		if after := writeState(t, l); after != before {
			t.Fatalf("attempt %d failed (%v) but changed the state:\nbefore %.400s\nafter  %.400s", i, err, before, after)
		}
		if cp != nil {
			failed = cp
		}
		t.Logf("attempt %d failed as it should: %v", i, err)
	}
	if failures == 0 {
		t.Fatalf("no write failed after fill (%d succeeded): the scenario did not exhaust the space", successes)
	}
	if failed == nil {
		for i := 0; i < 50 && failed == nil; i++ {
			cp := next(version)
			if _, _, err := l.Commit(bg, cp); err != nil {
				failed = cp
			} else {
				version++
			}
		}
		if failed == nil {
			t.Fatal("no checkpoint failed")
		}
	}
	free()
	before, _ := l.State()
	beforeOut, _ := l.OutboxLen()
	if _, _, err := l.Commit(bg, failed); err != nil {
		t.Fatalf("the failed checkpoint after freeing space: %v", err)
	}
	after, _ := l.State()
	afterOut, _ := l.OutboxLen()
	if after.PosteriorVersion != failed.Model.Version || after.Offsets[0] != offsetFor(failed.Model.Version) ||
		after.Applied != before.Applied+1 || afterOut != beforeOut+1 {
		t.Fatalf("after the retried checkpoint: %+v (outbox %d), before %+v (outbox %d)", after, afterOut, before, beforeOut)
	}
	if err := l.Put(bg, batch(40)...); err != nil {
		t.Fatalf("put after freeing space: %v", err)
	}
	want := writeState(t, l)
	path := l.Path()
	l.Close()
	if _, err := Verify(path); err != nil {
		t.Fatalf("the file after failed writes: %v", err)
	}
	l2, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if got := writeState(t, l2); got != want {
		t.Fatalf("reopened state differs:\n got %.400s\nwant %.400s", got, want)
	}
	t.Logf("%d writes failed and changed nothing, %d succeeded while full; the retried checkpoint applied once", failures, successes)
}

// mountTmpfs mounts a tmpfs of size bytes at a new directory (root only); ok = false says why not.
func mountTmpfs(t *testing.T, size int) (string, error) {
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
		return "", err
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir, nil
}

// fillFS writes a file that leaves about `leave` bytes free on dir's file system.
func fillFS(t testing.TB, dir string, leave int64) string {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	free := int64(st.Bavail) * st.Bsize
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for n := free - leave; n > 0; n -= int64(len(buf)) {
		if _, err := f.Write(buf[:min(int64(len(buf)), n)]); err != nil {
			break
		}
	}
	return path
}

// A full file system (a real tmpfs, ENOSPC): failed writes change nothing, the ledger keeps
// working, and once space is freed the failed checkpoint applies exactly once.
func TestWriteFailsNoSpace(t *testing.T) {
	mnt, err := mountTmpfs(t, 8<<20)
	if err != nil {
		t.Skipf("cannot mount a tmpfs (%v); TestWriteFailsFileSizeLimit covers failed writes with RLIMIT_FSIZE", err)
	}
	dir := filepath.Join(mnt, "state")
	var filler string
	failedWriteScenario(t, dir, func() { filler = fillFS(t, mnt, 48<<10) }, func() {
		if err := os.Remove(filler); err != nil {
			t.Fatal(err)
		}
	}, syscall.ENOSPC)
}

const fsizeEnv = "CFGUARD_LEDGER_FSIZE_DIR"

// TestFileSizeLimitChild is the child of TestWriteFailsFileSizeLimit: it runs the scenario with
// RLIMIT_FSIZE as the kernel error (EFBIG), SIGXFSZ ignored.
func TestFileSizeLimitChild(t *testing.T) {
	dir := os.Getenv(fsizeEnv)
	if dir == "" {
		t.Skip("child process of TestWriteFailsFileSizeLimit")
	}
	signal.Ignore(syscall.SIGXFSZ)
	var orig syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &orig); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, FileName)
	failedWriteScenario(t, dir, func() {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		lim := syscall.Rlimit{Cur: uint64(fi.Size()) + 32<<10, Max: orig.Max}
		if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
			t.Fatal(err)
		}
	}, func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &orig); err != nil {
			t.Fatal(err)
		}
	}, syscall.EFBIG)
}

// The same scenario with the file size limit (works without mount privileges): a child process
// whose RLIMIT_FSIZE stops the ledger from growing.
func TestWriteFailsFileSizeLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process")
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestFileSizeLimitChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), fsizeEnv+"="+dir)
	out, err := cmd.CombinedOutput()
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if line := sc.Text(); strings.Contains(line, "failed as it should") || strings.Contains(line, "writes failed") || strings.Contains(line, "FAIL") {
			t.Log(line)
		}
	}
	if err != nil || !strings.Contains(string(out), "--- PASS: TestFileSizeLimitChild") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// A commit that bbolt reports as failed after its meta page reached the file (a failed final
// fsync leaves the page in the page cache, where any later read finds it). The seam is
// Ledger.failed, run after bbolt's commit returns: the commit really happened on disk, as in
// that case, and the ledger must still end up exactly as before: it puts the overwritten meta
// page back.
func TestFailedFinalSyncPutsMetaBack(t *testing.T) {
	l, dir := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(43, 43))
	var ces []*CE
	for i := 0; i < 50; i++ {
		ces = append(ces, newCE(t, m, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	commit(t, l, drift(m, -0.01), 1)
	before := writeState(t, l)
	injected := errors.New("injected: fdatasync: input/output error")
	l.opts.AfterCommit = func() error { return injected }
	next := drift(m, -0.02)
	next.Version = 2
	cp := &Checkpoint{Model: next, Offsets: map[int]int64{0: 99}, Applied: 7, Events: []OutboxEntry{{Key: "x"}}}
	_, _, err := l.Commit(bg, cp)
	l.opts.AfterCommit = nil
	if !errors.Is(err, ErrWrite) || !errors.Is(err, injected) {
		t.Fatalf("commit with a failed final sync: %v", err)
	}
	if after := writeState(t, l); after != before {
		t.Fatalf("the failed commit is visible:\nbefore %.400s\nafter  %.400s", before, after)
	}
	// The same holds for a fresh Open of the file (what a restart would read).
	l.Close()
	l2, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if after := writeState(t, l2); after != before {
		t.Fatalf("the failed commit is visible after reopening:\nbefore %.400s\nafter  %.400s", before, after)
	}
	if _, _, err := l2.Commit(bg, cp); err != nil {
		t.Fatalf("retrying: %v", err)
	}
	if st, _ := l2.State(); st.PosteriorVersion != 2 || st.Offsets[0] != 99 {
		t.Fatalf("after the retry: %+v", st)
	}
}

// Readers of the outbox while a commit's final fsync is failing (the commit is in the file, and
// a read transaction started now would see it) wait for the commit's outcome and hand out none of
// its entries (nor count them), so that the publisher never sends an event of a commit that did
// not happen. Once the retry succeeds, they are handed out.
func TestOutboxHidesAFailingCommit(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m := testModel(4)
	install(t, l, m)
	commit(t, l, drift(m, -0.01), 1)
	before, err := l.Outbox(0, 1000)
	if err != nil {
		t.Fatal(err)
	}
	inCommit, fail := make(chan struct{}), make(chan struct{})
	injected := errors.New("injected: fdatasync: input/output error")
	l.opts.AfterCommit = func() error { close(inCommit); <-fail; return injected }
	next := drift(m, -0.02)
	next.Version = 2
	cp := &Checkpoint{Model: next, Offsets: map[int]int64{0: 99}, Applied: 7, Events: []OutboxEntry{{Key: "phantom"}}}
	done := make(chan error, 1)
	go func() { _, _, err := l.Commit(bg, cp); done <- err }()
	<-inCommit // the commit is in the file; its final sync is failing
	var (
		seen, newest []OutboxEntry
		n            int
		st           State
		errs         [4]error
		reads        sync.WaitGroup
	)
	reads.Go(func() { seen, errs[0] = l.Outbox(0, 1000) })
	reads.Go(func() { newest, errs[1] = l.OutboxNewest(1000) })
	reads.Go(func() { n, errs[2] = l.OutboxLen() })
	reads.Go(func() { st, errs[3] = l.State() })
	// Each read's transaction starts while the commit is in the file: all four wait (reads that
	// do not wait end at once, and the checks below say what they read).
	ended := make(chan struct{})
	go func() { reads.Wait(); close(ended) }()
	waitfor.Cond(t, time.Minute, "the four reads waiting for the commit's outcome", func() bool {
		select {
		case <-ended:
			return true
		default:
			return l.file.ViewsWaiting() == 4
		}
	})
	close(fail)
	if err := <-done; !errors.Is(err, ErrWrite) || !errors.Is(err, injected) {
		t.Fatalf("commit with a failed final sync: %v", err)
	}
	reads.Wait()
	l.opts.AfterCommit = nil
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(seen) != len(before) || n != len(before) || st.OutboxLen != len(before) {
		t.Errorf("during the failing commit: Outbox %d entries, OutboxLen %d, State().OutboxLen %d; want the %d before it", len(seen), n, st.OutboxLen, len(before))
	}
	for _, e := range append(seen, newest...) {
		if e.Key == "phantom" {
			t.Errorf("Outbox or OutboxNewest handed out %+v of the failing commit", e)
		}
	}
	if _, _, err := l.Commit(bg, cp); err != nil {
		t.Fatalf("retrying: %v", err)
	}
	after, err := l.Outbox(0, 1000)
	if err != nil || len(after) != len(before)+1 || after[len(after)-1].Key != "phantom" {
		t.Fatalf("after the retry: %d entries (%v), want %d ending with the retried commit's", len(after), err, len(before)+1)
	}
	if newest, err := l.OutboxNewest(1); err != nil || len(newest) != 1 || newest[0].Key != "phantom" {
		t.Fatalf("OutboxNewest after the retry: %+v (%v), want the retried commit's event first", newest, err)
	}
}

// A real failed fsync: the ledger on an ext2 file system whose loop device's backing file is on
// a tmpfs that fills up. Writes land in the page cache (ext2 has room), but writing them back to
// the full backing file fails, so fdatasync returns ENOSPC while the data stays in the page
// cache: the case of a commit whose written pages every later read would see. Needs root,
// losetup and mkfs.ext2; skipped otherwise.
func TestWriteFailsFsync(t *testing.T) {
	if testing.Short() {
		t.Skip("mounts a loop device")
	}
	back, err := mountTmpfs(t, 24<<20)
	if err != nil {
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	img := filepath.Join(back, "fs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	run := func(name string, args ...string) (string, error) {
		out, err := exec.Command(name, args...).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	if out, err := run("mkfs.ext2", "-q", "-F", img); err != nil {
		t.Skipf("mkfs.ext2: %v %s", err, out)
	}
	dev, err := run("losetup", "-f", "--show", img)
	if err != nil {
		t.Skipf("losetup: %v %s", err, dev)
	}
	t.Cleanup(func() {
		if out, err := run("losetup", "-d", dev); err != nil {
			t.Errorf("losetup -d %s: %v %s", dev, err, out)
		}
	})
	fs := filepath.Join(t.TempDir(), "ext2")
	if err := os.Mkdir(fs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount(dev, fs, "ext2", 0, "errors=continue"); err != nil {
		t.Skipf("mount %s: %v", dev, err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(fs, 0); err != nil {
			t.Errorf("unmount %s: %v", fs, err)
		}
	})
	var filler string
	failedWriteScenario(t, filepath.Join(fs, "state"), func() { filler = fillFS(t, back, 16<<10) }, func() {
		if err := os.Remove(filler); err != nil {
			t.Fatal(err)
		}
	}, syscall.ENOSPC)
}

// WriteFailures counts every failed commit, whichever writer's, with the latest one's time and
// error, and a commit that succeeds afterwards leaves them: on a full disk a small commit can
// succeed while larger ones fail.
func TestWriteFailuresAreCounted(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m := testModel(4)
	install(t, l, m)
	if f := l.WriteFailures(); f.Count != 0 || !f.At.IsZero() || f.Err != nil {
		t.Fatalf("WriteFailures before any failed commit: %+v", f)
	}
	injected := errors.New("injected: fdatasync: no space left on device")
	l.opts.AfterCommit = func() error { return injected }
	rng := rand.New(rand.NewPCG(47, 47))
	if err := l.Put(bg, newCE(t, m, rng)); !errors.Is(err, ErrWrite) {
		t.Fatalf("a registration while commits fail: %v, want ErrWrite", err)
	}
	first := l.WriteFailures()
	if first.Count != 1 || first.At.IsZero() || !errors.Is(first.Err, ErrWrite) || !errors.Is(first.Err, injected) {
		t.Fatalf("WriteFailures after a failed registration: %+v, want 1 failure carrying ErrWrite and %q", first, injected)
	}
	next := drift(m, -0.01)
	next.Version = m.Version + 1
	if _, _, err := l.Commit(bg, &Checkpoint{Model: next, Offsets: map[int]int64{0: 1}, Applied: 1}); !errors.Is(err, ErrWrite) {
		t.Fatalf("a checkpoint while commits fail: %v, want ErrWrite", err)
	}
	second := l.WriteFailures()
	if second.Count != 2 || second.At.Before(first.At) {
		t.Fatalf("WriteFailures after a failed checkpoint: %+v, want 2 failures, the latest at or after %v", second, first.At)
	}
	l.opts.AfterCommit = nil
	if err := l.Put(bg, newCE(t, m, rng)); err != nil {
		t.Fatalf("a registration once commits work: %v", err)
	}
	if after := l.WriteFailures(); after.Count != 2 || !after.At.Equal(second.At) {
		t.Fatalf("WriteFailures after a commit that succeeded: %+v, want them unchanged (%+v)", after, second)
	}
}
