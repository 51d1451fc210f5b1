package store

import (
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// walkFixture is a closed file of a few hundred sealed values (a tree of several pages), two
// commits deep, as bytes.
func walkFixture(t *testing.T) (data []byte, lo Layout) {
	t.Helper()
	data = fixtureBytes(t, testOptions())
	return data, inspectBytes(t, data, nil)
}

// fixtureBytes writes walkFixture's values with opts and returns the closed file's bytes.
func fixtureBytes(t *testing.T, opts Options) []byte {
	t.Helper()
	dir := t.TempDir()
	f, err := Open(dir, opts)
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
	data, err := os.ReadFile(filepath.Join(dir, FileName))
	if err != nil {
		t.Fatal(err)
	}
	return data
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

// Inspect reads a sound file's layout, every page below the high-water mark but the two meta
// pages counted as in use or free, and refuses a truncated file, a page that is not the one its
// parent points to, and a damaged newest meta page; a damaged older meta page is only reported
// (MetaDamaged).
func TestInspect(t *testing.T) {
	data, lo := walkFixture(t)
	ps := lo.PageSize
	if lo.TxID < 2 || lo.Freelist != NoFreelist || lo.Pages < 3 || lo.MetaDamaged != "" || lo.Size != int64(len(data)) {
		t.Fatalf("layout of a sound file: %+v", lo)
	}
	if hwm := ne.Uint64(data[lo.MetaPage*ps+16+40:]); uint64(2+lo.Pages+lo.FreePages) != hwm {
		t.Fatalf("%d pages in use and %d free beside the 2 meta pages; the high-water mark is %d", lo.Pages, lo.FreePages, hwm)
	}
	root := ne.Uint64(data[lo.MetaPage*ps+16+16:])
	if len(lo.InUse) != 2+lo.Pages || lo.InUse[0] != 0 || lo.InUse[1] != 1 || !slices.IsSorted(lo.InUse) || !slices.Contains(lo.InUse, root) {
		t.Fatalf("InUse %v: want the 2 meta pages, the root %d and %d others, ascending", lo.InUse, root, lo.Pages-1)
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

// resealMeta rewrites the FNV-64a checksum of the meta page in slot of data (page size ps) over
// its first 56 bytes after the page header, as bbolt computes it: the page then passes the
// checksum, whatever the edit before it.
func resealMeta(data []byte, slot, ps int) {
	const meta = 16
	m := data[slot*ps+meta : slot*ps+meta+64]
	h := fnv.New64a()
	h.Write(m[:56])
	ne.PutUint64(m[56:], h.Sum64())
}

// TestInspectRefusesSoundChecksumsOnWrongFields: a meta page whose checksum is right but whose
// magic, format version or page size is not bbolt's version-2 layout (a file of another format
// or version, or damage that rewrote the checksum too) is not taken as valid: the newest one is
// refused naming what is wrong, and a page size that is not a power of two or that differs
// between the two pages is named.
func TestInspectRefusesSoundChecksumsOnWrongFields(t *testing.T) {
	data, lo := walkFixture(t)
	ps := lo.PageSize
	newest := lo.MetaPage
	const meta = 16
	edit := func(slot, off int, v uint32) []byte {
		d := append([]byte(nil), data...)
		ne.PutUint32(d[slot*ps+meta+off:], v)
		resealMeta(d, slot, ps)
		return d
	}
	t.Run("magic", func(t *testing.T) {
		inspectBytes(t, edit(newest, 0, 0xDEADBEEF), []string{fmt.Sprintf("bbolt meta page %d is damaged (not a bbolt meta page (bad magic))", newest)})
	})
	t.Run("version", func(t *testing.T) {
		inspectBytes(t, edit(newest, 4, 3), []string{fmt.Sprintf("bbolt meta page %d is damaged (bbolt format version 3, want 2)", newest)})
	})
	t.Run("page size not a power of two", func(t *testing.T) {
		inspectBytes(t, edit(0, 8, uint32(ps-1)), []string{fmt.Sprintf("meta page 0 gives page size %d", ps-1)})
	})
	t.Run("page 1's page size differs", func(t *testing.T) {
		d := edit(1, 8, uint32(2*ps))
		want := fmt.Sprintf("page size %d differs from page 0's %d", 2*ps, ps)
		if newest == 1 {
			inspectBytes(t, d, []string{"bbolt meta page 1 is damaged (" + want + ")"})
			return
		}
		if got := inspectBytes(t, d, nil); got.TxID != lo.TxID || !strings.Contains(got.MetaDamaged, want) {
			t.Fatalf("older page 1 with another page size: %+v, want transaction %d and %q", got, lo.TxID, want)
		}
	})
}

// TestInspectOlderMetaTolerance: a damaged older meta page is tolerated only when it reads as
// the transaction just before the newest (T-1) with a high-water mark not above the newest's
// (see "A damaged meta page" in doc.go); one that reads as T-2, or as T-1 with a larger
// high-water mark, may be a newer transaction damaged, and is refused.
func TestInspectOlderMetaTolerance(t *testing.T) {
	data, lo := walkFixture(t)
	ps, older := lo.PageSize, 1-lo.MetaPage
	const meta = 16
	hwm := ne.Uint64(data[lo.MetaPage*ps+meta+40:])
	// Each edit leaves the older page's checksum as it was, so the page fails it.
	damage := func(off int, v uint64) []byte {
		d := append([]byte(nil), data...)
		ne.PutUint64(d[older*ps+meta+off:], v)
		return d
	}
	refusal := fmt.Sprintf("bbolt meta page %d is damaged (checksum mismatch)", older)
	t.Run("T-1, same high-water mark", func(t *testing.T) {
		if got := inspectBytes(t, damage(40, hwm), nil); got.TxID != lo.TxID || got.MetaDamaged == "" {
			t.Fatalf("%+v, want transaction %d with the older page reported damaged", got, lo.TxID)
		}
	})
	t.Run("T-1, higher high-water mark", func(t *testing.T) {
		inspectBytes(t, damage(40, hwm+1), []string{refusal, fmt.Sprintf("reads as transaction %d", lo.TxID-1)})
	})
	t.Run("T-2", func(t *testing.T) {
		inspectBytes(t, damage(48, lo.TxID-2), []string{refusal, fmt.Sprintf("reads as transaction %d", lo.TxID-2)})
	})
}

// TestInspectFileOfOnePage: a file cut to its first page (meta page 1 gone) is reported as
// truncated, not as a damaged meta page.
func TestInspectFileOfOnePage(t *testing.T) {
	data, lo := walkFixture(t)
	inspectBytes(t, data[:lo.PageSize], []string{"it was truncated"})
}

// syncedFixture is walkFixture written with a synced freelist (as ledgers were before cfguard
// stopped syncing it, and as any bbolt file is): its newest meta page records a freelist page,
// which lists the pages the first round's values left free. It returns the file, its layout,
// and the offset of the freelist page's first page id.
func syncedFixture(t *testing.T) (data []byte, lo Layout, ids int) {
	t.Helper()
	opts := testOptions()
	opts.SyncFreelist = true
	data = fixtureBytes(t, opts)
	lo = inspectBytes(t, data, nil)
	if lo.Freelist == NoFreelist {
		t.Fatal("a file written with SyncFreelist records no freelist page")
	}
	off := int(lo.Freelist) * lo.PageSize
	if ne.Uint16(data[off+10:]) == 0xFFFF || ne.Uint16(data[off+10:]) < 2 {
		t.Fatalf("the fixture's freelist page holds %d ids; the test needs 2 to 0xFFFE", ne.Uint16(data[off+10:]))
	}
	return data, lo, off + 16
}

// TestInspectSyncedFreelist: with a freelist on file, the freelist and the tree must partition
// the pages below the high-water mark, so that the next commit cannot reuse a page the tree
// holds: the walk counts the pages the freelist lists, and refuses a free page left off the
// list (the last, or the first, page 2), a page listed twice, a page both listed and reached, a
// count that does not fit, and a freelist page of another type.
func TestInspectSyncedFreelist(t *testing.T) {
	data, lo, ids := syncedFixture(t)
	ps := lo.PageSize
	count := int(ne.Uint16(data[ids-16+10:]))
	if lo.FreePages != count {
		t.Fatalf("Inspect counts %d free pages; the freelist page lists %d", lo.FreePages, count)
	}
	fl := lo.Freelist
	first, last := ne.Uint64(data[ids:]), ne.Uint64(data[ids+8*(count-1):])
	root := ne.Uint64(data[lo.MetaPage*ps+16+16:])
	edit := func(f func(d []byte)) []byte {
		d := append([]byte(nil), data...)
		f(d)
		return d
	}
	t.Run("a free page off the list", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint16(d[ids-16+10:], uint16(count-1)) })
		inspectBytes(t, d, []string{fmt.Sprintf("bbolt page %d is neither in use nor on the freelist", last)})
	})
	t.Run("the first free page off the list", func(t *testing.T) {
		if first != 2 {
			t.Fatalf("the fixture's first free page is %d; the test needs page 2", first)
		}
		d := edit(func(d []byte) {
			copy(d[ids:], data[ids+8:ids+8*count])
			ne.PutUint16(d[ids-16+10:], uint16(count-1))
		})
		inspectBytes(t, d, []string{"bbolt page 2 is neither in use nor on the freelist"})
	})
	t.Run("a freelist page of another type", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint16(d[ids-16+8:], flagLeaf) })
		inspectBytes(t, d, []string{fmt.Sprintf("bbolt page %d has type 0x2, want 0x10", fl)})
	})
	t.Run("a page listed twice", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint64(d[ids+8*(count-1):], first) })
		inspectBytes(t, d, []string{fmt.Sprintf("freelist page %d lists page %d twice", fl, first)})
	})
	t.Run("a page in use listed", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint64(d[ids+8*(count-1):], root) })
		inspectBytes(t, d, []string{fmt.Sprintf("bbolt page %d is in use and on the freelist", root)})
	})
	t.Run("more ids than fit", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint16(d[ids-16+10:], 0xFFFE) })
		inspectBytes(t, d, []string{fmt.Sprintf("freelist page %d claims 65534 page ids, more than fit", fl)})
	})
}

