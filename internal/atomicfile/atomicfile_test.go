package atomicfile

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cfguard/cfguard/internal/tooltest"
)

// entries lists the names in dir, so that a test can see leftover temporary files.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func TestWriteFileReplacesContentAndLeavesNoTemporary(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state.json")
	for _, content := range []string{"first version, longer than the second", "second"} {
		if err := WriteFile(path, []byte(content)); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// A rename replaces the file whole: no tail of the longer first version survives.
		if string(got) != content {
			t.Fatalf("file holds %q, want %q", got, content)
		}
		if names := entries(t, dir); len(names) != 1 || names[0] != "state.json" {
			t.Fatalf("directory holds %v, want only state.json", names)
		}
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o644 {
			t.Fatalf("mode %v, want 0644", st.Mode().Perm())
		}
	}
}

// TestWriteFileIsARename checks the mechanism a reader relies on: the new content arrives as a
// new inode renamed over the old one, so a reader holding the old file open keeps reading the
// old, complete content.
func TestWriteFileIsARename(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := WriteFile(path, []byte("old content")); err != nil {
		t.Fatal(err)
	}
	reader, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	before, _ := os.Stat(path)
	if err := WriteFile(path, []byte("new")); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(path)
	if os.SameFile(before, after) {
		t.Fatal("the file was rewritten in place, not replaced by a rename")
	}
	buf := new(bytes.Buffer)
	if _, err := buf.ReadFrom(reader); err != nil {
		t.Fatal(err)
	}
	if buf.String() != "old content" {
		t.Fatalf("an open reader sees %q, want the old content whole", buf.String())
	}
}

// TestFailedWriteLeavesOldFile makes the write itself fail for real: RLIMIT_FSIZE caps file
// sizes at 8 bytes, so writing 1 KiB fails with EFBIG (SIGXFSZ ignored). The old file must be
// untouched, the temporary file removed, and the error must name the target.
func TestFailedWriteLeavesOldFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "model.json")
	if err := WriteFile(path, []byte("old")); err != nil {
		t.Fatal(err)
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Fatal(err)
	}
	signal.Ignore(syscall.SIGXFSZ)
	defer signal.Reset(syscall.SIGXFSZ)
	small := lim
	small.Cur = 8
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &small); err != nil {
		t.Fatal(err)
	}
	werr := WriteFile(path, bytes.Repeat([]byte("x"), 1024))
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Fatal(err)
	}
	if werr == nil || !errors.Is(werr, syscall.EFBIG) || !strings.Contains(werr.Error(), path) {
		t.Fatalf("got %v, want EFBIG naming %s", werr, path)
	}
	got, err := os.ReadFile(path)
	if err != nil || string(got) != "old" {
		t.Fatalf("old file now holds %q (%v), want %q", got, err, "old")
	}
	if names := entries(t, dir); len(names) != 1 {
		t.Fatalf("directory holds %v after a failed write, want only model.json", names)
	}
}

// A rename onto a non-empty directory fails: the temporary file must not be left behind and the
// error must name the target.
func TestFailedRenameRemovesTemporary(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "busy")
	if err := os.MkdirAll(filepath.Join(target, "child"), 0o755); err != nil {
		t.Fatal(err)
	}
	err := WriteFile(target, []byte("data"))
	if err == nil || !strings.Contains(err.Error(), target) {
		t.Fatalf("got %v, want an error naming %s", err, target)
	}
	if names := entries(t, dir); len(names) != 1 || names[0] != "busy" {
		t.Fatalf("directory holds %v, want only busy", names)
	}
}

func TestMissingDirectoryIsNamed(t *testing.T) {
	path := filepath.Join(t.TempDir(), "no", "such", "f")
	if err := WriteFile(path, []byte("x")); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("got %v, want an error naming %s", err, path)
	}
	if err := SyncDir(filepath.Dir(path)); err == nil || !strings.Contains(err.Error(), filepath.Dir(path)) {
		t.Fatalf("SyncDir of a missing directory: %v", err)
	}
}

