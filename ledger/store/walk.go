package store

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"runtime/debug"
	"syscall"
)

// The structural check of a bbolt file, run before bbolt sees it.
//
// bbolt trusts its file: it initialises a 0-byte file (that is how an empty file once replaced a
// ledger), and a truncated or damaged one makes it panic (assertion failed: Page expected to
// be...) or fault on memory beyond the file's end, and a freelist that lists a page in use lets
// the next commit overwrite live data. So Open reads the two meta pages itself (magic, version,
// FNV-64a checksum), checks that the file holds every page up to the high-water mark of the
// transaction it will open, and then walks the page tree from that meta page with bounds-checked
// reads: every page id below the high-water mark, page headers naming their own id and a known
// type, elements and keys inside their page, keys ascending within each bucket (and within the
// bounds the parent branch gives), no page reached twice, no page both reachable and on the
// freelist, and every page below the high-water mark either reachable or free (when the meta
// page records a freelist: a ledger's does not, see boltOpen, and then the pages the tree does
// not reach are the free ones). This is what
// bbolt's tx.Check verifies, done without the faults Check itself can hit on a damaged file (it
// dereferences page ids before checking them, in a goroutine of its own that no recover can
// reach). Values are not checked here: every ledger value carries its own CRC-32C (Seal).
//
// The layout (bbolt's on-disk format, version 2, native byte order):
//
//	page header (16 bytes): id u64, flags u16, count u16, overflow u32
//	meta (after the header): magic u32, version u32, page size u32, flags u32, root bucket
//	  (root page u64, sequence u64), freelist page u64 (all ones: none, the freelist is not
//	  synced), high-water mark u64, txid u64,
//	  checksum u64 = FNV-64a of the 56 bytes before it
//	branch element (16 bytes): pos u32, ksize u32, child page u64; key at element + pos
//	leaf element (16 bytes): flags u32 (1 = bucket), pos u32, ksize u32, vsize u32
//	bucket value: root page u64, sequence u64, then an inline leaf page when root = 0
//	freelist page: count page ids u64 (count 0xFFFF: the first u64 is the count)
const (
	boltMagic      = 0xED0CDAED
	boltVersion    = 2
	pageHeaderSize = 16
	elementSize    = 16
	metaSize       = 64
	metaSumOff     = 56
	flagBranch     = 0x01
	flagLeaf       = 0x02
	flagMeta       = 0x04
	flagFreelist   = 0x10
	flagBucketLeaf = 0x01
	maxTreeDepth   = 64
)

var ne = binary.NativeEndian

// metaPage is one decoded bbolt meta page.
type metaPage struct {
	valid    bool
	why      string // when not valid
	pageSize int
	root     uint64
	freelist uint64
	hwm      uint64 // pages in use: every page id is below it
	txid     uint64
	// For a page that is not valid: its transaction id and high-water mark as read, unverified
	// (read is false when the page lies beyond the end of the file).
	read bool
}

func parseMeta(b []byte) metaPage {
	if len(b) < pageHeaderSize+metaSize {
		return metaPage{why: "beyond the end of the file"}
	}
	m := b[pageHeaderSize : pageHeaderSize+metaSize]
	h := fnv.New64a()
	h.Write(m[:metaSumOff])
	p := metaPage{read: true, pageSize: int(ne.Uint32(m[8:])), root: ne.Uint64(m[16:]),
		freelist: ne.Uint64(m[32:]), hwm: ne.Uint64(m[40:]), txid: ne.Uint64(m[48:])}
	switch {
	case ne.Uint32(m) != boltMagic:
		p.why = "not a bbolt meta page (bad magic)"
	case ne.Uint32(m[4:]) != boltVersion:
		p.why = fmt.Sprintf("bbolt format version %d, want %d", ne.Uint32(m[4:]), boltVersion)
	case ne.Uint64(m[metaSumOff:]) != h.Sum64():
		p.why = "checksum mismatch"
	default:
		p.valid = true
	}
	return p
}