// bucketRoot is the root page of the fixture's bucket: the value of the first element of the
// root bucket's leaf page (a bucket header: root page u64, sequence u64).
func bucketRoot(data []byte, lo Layout) uint64 {
	ps := lo.PageSize
	root := int(ne.Uint64(data[lo.MetaPage*ps+16+16:]))
	e := root*ps + 16
	pos, ksize := int(ne.Uint32(data[e+4:])), int(ne.Uint32(data[e+8:]))
	return ne.Uint64(data[e+pos+ksize:])
}

// TestInspectRefusesABadBranchPage: the bucket's root, a branch page, with its element count
// zeroed (its leaves would otherwise be taken as free pages, and the values lost in silence), a
// type that is neither branch nor leaf (unknown, freelist, meta, or both flags), overflow pages
// past the high-water mark, or an element whose key runs past the page (the first, or the next
// one, whose key bounds the first child), is refused naming the page.
func TestInspectRefusesABadBranchPage(t *testing.T) {
	data, lo := walkFixture(t)
	ps := lo.PageSize
	br := bucketRoot(data, lo)
	off := int(br) * ps
	if flags := ne.Uint16(data[off+8:]); flags != flagBranch {
		t.Fatalf("the bucket's root page %d has flags %#x; the test needs a branch page (more values in walkFixture)", br, flags)
	}
	hwm := ne.Uint64(data[lo.MetaPage*ps+16+40:])
	edit := func(f func(d []byte)) []byte {
		d := append([]byte(nil), data...)
		f(d)
		return d
	}
	t.Run("empty", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint16(d[off+10:], 0) }), []string{fmt.Sprintf("bbolt branch page %d is empty", br)})
	})
	for _, typ := range []uint16{0x20, flagFreelist, flagMeta, flagBranch | flagLeaf} {
		t.Run(fmt.Sprintf("type %#x", typ), func(t *testing.T) {
			inspectBytes(t, edit(func(d []byte) { ne.PutUint16(d[off+8:], typ) }), []string{fmt.Sprintf("bbolt page %d has type %#x, want 0x3", br, typ)})
		})
	}
	t.Run("overflow", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[off+12:], uint32(hwm-br)) }),
			[]string{fmt.Sprintf("bbolt page %d with %d overflow pages runs past the high-water mark %d", br, hwm-br, hwm)})
	})
	t.Run("a key past the page", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[off+16+4:], uint32(ps)) }), []string{fmt.Sprintf("bbolt page %d: element 0 lies outside the page", br)})
	})
	t.Run("the next key past the page", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[off+16+16:], 0xFFFFFF00) }), []string{fmt.Sprintf("bbolt page %d: element 1 lies outside the page", br)})
	})
}