// WriteFiles creates the directory and writes in order; a failure part-way leaves the files
// written so far and the rest untouched, which is why the vouching file goes last.
func TestWriteFilesOrderAndPartialFailure(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "new", "dir")
	if err := WriteFiles(dir, File{Name: "a", Data: []byte("1")}, File{Name: "b", Data: []byte("2")}); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"a": "1", "b": "2"} {
		if got, err := os.ReadFile(filepath.Join(dir, name)); err != nil || string(got) != want {
			t.Fatalf("%s = %q (%v), want %q", name, got, err, want)
		}
	}
	// "c" is a non-empty directory, so its write fails; "a" was replaced before, "d" never written.
	if err := os.MkdirAll(filepath.Join(dir, "c", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	err := WriteFiles(dir, File{Name: "a", Data: []byte("A")}, File{Name: "c", Data: []byte("C")}, File{Name: "d", Data: []byte("D")})
	if err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "c")) {
		t.Fatalf("got %v, want an error naming c", err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "a")); string(got) != "A" {
		t.Fatalf("a = %q, want the new content written before the failure", got)
	}
	if _, err := os.Stat(filepath.Join(dir, "d")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("d exists after an earlier file failed: %v", err)
	}
}

// MkdirAll creates every missing directory of a path (and leaves an existing one as it is), is a no-op on a directory that exists, and fails, naming the path, where a file is in
// the way.
func TestMkdirAllCreatesTheMissingDirectories(t *testing.T) {
	root := t.TempDir()
	if err := os.Chmod(root, 0o700); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "a", "b", "c")
	for range 2 {
		if err := MkdirAll(dir); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"a", "a/b", "a/b/c"} {
		if fi, err := os.Stat(filepath.Join(root, d)); err != nil || !fi.IsDir() {
			t.Fatalf("%s: %v %v, want a directory", d, fi, err)
		}
	}
	if fi, _ := os.Stat(root); fi.Mode().Perm() != 0o700 {
		t.Errorf("the existing parent's mode became %v", fi.Mode().Perm())
	}
	file := filepath.Join(root, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := MkdirAll(filepath.Join(file, "x")); err == nil || !strings.Contains(err.Error(), file) {
		t.Fatalf("a file in the way: %v, want an error naming %s", err, file)
	}
}

// TestTemporaryFileBesideTheTarget: the temporary file is made in the target's directory, not
// in $TMPDIR: a rename is atomic only within one file system, and $TMPDIR is often another one
// (tmpfs). With $TMPDIR naming no directory at all, a write still succeeds and leaves nothing
// behind.
func TestTemporaryFileBesideTheTarget(t *testing.T) {
	t.Setenv("TMPDIR", filepath.Join(t.TempDir(), "no-such-dir"))
	dir := t.TempDir()
	path := filepath.Join(dir, "model.json")
	if err := WriteFile(path, []byte("content")); err != nil {
		t.Fatalf("WriteFile with $TMPDIR missing: %v", err)
	}
	if got, err := os.ReadFile(path); err != nil || string(got) != "content" {
		t.Fatalf("file holds %q (%v)", got, err)
	}
	if names := entries(t, dir); len(names) != 1 {
		t.Fatalf("directory holds %v, want only model.json", names)
	}
}

// openFiles counts the process's open file descriptors, or skips the test where /proc/self/fd
// cannot be read.
func openFiles(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count open files: %v", err)
	}
	return len(es)
}