// geometry is what the meta pages say about a file.
type geometry struct {
	size     int64
	pageSize int
	meta     metaPage // the meta bbolt will open: the valid one with the larger txid
	slot     int      // its page (0 or 1)
	other    metaPage // the other meta page
}

// readMetas reads and checks both meta pages and the file size. It does not walk the tree.
func readMetas(f *os.File) (geometry, error) {
	fi, err := f.Stat()
	if err != nil {
		return geometry{}, err
	}
	g := geometry{size: fi.Size()}
	if g.size == 0 {
		return g, Corruptf("the file is empty (0 bytes); a ledger file holds at least two bbolt meta pages, so it was truncated or created by something else")
	}
	head := make([]byte, min(g.size, 4096))
	if _, err := f.ReadAt(head, 0); err != nil && err != io.EOF {
		return g, err
	}
	m0 := parseMeta(head)
	ps := m0.pageSize
	if !m0.valid {
		// Find the second meta page as bbolt does: at each possible page size.
		for ps = 1024; ps <= 1<<16; ps *= 2 {
			b := make([]byte, pageHeaderSize+metaSize)
			if n, _ := f.ReadAt(b, int64(ps)); n == len(b) {
				if m := parseMeta(b); m.valid && m.pageSize == ps {
					break
				}
			}
		}
		if ps > 1<<16 {
			return g, Corruptf("the file (%d bytes) has no valid bbolt meta page (page 0: %s; no page 1 found at any page size)", g.size, m0.why)
		}
	}
	if ps < 1024 || ps > 1<<16 || ps&(ps-1) != 0 {
		return g, Corruptf("meta page 0 gives page size %d", ps)
	}
	g.pageSize = ps
	b := make([]byte, pageHeaderSize+metaSize)
	m1 := metaPage{why: "beyond the end of the file"}
	if n, _ := f.ReadAt(b, int64(ps)); n == len(b) {
		m1 = parseMeta(b)
	}
	if m1.valid && m1.pageSize != ps {
		m1 = metaPage{why: fmt.Sprintf("page size %d differs from page 0's %d", m1.pageSize, ps)}
	}
	switch {
	case m0.valid && (!m1.valid || m0.txid >= m1.txid):
		g.meta, g.slot, g.other = m0, 0, m1
	case m1.valid:
		g.meta, g.slot, g.other = m1, 1, m0
	default:
		return g, Corruptf("neither bbolt meta page is valid (page 0: %s; page 1: %s)", m0.why, m1.why)
	}
	if err := g.olderDamaged(); err != nil {
		return g, err
	}
	m := g.meta
	switch {
	case m.hwm < 3 || m.root < 2 || m.root >= m.hwm || m.freelist != NoFreelist && (m.freelist < 2 || m.freelist >= m.hwm):
		return g, Corruptf("meta page %d (transaction %d): root page %d, freelist page %d, high-water mark %d are inconsistent", g.slot, m.txid, m.root, m.freelist, m.hwm)
	case m.hwm > uint64(g.size)/uint64(ps):
		return g, Corruptf("the file is %d bytes but its last transaction (%d) uses %d pages of %d bytes (%d bytes): it was truncated",
			g.size, m.txid, m.hwm, ps, m.hwm*uint64(ps))
	}
	return g, nil
}

// olderDamaged refuses a file whose damaged meta page may hold a newer transaction than the
// valid one (see "A damaged meta page" in doc.go). bbolt writes transaction t's meta page to
// page t mod 2, so the page beside transaction T holds T-1 (older) or T+1 (newer). A damaged
// page is tolerated only when it reads as T-1, with a high-water mark not above T's (bbolt
// never lowers it): then the transaction it lost is one the valid page already contains.
// Anything else, including a damaged transaction id or a page that reads as T+1, is refused,
// because opening would fall back to T in silence and lose what T+1 acknowledged. (The one
// damage this cannot see is a newest page whose transaction id itself was changed to exactly
// T-1, with its other fields intact: the page then reads as the older one.)
func (g geometry) olderDamaged() error {
	o, m := g.other, g.meta
	if o.valid || !o.read { // a missing page 1: the size check reports the truncation
		return nil
	}
	if m.txid > 0 && o.txid == m.txid-1 && o.hwm <= m.hwm {
		return nil
	}
	lost := "a later transaction than"
	if o.txid == m.txid+1 {
		lost = fmt.Sprintf("transaction %d, one later than", o.txid)
	}
	return Corruptf("bbolt meta page %d is damaged (%s) and reads as transaction %d, so it may hold %s the transaction %d in meta page %d. "+
		"Opening the file would fall back to transaction %d without a word and lose everything the newer one committed "+
		"(counterfactuals answered 201, checkpoints whose offsets went to Kafka); cfguard refuses instead. "+
		"A commit interrupted by power loss leaves the same picture, and then the newer transaction was never acknowledged, "+
		"but nothing in the file tells the two apart",
		1-g.slot, o.why, o.txid, lost, m.txid, g.slot, m.txid)
}