// TestInspectRefusesKeysOutOfPlace: every key of a leaf is above the one before it and within
// the bounds its parent branch gives, [its branch key, the next branch key): a key repeated, a
// leaf's first key below its branch key, and a leaf's last key equal to the next branch key
// (each the trace of a damaged key byte, which would make a lookup miss the record) are refused.
func TestInspectRefusesKeysOutOfPlace(t *testing.T) {
	data, lo := walkFixture(t)
	ps := lo.PageSize
	br := int(bucketRoot(data, lo)) * ps
	if ne.Uint16(data[br+8:]) != flagBranch || ne.Uint16(data[br+10:]) < 2 {
		t.Fatal("the test needs the bucket's root to be a branch of two leaves or more")
	}
	// Branch element i: pos u32, ksize u32, child u64; its key at the element + pos.
	branchKey := func(i int) []byte {
		e := br + 16 + 16*i
		return data[e+int(ne.Uint32(data[e:])) : e+int(ne.Uint32(data[e:]))+int(ne.Uint32(data[e+4:]))]
	}
	child := func(i int) int { return int(ne.Uint64(data[br+16+16*i+8:])) }
	// leafKey is the offset and length of key i of the leaf at page p.
	leafKey := func(p, i int) (int, int) {
		e := p*ps + 16 + 16*i
		return e + int(ne.Uint32(data[e+4:])), int(ne.Uint32(data[e+8:]))
	}
	withKey := func(p, i int, key []byte) []byte {
		d := append([]byte(nil), data...)
		off, n := leafKey(p, i)
		if n != len(key) {
			t.Fatalf("key %d of page %d is %d bytes, the replacement %d", i, p, n, len(key))
		}
		copy(d[off:], key)
		return d
	}
	leaf0, leaf1 := child(0), child(1)
	last0 := int(ne.Uint16(data[leaf0*ps+10:])) - 1
	k0off, k0n := leafKey(leaf0, 0)
	first := append([]byte(nil), data[k0off:k0off+k0n]...)
	t.Run("a key repeated", func(t *testing.T) {
		inspectBytes(t, withKey(leaf0, 1, first), []string{fmt.Sprintf("bbolt page %d element 1: keys out of order", leaf0)})
	})
	t.Run("below its branch key", func(t *testing.T) {
		inspectBytes(t, withKey(leaf1, 0, first), []string{fmt.Sprintf("bbolt page %d element 0", leaf1), "below its branch key"})
	})
	t.Run("at the next branch key", func(t *testing.T) {
		inspectBytes(t, withKey(leaf0, last0, branchKey(1)), []string{fmt.Sprintf("bbolt page %d element %d", leaf0, last0), "not below the next branch key"})
	})
}