// TestWriteFileClosesTheTemporary pins that WriteFile closes the temporary file on success (before
// the rename) and on a failed write (in its cleanup, as in TestFailedWriteLeavesOldFile: file sizes
// capped at 8 bytes, SIGXFSZ ignored): a daemon that saves state on every checkpoint must not leak
// a descriptor per save.
func TestWriteFileClosesTheTemporary(t *testing.T) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Fatal(err)
	}
	signal.Ignore(syscall.SIGXFSZ)
	defer signal.Reset(syscall.SIGXFSZ)
	path := filepath.Join(t.TempDir(), "f")
	for _, tc := range []struct {
		name    string
		limit   uint64 // RLIMIT_FSIZE during the writes
		wantErr bool
	}{
		{"success", lim.Cur, false},
		{"failed write", 8, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			during := lim
			during.Cur = tc.limit
			// A first write lets the runtime open whatever it opens once (e.g. its poller).
			if err := WriteFile(path, []byte("warm-up")); err != nil {
				t.Fatal(err)
			}
			before := openFiles(t)
			if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &during); err != nil {
				t.Fatal(err)
			}
			var errs []error
			for range 3 {
				errs = append(errs, WriteFile(path, bytes.Repeat([]byte("x"), 1024)))
			}
			if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
				t.Fatal(err)
			}
			for _, err := range errs {
				if (err != nil) != tc.wantErr {
					t.Fatalf("WriteFile: %v, want an error: %v", err, tc.wantErr)
				}
			}
			if after := openFiles(t); after != before {
				t.Fatalf("%d open files after 3 writes, %d before", after, before)
			}
		})
	}
}

// TestSyncDirWrapsTheOSError pins that SyncDir's error wraps the os error, so that a caller can
// tell a missing directory (fs.ErrNotExist) from a failed fsync.
func TestSyncDirWrapsTheOSError(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "missing")
	if err := SyncDir(dir); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), dir) {
		t.Fatalf("SyncDir of a missing directory: %v, want fs.ErrNotExist naming %s", err, dir)
	}
}

// umask returns the process's file mode creation mask, or skips the test where /proc/self/status
// does not show it (read there rather than by syscall.Umask, which would have to change it).
func umask(t *testing.T) fs.FileMode {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Skipf("cannot read the umask: %v", err)
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "Umask:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32)
			if err != nil {
				t.Fatal(err)
			}
			return fs.FileMode(m)
		}
	}
	t.Skip("no Umask line in /proc/self/status")
	return 0
}

// TestMkdirAllMode pins the documented mode of the directories MkdirAll creates: 0o755, less
// the umask, as os.MkdirAll gives.
func TestMkdirAllMode(t *testing.T) {
	want := 0o755 &^ umask(t)
	root := t.TempDir()
	if err := MkdirAll(filepath.Join(root, "a", "b")); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"a", "a/b"} {
		fi, err := os.Stat(filepath.Join(root, d))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", d, fi.Mode().Perm(), want)
		}
	}
}

// nobodyEnv marks a test binary that asNobody started.
const nobodyEnv = "CFGUARD_ATOMICFILE_AS_NOBODY"

// nobody is the conventional unprivileged user and group id (nobody, nogroup).
const nobody = 65534

// asNobody runs t again, in a copy of this test binary, as user and group nobody, and fails t
// with the child's output if the child fails. A test that needs permissions enforced runs for real
// as root this way. The copy lives in a directory nobody can read; the child's TMPDIR is one
// nobody owns. It skips t where the child cannot be started as nobody (no CAP_SETUID) and reports
// the child's skip as its own.
func asNobody(t *testing.T) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Skipf("cannot find the test binary: %v", err)
	}
	dir, err := os.MkdirTemp("", "atomicfile-as-nobody-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	tmp := filepath.Join(dir, "tmp")
	bin := filepath.Join(dir, "atomicfile.test")
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(tmp, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), bin, "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), nobodyEnv+"=1", "TMPDIR="+tmp, "HOME="+tmp)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err != nil && !errors.As(err, &exit):
		t.Skipf("cannot run the test as user nobody: %v", err)
	case err != nil:
		t.Fatalf("as user nobody: %v\n%s", err, out)
	case bytes.Contains(out, []byte("--- SKIP")):
		t.Skipf("skipped as user nobody too:\n%s", out)
	case !bytes.Contains(out, []byte("--- PASS: "+t.Name())):
		t.Fatalf("as user nobody, %s did not pass:\n%s", t.Name(), out)
	}
}

