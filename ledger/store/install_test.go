package store

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A copy that does not verify, though its source did (the disk of the state directory damaged
// it), is removed and named with what to do: restore again, not the advice for a damaged ledger
// (move it aside, start over), which names a file no longer there.
func TestInstallRefusesACopyThatDoesNotVerify(t *testing.T) {
	src := filepath.Join(t.TempDir(), "backup.db")
	if err := os.WriteFile(src, []byte("a ledger"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "state")
	err := Install(src, dir, func(path string) error { return InFile(path, Corruptf("page 3: checksum mismatch")) })
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "run the restore again") || !strings.Contains(err.Error(), "checksum mismatch") ||
		strings.Contains(err.Error(), "mv ") || strings.Contains(err.Error(), "start over") {
		t.Errorf("Install of a copy that does not verify: %v; want a corrupt error saying to run the restore again", err)
	}
	if _, err := os.Stat(filepath.Join(dir, FileName)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused copy was installed: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*.restore-*")); len(left) != 0 {
		t.Errorf("the refused copy was left behind: %v", left)
	}
}