// rootElement is the offset of the element of the root bucket's leaf page whose key is name.
func rootElement(t *testing.T, data []byte, lo Layout, name string) int {
	t.Helper()
	ps := lo.PageSize
	root := int(ne.Uint64(data[lo.MetaPage*ps+16+16:]))
	for i := range int(ne.Uint16(data[root*ps+10:])) {
		e := root*ps + 16 + 16*i
		pos, ksize := int(ne.Uint32(data[e+4:])), int(ne.Uint32(data[e+8:]))
		if string(data[e+pos:e+pos+ksize]) == name {
			return e
		}
	}
	t.Fatalf("no bucket %q in the root page %d", name, root)
	return 0
}

// TestInspectRefusesABadLeafElement: a leaf element is a value or a bucket (flag 1), inside its
// page; a bucket's value is a 16-byte header, and, for a bucket small enough to live inline, a
// leaf page after it. An element with another flag, a value running past its page, a short
// bucket header, and an inline bucket whose page is not a leaf or is shorter than a page header
// are refused, naming where.
func TestInspectRefusesABadLeafElement(t *testing.T) {
	dir := t.TempDir()
	f, err := Open(dir, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	err = f.Update(func(tx *bolt.Tx) error {
		if err := Put(tx.Bucket(bucket), []byte("k"), []byte("v")); err != nil {
			return err
		}
		small, err := tx.CreateBucket([]byte("small"))
		if err != nil {
			return err
		}
		return Put(small, []byte("x"), []byte("y"))
	})
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, FileName))
	if err != nil {
		t.Fatal(err)
	}
	lo := inspectBytes(t, data, nil)
	b, small := rootElement(t, data, lo, "b"), rootElement(t, data, lo, "small")
	edit := func(f func(d []byte)) []byte {
		d := append([]byte(nil), data...)
		f(d)
		return d
	}
	t.Run("flags", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[b:], 0x02) }), []string{"element 0 has flags 0x2"})
	})
	t.Run("value past the page", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[b+12:], uint32(lo.PageSize)) }), []string{"element 0 lies outside the page"})
	})
	t.Run("short bucket header", func(t *testing.T) {
		// walkFixture's bucket has pages of its own: its header's root page is not 0.
		big, blo := walkFixture(t)
		e := rootElement(t, big, blo, "b")
		d := append([]byte(nil), big...)
		ne.PutUint32(d[e+12:], 12)
		inspectBytes(t, d, []string{`bucket "b" has a 12-byte header`})
	})
	inline := small + int(ne.Uint32(data[small+4:])) + int(ne.Uint32(data[small+8:])) + 16 // the inline page
	t.Run("inline page claims more elements than fit", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint16(d[inline+10:], 0xFFFF) }), []string{`inline bucket "small" claims 65535 elements, more than fit`})
	})
	t.Run("inline element flags", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[inline+16:], 0x02) }), []string{`inline bucket "small": element 0 has flags 0x2`})
	})
	t.Run("inline page shorter than a page header", func(t *testing.T) {
		inspectBytes(t, edit(func(d []byte) { ne.PutUint32(d[small+12:], 16+12) }), []string{`inline bucket "small" has no leaf page`})
	})
	t.Run("inline page not a leaf", func(t *testing.T) {
		val := small + int(ne.Uint32(data[small+4:])) + int(ne.Uint32(data[small+8:]))
		if ne.Uint64(data[val:]) != 0 {
			t.Fatal(`bucket "small" is not inline; the test needs it to be`)
		}
		inspectBytes(t, edit(func(d []byte) { ne.PutUint16(d[val+16+8:], flagBranch) }), []string{`inline bucket "small" has no leaf page`})
	})
}

