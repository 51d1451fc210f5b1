package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// walkFixture is a closed file of a few hundred sealed values (a tree of several pages), two
// commits deep, as bytes.
func walkFixture(t *testing.T) (data []byte, lo Layout) {
	t.Helper()
	dir := t.TempDir()
	f, err := Open(dir, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	for round := range 2 {
		err := f.Update(func(tx *bolt.Tx) error {
			for i := range 300 {
				if err := Put(tx.Bucket(bucket), fmt.Appendf(nil, "key-%04d", i), fmt.Appendf(nil, "value %d of round %d", i, round)); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	path := filepath.Join(dir, FileName)
	if data, err = os.ReadFile(path); err != nil {
		t.Fatal(err)
	}
	return data, inspectBytes(t, data, nil)
}

// inspectBytes runs Inspect on data; wantErr, when set, must be in its error.
func inspectBytes(t *testing.T, data []byte, wantErr []string) Layout {
	t.Helper()
	p := filepath.Join(t.TempDir(), "f.db")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	lo, err := Inspect(f)
	switch {
	case wantErr == nil && err != nil:
		t.Fatalf("Inspect: %v", err)
	case wantErr != nil && !errors.Is(err, ErrCorrupt):
		t.Fatalf("Inspect: %v, want an error wrapping ErrCorrupt that says %q", err, wantErr)
	}
	for _, w := range wantErr {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("Inspect's error does not say %q: %v", w, err)
		}
	}
	return lo
}

// Inspect reads a sound file's layout, and refuses a truncated file, a page that is not the
// one its parent points to, and a damaged newest meta page; a damaged older meta page is only
// reported (MetaDamaged).
func TestInspect(t *testing.T) {
	data, lo := walkFixture(t)
	ps := lo.PageSize
	if lo.TxID < 2 || lo.Freelist != NoFreelist || lo.Pages < 3 || lo.MetaDamaged != "" || lo.Size != int64(len(data)) {
		t.Fatalf("layout of a sound file: %+v", lo)
	}
	newest, older := lo.MetaPage, 1-lo.MetaPage
	flip := func(off int) []byte {
		d := append([]byte(nil), data...)
		d[off] ^= 0x04
		return d
	}
	const meta = 16 // the page header before each meta
	t.Run("empty", func(t *testing.T) { inspectBytes(t, nil, []string{"empty (0 bytes)"}) })
	t.Run("truncated", func(t *testing.T) {
		hwm := int(ne.Uint64(data[newest*ps+meta+40:]))
		inspectBytes(t, data[:(hwm-1)*ps], []string{"it was truncated"})
	})
	t.Run("newest meta damaged", func(t *testing.T) {
		inspectBytes(t, flip(newest*ps+meta+16), []string{fmt.Sprintf("bbolt meta page %d is damaged (checksum mismatch)", newest),
			fmt.Sprintf("fall back to transaction %d", lo.TxID-1)})
	})
	t.Run("older meta damaged", func(t *testing.T) {
		got := inspectBytes(t, flip(older*ps+meta+16), nil)
		if got.TxID != lo.TxID || !strings.Contains(got.MetaDamaged, fmt.Sprintf("meta page %d: checksum mismatch", older)) {
			t.Fatalf("older meta page damaged: %+v, want transaction %d and the damage reported", got, lo.TxID)
		}
	})
	t.Run("page id", func(t *testing.T) {
		root := int(ne.Uint64(data[newest*ps+meta+16:]))
		d := append([]byte(nil), data...)
		ne.PutUint64(d[root*ps:], uint64(root+1))
		inspectBytes(t, d, []string{fmt.Sprintf("bbolt page %d says it is page %d", root, root+1)})
	})
}