// walkStats counts what the walk saw.
type walkStats struct {
	Pages, FreePages, Buckets, Keys int
	InUse                           []uint64
}

// walker checks the page tree of data (the file up to the high-water mark).
type walker struct {
	data        []byte
	ps          int
	hwm         uint64
	reach, free []bool
	stats       walkStats
}

// walkFile maps the file read-only and walks it. Faults (the file shrinking under us) and
// panics become errors.
func walkFile(f *os.File, g geometry) (st walkStats, err error) {
	n := int(g.meta.hwm) * g.pageSize
	data, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return st, fmt.Errorf("map %d bytes: %w", n, err)
	}
	defer syscall.Munmap(data)
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = Corruptf("reading the page tree failed: %v", r)
		}
	}()
	w := &walker{data: data, ps: g.pageSize, hwm: g.meta.hwm, reach: make([]bool, g.meta.hwm), free: make([]bool, g.meta.hwm)}
	return w.walk(g.meta)
}

// walk checks the tree of meta page m. When m records a freelist page, the freelist and the
// tree must partition the pages below the high-water mark. When it records none (the freelist is
// not synced, see boltOpen), bbolt takes every page the tree does not reach as free, so there is
// nothing to cross-check: the walk counts those pages as free.
func (w *walker) walk(m metaPage) (walkStats, error) {
	w.reach[0], w.reach[1] = true, true
	synced := m.freelist != NoFreelist
	if synced {
		if err := w.freelist(m.freelist); err != nil {
			return w.stats, err
		}
	}
	if err := w.node(m.root, nil, nil, 0); err != nil {
		return w.stats, err
	}
	for id := uint64(2); id < w.hwm; id++ {
		switch {
		case w.reach[id] || w.free[id]:
		case synced:
			return w.stats, Corruptf("bbolt page %d is neither in use nor on the freelist", id)
		default:
			w.stats.FreePages++
		}
	}
	for id, r := range w.reach {
		if r {
			w.stats.InUse = append(w.stats.InUse, uint64(id))
		}
	}
	return w.stats, nil
}

// page returns the span of page id (with its overflow pages) after checking its header.
func (w *walker) page(id uint64, want uint16) ([]byte, uint16, error) {
	if id < 2 || id >= w.hwm {
		return nil, 0, Corruptf("bbolt page id %d outside [2, %d)", id, w.hwm)
	}
	off := int(id) * w.ps
	hdr := w.data[off : off+pageHeaderSize]
	flags, count, overflow := ne.Uint16(hdr[8:]), ne.Uint16(hdr[10:]), uint64(ne.Uint32(hdr[12:]))
	typeOK := flags == flagFreelist
	if want != flagFreelist {
		typeOK = flags == flagBranch || flags == flagLeaf
	}
	switch {
	case ne.Uint64(hdr) != id:
		return nil, 0, Corruptf("bbolt page %d says it is page %d", id, ne.Uint64(hdr))
	case !typeOK:
		return nil, 0, Corruptf("bbolt page %d has type %#x, want %#x", id, flags, want)
	case id+overflow >= w.hwm:
		return nil, 0, Corruptf("bbolt page %d with %d overflow pages runs past the high-water mark %d", id, overflow, w.hwm)
	}
	for p := id; p <= id+overflow; p++ {
		if w.reach[p] {
			return nil, 0, Corruptf("bbolt page %d is reached twice", p)
		}
		if w.free[p] {
			return nil, 0, Corruptf("bbolt page %d is in use and on the freelist", p)
		}
		w.reach[p] = true
	}
	w.stats.Pages += int(overflow) + 1
	span := w.data[off : off+int(overflow+1)*w.ps]
	if pageHeaderSize+int(count)*elementSize > len(span) && flags != flagFreelist {
		return nil, 0, Corruptf("bbolt page %d claims %d elements, more than fit", id, count)
	}
	return span, count, nil
}