// TestInspectNamesWhatIsWrong: damage that several checks would refuse is named by the first
// that applies, the one that says what is wrong: a meta page whose root or freelist page lies at
// or past its high-water mark, a branch pointing at a meta page, and two branch elements
// pointing at one page.
func TestInspectNamesWhatIsWrong(t *testing.T) {
	data, lo := walkFixture(t)
	ps, newest := lo.PageSize, lo.MetaPage
	const meta = 16
	hwm := ne.Uint64(data[newest*ps+meta+40:])
	root := ne.Uint64(data[newest*ps+meta+16:])
	br := int(bucketRoot(data, lo))
	child0 := ne.Uint64(data[br*ps+16+8:])
	edit := func(f func(d []byte)) []byte {
		d := append([]byte(nil), data...)
		f(d)
		return d
	}
	inconsistent := func(root, freelist uint64) string {
		return fmt.Sprintf("meta page %d (transaction %d): root page %d, freelist page %d, high-water mark %d are inconsistent",
			newest, lo.TxID, root, freelist, hwm)
	}
	t.Run("root at the high-water mark", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint64(d[newest*ps+meta+16:], hwm); resealMeta(d, newest, ps) })
		inspectBytes(t, d, []string{inconsistent(hwm, NoFreelist)})
	})
	t.Run("freelist at the high-water mark", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint64(d[newest*ps+meta+32:], hwm); resealMeta(d, newest, ps) })
		inspectBytes(t, d, []string{inconsistent(root, hwm)})
	})
	t.Run("a child that is a meta page", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint64(d[br*ps+16+8:], 1) })
		inspectBytes(t, d, []string{fmt.Sprintf("bbolt page id 1 outside [2, %d)", hwm)})
	})
	t.Run("two children one page", func(t *testing.T) {
		d := edit(func(d []byte) { ne.PutUint64(d[br*ps+16+16+8:], child0) })
		inspectBytes(t, d, []string{fmt.Sprintf("bbolt page %d is reached twice", child0)})
	})
}