// unreadable makes dir searchable and writable but not readable (0o300), so that creating and
// renaming entries in it works but opening it, as a directory fsync must, fails. It skips the test
// where permissions are not enforced (root), and restores the mode at cleanup so that the
// directory can be removed.
func unreadable(t *testing.T, dir string) {
	t.Helper()
	if err := os.Chmod(dir, 0o300); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(dir, 0o755) })
	if d, err := os.Open(dir); err == nil {
		d.Close()
		t.Skip("permissions are not enforced (running as root?): cannot make a directory fsync fail")
	}
}

// TestDirectoryFsyncFailuresAreReported pins which directories are fsynced and that a failed
// fsync is reported. A directory without read permission cannot be opened, so its fsync fails:
// WriteFile must fsync the target's directory after the rename; MkdirAll must fsync the parent of
// dir (cleaned: a trailing slash does not make dir its own parent) even when dir exists, and the
// parent of every directory it creates, but no directory above; WriteFiles must stop when MkdirAll
// fails. Errors from MkdirAll name dir. Run as root, where permissions are not enforced, the test
// runs itself again as an unprivileged user (see asNobody), and is skipped only where that fails.
func TestDirectoryFsyncFailuresAreReported(t *testing.T) {
	if os.Geteuid() == 0 && os.Getenv(nobodyEnv) == "" {
		asNobody(t)
		return
	}
	for _, tc := range []struct {
		name string
		// run gets a fresh directory root with an unreadable subdirectory root/locked holding an
		// existing, readable directory root/locked/p.
		run     func(root string) error
		wantErr bool
		names   string // the error must contain this (under root)
	}{
		{"WriteFile fsyncs the target's directory", func(root string) error {
			return WriteFile(filepath.Join(root, "locked", "f"), []byte("new"))
		}, true, "locked"},
		{"MkdirAll fsyncs the parent of an existing dir", func(root string) error {
			return MkdirAll(filepath.Join(root, "locked", "p"))
		}, true, "locked/p"},
		{"MkdirAll fsyncs the parent of dir given with a trailing slash", func(root string) error {
			return MkdirAll(filepath.Join(root, "locked", "p") + "/")
		}, true, "locked/p"},
		{"MkdirAll fsyncs the parent of each created directory", func(root string) error {
			return MkdirAll(filepath.Join(root, "locked", "new", "dir"))
		}, true, "locked/new/dir"},
		{"MkdirAll fsyncs nothing above the first created directory's parent", func(root string) error {
			return MkdirAll(filepath.Join(root, "locked", "p", "new"))
		}, false, ""},
		{"WriteFiles stops when the directory cannot be made durable", func(root string) error {
			return WriteFiles(filepath.Join(root, "locked", "new"), File{Name: "a", Data: []byte("1")})
		}, true, "locked/new"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			if err := os.MkdirAll(filepath.Join(root, "locked", "p"), 0o755); err != nil {
				t.Fatal(err)
			}
			unreadable(t, filepath.Join(root, "locked"))
			err := tc.run(root)
			if !tc.wantErr {
				if err != nil {
					t.Fatalf("got %v, want no error", err)
				}
				return
			}
			if !errors.Is(err, fs.ErrPermission) || !strings.Contains(err.Error(), filepath.Join(root, tc.names)) {
				t.Fatalf("got %v, want a permission error naming %s", err, filepath.Join(root, tc.names))
			}
			if _, err := os.Stat(filepath.Join(root, "locked", "new", "a")); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("a file was written into a directory that could not be made durable: %v", err)
			}
		})
	}
}

// tracedEnv marks a test binary that traced started; its value is the directory to write in.
const tracedEnv = "CFGUARD_ATOMICFILE_TRACED"