func (w *walker) freelist(id uint64) error {
	span, count, err := w.page(id, flagFreelist)
	if err != nil {
		return err
	}
	start, n := pageHeaderSize, uint64(count)
	if count == 0xFFFF {
		if len(span) < pageHeaderSize+8 {
			return Corruptf("freelist page %d is too short", id)
		}
		n, start = ne.Uint64(span[pageHeaderSize:]), pageHeaderSize+8
	}
	if n > uint64(len(span)-start)/8 {
		return Corruptf("freelist page %d claims %d page ids, more than fit", id, n)
	}
	for i := 0; i < int(n); i++ {
		p := ne.Uint64(span[start+8*i:])
		switch {
		case p < 2 || p >= w.hwm:
			return Corruptf("freelist page %d lists page %d, outside [2, %d)", id, p, w.hwm)
		case w.free[p]:
			return Corruptf("freelist page %d lists page %d twice", id, p)
		case w.reach[p]:
			return Corruptf("freelist page %d lists page %d, which is in use", id, p)
		}
		w.free[p] = true
	}
	w.stats.FreePages = int(n)
	return nil
}

// node walks the page tree rooted at page id; every key must lie in [lo, hi) (nil: unbounded).
func (w *walker) node(id uint64, lo, hi []byte, depth int) error {
	if depth > maxTreeDepth {
		return Corruptf("bbolt page tree deeper than %d at page %d", maxTreeDepth, id)
	}
	span, count, err := w.page(id, flagBranch|flagLeaf)
	if err != nil {
		return err
	}
	if ne.Uint16(span[8:]) == flagLeaf {
		return w.leaf(span, count, lo, hi, depth, fmt.Sprintf("bbolt page %d", id))
	}
	if count == 0 {
		return Corruptf("bbolt branch page %d is empty", id)
	}
	var prev []byte
	for i := 0; i < int(count); i++ {
		e := pageHeaderSize + i*elementSize
		pos, ksize, child := int(ne.Uint32(span[e:])), int(ne.Uint32(span[e+4:])), ne.Uint64(span[e+8:])
		if pos > len(span)-e || ksize > len(span)-e-pos {
			return Corruptf("bbolt page %d: element %d lies outside the page", id, i)
		}
		key := span[e+pos : e+pos+ksize]
		if err := inOrder(key, prev, lo, hi); err != nil {
			return InRecord(err, "bbolt page %d element %d", id, i)
		}
		prev = key
		chi := hi
		if i+1 < int(count) {
			n := pageHeaderSize + (i+1)*elementSize
			npos, nks := int(ne.Uint32(span[n:])), int(ne.Uint32(span[n+4:]))
			if npos > len(span)-n || nks > len(span)-n-npos {
				return Corruptf("bbolt page %d: element %d lies outside the page", id, i+1)
			}
			chi = span[n+npos : n+npos+nks]
		}
		if err := w.node(child, key, chi, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// leaf checks a leaf page (or an inline bucket's page) and recurses into sub-buckets.
func (w *walker) leaf(span []byte, count uint16, lo, hi []byte, depth int, where string) error {
	var prev []byte
	for i := 0; i < int(count); i++ {
		e := pageHeaderSize + i*elementSize
		flags, pos, ksize, vsize := ne.Uint32(span[e:]), int(ne.Uint32(span[e+4:])), int(ne.Uint32(span[e+8:])), int(ne.Uint32(span[e+12:]))
		if flags&^flagBucketLeaf != 0 {
			return Corruptf("%s: element %d has flags %#x", where, i, flags)
		}
		if pos > len(span)-e || ksize > len(span)-e-pos || vsize > len(span)-e-pos-ksize {
			return Corruptf("%s: element %d lies outside the page", where, i)
		}
		key := span[e+pos : e+pos+ksize]
		val := span[e+pos+ksize : e+pos+ksize+vsize]
		if err := inOrder(key, prev, lo, hi); err != nil {
			return InRecord(err, "%s element %d", where, i)
		}
		prev = key
		w.stats.Keys++
		if flags&flagBucketLeaf == 0 {
			continue
		}
		w.stats.Buckets++
		if len(val) < 16 {
			return Corruptf("%s: bucket %q has a %d-byte header", where, key, len(val))
		}
		if root := ne.Uint64(val); root != 0 {
			if err := w.node(root, nil, nil, depth+1); err != nil {
				return InRecord(err, "bucket %q", key)
			}
			continue
		}
		inline := val[16:]
		if len(inline) < pageHeaderSize || ne.Uint16(inline[8:]) != flagLeaf {
			return Corruptf("%s: inline bucket %q has no leaf page", where, key)
		}
		n := ne.Uint16(inline[10:])
		if pageHeaderSize+int(n)*elementSize > len(inline) {
			return Corruptf("%s: inline bucket %q claims %d elements, more than fit", where, key, n)
		}
		if err := w.leaf(inline, n, nil, nil, depth+1, fmt.Sprintf("inline bucket %q", key)); err != nil {
			return err
		}
	}
	return nil
}

// inOrder checks prev < key and lo <= key < hi.
func inOrder(key, prev, lo, hi []byte) error {
	switch {
	case prev != nil && bytes.Compare(prev, key) >= 0:
		return Corruptf("keys out of order (%x after %x)", key, prev)
	case lo != nil && bytes.Compare(key, lo) < 0:
		return Corruptf("key %x below its branch key %x", key, lo)
	case hi != nil && bytes.Compare(key, hi) >= 0:
		return Corruptf("key %x not below the next branch key %x", key, hi)
	}
	return nil
}

// Layout is what the structural check found in a file: its meta pages and its page tree.
type Layout struct {
	Size     int64
	PageSize int
	// TxID is the transaction bbolt opens: the newest one with a valid meta page, in page
	// MetaPage (0 or 1).
	TxID     uint64
	MetaPage int
	// Freelist is the freelist page that transaction records, NoFreelist when none (the freelist
	// is not synced, see Options.SyncFreelist).
	Freelist uint64
	// Pages is the number of pages the tree reaches; FreePages the number of free ones.
	Pages, FreePages int
	// InUse lists, ascending, the ids of the pages that hold the transaction: the two meta pages,
	// the freelist page when there is one, and the pages the tree reaches with their overflow
	// pages. A byte anywhere else (a free page, or past the high-water mark) is not read.
	InUse []uint64
	// MetaDamaged says why the other meta page is invalid ("" when both are valid).
	MetaDamaged string
}

// NoFreelist is Layout.Freelist for a file whose meta page records no freelist page (all ones).
const NoFreelist = ^uint64(0)

// Inspect checks the file's meta pages and size and walks its page tree, without writing to it
// or taking a lock. A damaged file gives an error wrapping ErrCorrupt (not yet naming the file:
// see InFile).
func Inspect(f *os.File) (Layout, error) {
	g, err := readMetas(f)
	if err != nil {
		return Layout{}, err
	}
	st, err := walkFile(f, g)
	if err != nil {
		return Layout{}, err
	}
	return g.layout(st), nil
}

// layout describes g after a walk that counted st.
func (g geometry) layout(st walkStats) Layout {
	lo := Layout{Size: g.size, PageSize: g.pageSize, TxID: g.meta.txid, MetaPage: g.slot, Freelist: g.meta.freelist,
		Pages: st.Pages, FreePages: st.FreePages, InUse: st.InUse}
	if !g.other.valid {
		lo.MetaDamaged = fmt.Sprintf("meta page %d: %s", 1-g.slot, g.other.why)
	}
	return lo
}