// TestInspectFindsMetaPage1AtEveryPageSize: when meta page 0 is damaged, meta page 1 is looked
// for at every page size bbolt allows, from 1024 to 65536 bytes, as bbolt does; a file with no
// valid meta page at any of them is refused saying so.
func TestInspectFindsMetaPage1AtEveryPageSize(t *testing.T) {
	for _, ps := range []int{1024, 4096, 1 << 16} {
		t.Run(fmt.Sprint(ps), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "f.db")
			db, err := bolt.Open(path, 0o600, &bolt.Options{PageSize: ps})
			if err != nil {
				t.Fatal(err)
			}
			if err := db.Close(); err != nil {
				t.Fatal(err)
			}
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			// A new file: transaction 0 in page 0, 1 in page 1. Page 0 damaged is the older one.
			data[16+16] ^= 0x04
			lo := inspectBytes(t, data, nil)
			if lo.PageSize != ps || lo.MetaPage != 1 || !strings.Contains(lo.MetaDamaged, "meta page 0: checksum mismatch") {
				t.Fatalf("page size %d with meta page 0 damaged: %+v, want meta page 1 found", ps, lo)
			}
			data[ps+16+16] ^= 0x04
			inspectBytes(t, data, []string{"has no valid bbolt meta page", "no page 1 found at any page size"})
		})
	}
}

// TestInspectRefusesPageSizesOutOfRange: a meta page 0 with a sound checksum and a page size
// that is a power of two but outside bbolt's [1024, 65536] is refused naming the page size.
func TestInspectRefusesPageSizesOutOfRange(t *testing.T) {
	data, lo := walkFixture(t)
	for _, size := range []uint32{512, 1 << 17} {
		d := append([]byte(nil), data...)
		ne.PutUint32(d[16+8:], size)
		resealMeta(d, 0, lo.PageSize)
		inspectBytes(t, d, []string{fmt.Sprintf("meta page 0 gives page size %d", size)})
	}
}

// TestInspectPicksMetaPage0OnATie: of two valid meta pages with the same transaction id, the walk
// checks page 0's tree, the one bbolt opens (it takes page 1 only when its txid is larger).
func TestInspectPicksMetaPage0OnATie(t *testing.T) {
	data, lo := walkFixture(t)
	ps := lo.PageSize
	d := append([]byte(nil), data...)
	for slot := range 2 {
		ne.PutUint64(d[slot*ps+16+48:], lo.TxID)
		resealMeta(d, slot, ps)
	}
	if got := inspectBytes(t, d, nil); got.MetaPage != 0 || got.TxID != lo.TxID {
		t.Fatalf("two meta pages of transaction %d: %+v, want meta page 0", lo.TxID, got)
	}
}

// TestInspectRefusesAWrappedOlderTxid: beside a newest meta page of transaction 0, a damaged page
// cannot be the older one (there is no transaction -1): one reading as 2^64-1 is refused, not
// taken for T-1 by wrapping around.
func TestInspectRefusesAWrappedOlderTxid(t *testing.T) {
	data, lo := walkFixture(t)
	ps, newest, older := lo.PageSize, lo.MetaPage, 1-lo.MetaPage
	d := append([]byte(nil), data...)
	ne.PutUint64(d[newest*ps+16+48:], 0)
	resealMeta(d, newest, ps)
	ne.PutUint64(d[older*ps+16+48:], ^uint64(0)) // checksum left as it was: damaged
	inspectBytes(t, d, []string{fmt.Sprintf("bbolt meta page %d is damaged (checksum mismatch) and reads as transaction %d", older, ^uint64(0))})
}