// traced runs t again, in this test binary under strace -f -y (which shows the path of every file
// descriptor) with the further options opts (what to trace, faults to inject), with tracedEnv set
// to dir, and returns the trace's lines. It fails t if the child, once started, does not pass, and
// skips t where strace is not installed or cannot start it.
func traced(t *testing.T, dir string, opts ...string) []string {
	t.Helper()
	strace := tooltest.Command(t, "apt-get install strace", "strace")
	self, err := os.Executable()
	if err != nil {
		t.Skipf("cannot find the test binary: %v", err)
	}
	out := filepath.Join(t.TempDir(), "trace")
	args := append([]string{"-f", "-qq", "-y", "-o", out}, opts...)
	args = append(args, self, "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd := exec.CommandContext(t.Context(), strace, args...)
	cmd.Env = append(os.Environ(), tracedEnv+"="+dir)
	b, err := cmd.CombinedOutput()
	switch {
	case !bytes.Contains(b, []byte("=== RUN   "+t.Name())):
		t.Skipf("cannot run the test under strace: %v\n%s", err, b)
	case err != nil || !bytes.Contains(b, []byte("--- PASS: "+t.Name())):
		t.Fatalf("traced: %v\n%s", err, b)
	}
	tr, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(string(tr), "\n")
}

// TestWriteFileFsyncsAroundTheRename pins the fsyncs that make a write durable, as the system
// calls show them: the temporary file's before the rename, so that a crash after the rename
// cannot leave the target with data that never reached the disk, and the directory's after it,
// so that the rename itself survives a crash. It runs WriteFile under strace (see traced).
func TestWriteFileFsyncsAroundTheRename(t *testing.T) {
	if dir := os.Getenv(tracedEnv); dir != "" {
		if err := WriteFile(filepath.Join(dir, "f"), []byte("new")); err != nil {
			t.Fatal(err)
		}
		return
	}
	dir, err := filepath.EvalSymlinks(t.TempDir()) // strace -y shows descriptors' resolved paths
	if err != nil {
		t.Fatal(err)
	}
	lines := traced(t, dir, "-e", "trace=fsync,fdatasync,rename,renameat,renameat2")
	tmp := dir + "/.f.tmp-"
	syncTmp, rename, syncDir := -1, -1, -1
	for i, l := range lines {
		switch {
		case strings.Contains(l, "fsync(") && strings.Contains(l, "<"+tmp) && syncTmp < 0:
			syncTmp = i
		case strings.Contains(l, "rename") && strings.Contains(l, `"`+tmp) && strings.Contains(l, `"`+dir+`/f"`) && rename < 0:
			rename = i
		case strings.Contains(l, "fsync(") && strings.Contains(l, "<"+dir+">") && rename >= 0 && syncDir < 0:
			syncDir = i
		}
	}
	if syncTmp < 0 || rename < 0 || syncDir < 0 || !(syncTmp < rename && rename < syncDir) {
		t.Fatalf("want fsync of the temporary file (line %d), then the rename (line %d), then fsync of %s (line %d); trace:\n%s",
			syncTmp, rename, dir, syncDir, strings.Join(lines, "\n"))
	}
}

// TestFailedFsyncLeavesOldFile makes every fsync fail (EIO, injected by strace; see traced): the
// write must fail, wrapping the error and naming the target, before the rename, so that the old
// file is untouched and the temporary file removed. A write whose data may not be on the disk
// must not replace the old.
func TestFailedFsyncLeavesOldFile(t *testing.T) {
	if dir := os.Getenv(tracedEnv); dir != "" {
		path := filepath.Join(dir, "model.json")
		if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
			t.Fatal(err)
		}
		err := WriteFile(path, []byte("new"))
		if !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "fsync") {
			t.Fatalf("got %v, want EIO from fsync naming %s", err, path)
		}
		if got, err := os.ReadFile(path); err != nil || string(got) != "old" {
			t.Fatalf("old file now holds %q (%v), want %q", got, err, "old")
		}
		if names := entries(t, dir); len(names) != 1 {
			t.Fatalf("directory holds %v after a failed fsync, want only model.json", names)
		}
		return
	}
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	lines := traced(t, dir, "-e", "trace=fsync", "-e", "inject=fsync:error=EIO")
	if !strings.Contains(strings.Join(lines, "\n"), "(INJECTED)") {
		t.Fatalf("no fsync failed; trace:\n%s", strings.Join(lines, "\n"))
	}
}
