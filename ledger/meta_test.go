package ledger

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/ledger/store"
)

// bbolt's meta page (its on-disk format, version 2): a 16-byte page header, then the meta, whose
// transaction id is at byte 48 and FNV-64a checksum at byte 56.
const (
	pageHeaderSize = 16
	metaTxidOff    = 48
	metaSumOff     = 56
)

// nextTransaction commits one more transaction on top of fx's file, so that its newest meta page
// is the other one.
func nextTransaction(t *testing.T, fx faultFixture) faultFixture {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	if err := os.WriteFile(path, fx.data, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&Checkpoint{Counters: map[string]int64{"final": 2}}); err != nil {
		t.Fatal(err)
	}
	next := faultFixture{prev: fx.ref, pageSize: fx.pageSize}
	if next.ref, err = snapshot(l); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if next.data, err = os.ReadFile(path); err != nil {
		t.Fatal(err)
	}
	f, _ := os.Open(path)
	defer f.Close()
	lo, err := store.Inspect(f)
	if err != nil {
		t.Fatal(err)
	}
	next.lastSlot = lo.MetaPage
	return next
}

// One flipped byte in a meta page, in page 0 and in page 1, each when it holds the newest
// transaction and when it holds the older one. bbolt would open the previous transaction in
// silence when the newest page fails its checksum, losing what that transaction acknowledged;
// Open refuses instead, naming the page and the transaction the fallback would lose. The older
// page damaged loses nothing (the newest transaction is whole), so Open reads the newest data.
func TestMetaPageFlips(t *testing.T) {
	a := buildFaultFixture(t)
	b := nextTransaction(t, a)
	if a.lastSlot == b.lastSlot {
		t.Fatalf("both fixtures end in meta page %d", a.lastSlot)
	}
	// Offsets inside the meta (after the 16-byte page header): the root page id and the
	// checksum, both covered by (or being) bbolt's FNV checksum.
	fields := map[string]int{"root page": pageHeaderSize + 16, "checksum": pageHeaderSize + metaSumOff}
	for _, fx := range []faultFixture{a, b} {
		f, _ := os.CreateTemp(t.TempDir(), "meta")
		f.Write(fx.data)
		lo, err := store.Inspect(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		newest := lo.TxID
		for _, slot := range []int{0, 1} {
			for field, off := range fields {
				what := fmt.Sprintf("newest in page %d, %s of page %d flipped", fx.lastSlot, field, slot)
				data := append([]byte(nil), fx.data...)
				data[slot*fx.pageSize+off] ^= 0x04
				o := faultTrial(t, what, data, fx.ref)
				if slot != fx.lastSlot {
					if o != intact {
						t.Errorf("%s: %s, want the newest transaction read intact", what, o)
					}
					continue
				}
				if o != refused {
					t.Fatalf("%s: %s, want refused at Open", what, o)
				}
				err := openBytes(t, data)
				msg := err.Error()
				for _, want := range []string{
					fmt.Sprintf("bbolt meta page %d is damaged (checksum mismatch)", slot),
					fmt.Sprintf("reads as transaction %d", newest),
					fmt.Sprintf("fall back to transaction %d", newest-1),
				} {
					if !strings.Contains(msg, want) {
						t.Errorf("%s: the error does not say %q: %v", what, want, err)
					}
				}
			}
		}
	}
}

// The older meta page is tolerated only when it still reads as the transaction before the
// newest one; one whose transaction id is damaged may be a newer transaction (it cannot be told
// apart), so it is refused.
func TestMetaPageDamagedTxidRefused(t *testing.T) {
	fx := buildFaultFixture(t)
	older := 1 - fx.lastSlot
	data := append([]byte(nil), fx.data...)
	data[older*fx.pageSize+pageHeaderSize+metaTxidOff+2] ^= 0x01 // txid, third byte
	if o := faultTrial(t, "older page's txid flipped", data, fx.ref); o != refused {
		t.Fatalf("older page with a damaged txid: %s, want refused", o)
	}
}

// openBytes opens data as a ledger in a fresh directory and returns Open's error.
func openBytes(t *testing.T, data []byte) error {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, FileName), data, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err == nil {
		l.Close()
		t.Fatal("Open accepted the file")
	}
	return err
}
