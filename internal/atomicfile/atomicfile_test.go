package atomicfile

import (
	"bytes"
	"errors"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
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