// TestInspectRefusesIdsOutOfRange: a meta page's root or freelist page that is a meta page, a
// branch's child at the high-water mark, a branch claiming more elements than its page holds,
// and a freelist that lists a meta page, the high-water mark, or more ids than fit are each
// refused by the check that names them; a freelist whose count fills its page exactly is read to
// its last id (here the zeros after the fixture's ids, page 0).
func TestInspectRefusesIdsOutOfRange(t *testing.T) {
	data, lo := walkFixture(t)
	ps, newest := lo.PageSize, lo.MetaPage
	hwm := ne.Uint64(data[newest*ps+16+40:])
	root := ne.Uint64(data[newest*ps+16+16:])
	br := int(bucketRoot(data, lo))
	sdata, slo, ids := syncedFixture(t)
	shwm := ne.Uint64(sdata[slo.MetaPage*slo.PageSize+16+40:])
	edit := func(data []byte, f func(d []byte)) []byte {
		d := append([]byte(nil), data...)
		f(d)
		return d
	}
	inconsistent := func(root, freelist uint64) string {
		return fmt.Sprintf("root page %d, freelist page %d, high-water mark %d are inconsistent", root, freelist, hwm)
	}
	fit := (slo.PageSize - 16) / 8
	for _, c := range []struct {
		name string
		data []byte
		want string
	}{
		{"root is a meta page", edit(data, func(d []byte) { ne.PutUint64(d[newest*ps+16+16:], 1); resealMeta(d, newest, ps) }), inconsistent(1, NoFreelist)},
		{"freelist is a meta page", edit(data, func(d []byte) { ne.PutUint64(d[newest*ps+16+32:], 1); resealMeta(d, newest, ps) }), inconsistent(root, 1)},
		{"a child at the high-water mark", edit(data, func(d []byte) { ne.PutUint64(d[br*ps+16+8:], hwm) }), fmt.Sprintf("bbolt page id %d outside [2, %d)", hwm, hwm)},
		{"a branch with more elements than fit", edit(data, func(d []byte) { ne.PutUint16(d[br*ps+10:], 0xFFFF) }), fmt.Sprintf("bbolt page %d claims 65535 elements, more than fit", br)},
		{"a freelist listing a meta page", edit(sdata, func(d []byte) { ne.PutUint64(d[ids:], 1) }), fmt.Sprintf("freelist page %d lists page 1, outside [2, %d)", slo.Freelist, shwm)},
		{"a freelist listing the high-water mark", edit(sdata, func(d []byte) { ne.PutUint64(d[ids:], shwm) }), fmt.Sprintf("freelist page %d lists page %d, outside [2, %d)", slo.Freelist, shwm, shwm)},
		{"a freelist filling its page", edit(sdata, func(d []byte) { ne.PutUint16(d[ids-16+10:], uint16(fit)) }), fmt.Sprintf("freelist page %d lists page 0, outside [2, %d)", slo.Freelist, shwm)},
		{"a freelist one id longer than fits", edit(sdata, func(d []byte) { ne.PutUint16(d[ids-16+10:], uint16(fit+1)) }), fmt.Sprintf("freelist page %d claims %d page ids, more than fit", slo.Freelist, fit+1)},
	} {
		t.Run(c.name, func(t *testing.T) { inspectBytes(t, c.data, []string{c.want}) })
	}
}

// nestedBuckets is the bytes of a file holding a chain of n nested buckets under the root.
func nestedBuckets(t *testing.T, n int) []byte {
	t.Helper()
	path := filepath.Join(t.TempDir(), "f.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket([]byte("n"))
		for range n - 1 {
			if err != nil {
				return err
			}
			b, err = b.CreateBucket([]byte("n"))
		}
		return err
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestInspectTreeDepthLimit: a page tree exactly maxTreeDepth levels below the root page is
// walked; one level more is refused. (The innermost of a chain of nested buckets is empty and
// lives inline in its parent's page, so a chain of maxTreeDepth+1 buckets has pages down to
// depth maxTreeDepth.)
func TestInspectTreeDepthLimit(t *testing.T) {
	inspectBytes(t, nestedBuckets(t, maxTreeDepth+1), nil)
	inspectBytes(t, nestedBuckets(t, maxTreeDepth+2), []string{fmt.Sprintf("bbolt page tree deeper than %d", maxTreeDepth)})
}

// TestInspectLongFreelistForm: a freelist page whose count field is 0xFFFF holds its count in
// its first u64 and the page ids after it (bbolt's form for 65535 ids or more); the walk reads
// it so, counting those ids.
func TestInspectLongFreelistForm(t *testing.T) {
	data, lo, ids := syncedFixture(t)
	count := int(ne.Uint16(data[ids-16+10:]))
	if 16+8+8*count > lo.PageSize {
		t.Fatalf("the fixture's %d free ids do not fit the long form in one page", count)
	}
	d := append([]byte(nil), data...)
	copy(d[ids+8:], data[ids:ids+8*count])
	ne.PutUint64(d[ids:], uint64(count))
	ne.PutUint16(d[ids-16+10:], 0xFFFF)
	if got := inspectBytes(t, d, nil); got.FreePages != count {
		t.Fatalf("a freelist of %d ids in the long form: %d free pages", count, got.FreePages)
	}
}
