package ledger

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// The anchor_kl bucket keeps, per live anchor a, what of its KL(q_v || q_a) over the committed
// posterior versions v the lapse versions of its certificates need, so that the version at which
// a certificate's bound began to fail is read from its anchor, not written per CE at a lapse.
//
// A certificate's bound holds at KL k iff it holds at every smaller k (Theorems 1 and 2 only
// widen their slack with KL): a CE whose bound fails at the anchor's current KL has been failing
// since the version after the last version at which the anchor's KL let it hold. The history
// keeps, of the versions before the current one (the anchor's stored KL version, its tail):
//
//   - an entry for version u when a certificate of the anchor lapsed at the version committed
//     after u (re-certification finds every lapse: Report.lapsed), holding KL_u and that next
//     version. For a CE under the anchor when it lapsed, u is the last version its bound held;
//   - for the versions between two entries (or between the last entry and the tail), which are
//     not kept, the smallest KL among them (the gap's minimum).
//
// An entry whose KL is at or above the tail's is deleted, its KL and gap folded into the gap
// after it: a certificate whose bound fails now cannot have held there. So entries' KLs rise
// toward the tail.
//
// A CE's lapse version is read from the tail back: the first entry at which its bound holds
// gives the version after it, unless a gap passed on the way holds a KL at which the bound
// holds (its last holding version is then one that is not kept: unknown). This is exact for a
// CE that was under the anchor when it lapsed, and exact or unknown, never wrong, for one
// stored under an anchor it had already lapsed under (a registration read late, a CE taken
// over), whatever the versions kept for other CEs.
//
//	key "m" (1 byte)                   the last version committed with the histories kept up
//	                                   to date (a build without the bucket may commit others)
//	key anchor a u64 (8 bytes)         a's head: the link of its tail
//	key version u | anchor a (16 bytes) an entry: KL_u, and its link
//	link  the version of the entry before (u64), the version after that entry (u64), the gap's
//	      minimum (f64), flags u8 (1: there is an entry before, 2: the gap is not empty)
//
// Values are sealed. An anchor with no head has no versions before its tail, which is what a
// new anchor has. A commit whose previous version is not the marker (a build without the bucket
// committed in between) starts every history again at its tail.
//
// Cost: a commit reads each live anchor's head and writes it only when a certificate lapsed,
// the gap's minimum fell, or entries were deleted; an entry per lapse version. Keys of entries
// lead with the version, so the entries of one commit share a page.
//
// The bucket is optional, like reissue: a ledger written by a build without it opens as it
// did. At Open, a damaged history is deleted, and so are heads and entries no stored anchor
// reaches (repairAnchorKL): the CEs under the anchor lose their lapse versions (unknown) until
// their bounds hold again.
var bAnchorKL = []byte("anchor_kl")

var kAnchorKLMark = []byte("m")

// klLink ties a tail or an entry to the entry before it, across the gap between them.
type klLink struct {
	prev     uint64  // the version of the entry before, when hasPrev
	prevNext uint64  // the version committed after that entry
	gapMin   float64 // the smallest KL of the versions between, when hasGap
	hasPrev  bool
	hasGap   bool
}

// fold puts a version at KL kl, not kept, into the gap.
func (l *klLink) fold(kl float64) {
	if !l.hasGap || kl < l.gapMin {
		l.gapMin, l.hasGap = kl, true
	}
}

// encode appends the link's 25 bytes to v.
func (l klLink) encode(v []byte) []byte {
	v = binary.BigEndian.AppendUint64(v, l.prev)
	v = binary.BigEndian.AppendUint64(v, l.prevNext)
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(l.gapMin))
	flags := byte(0)
	if l.hasPrev {
		flags |= 1
	}
	if l.hasGap {
		flags |= 2
	}
	return append(v, flags)
}

// decodeLink decodes 25 bytes; ok is false for values no link has.
func decodeLink(p []byte) (klLink, bool) {
	if len(p) != 25 || p[24] > 3 {
		return klLink{}, false
	}
	l := klLink{prev: binary.BigEndian.Uint64(p), prevNext: binary.BigEndian.Uint64(p[8:]),
		gapMin: math.Float64frombits(binary.BigEndian.Uint64(p[16:])), hasPrev: p[24]&1 != 0, hasGap: p[24]&2 != 0}
	if l.hasPrev && l.prevNext <= l.prev || l.hasGap && !(l.gapMin >= 0 && !math.IsInf(l.gapMin, 0)) {
		return klLink{}, false
	}
	return l, true
}

// klEntry is a kept version: its KL and its link.
type klEntry struct {
	kl float64
	klLink
}

// encode is the entry's 33 bytes: its KL, then its link.
func (e klEntry) encode() []byte {
	return e.klLink.encode(binary.BigEndian.AppendUint64(nil, math.Float64bits(e.kl)))
}

// decodeEntry decodes 33 bytes; ok is false for values no entry has.
func decodeEntry(p []byte) (klEntry, bool) {
	if len(p) != 33 {
		return klEntry{}, false
	}
	l, ok := decodeLink(p[8:])
	e := klEntry{kl: math.Float64frombits(binary.BigEndian.Uint64(p)), klLink: l}
	return e, ok && e.kl >= 0 && !math.IsInf(e.kl, 0)
}

// headKey is the key of anchor's head; entryKey that of its entry at version.
func headKey(anchor uint64) []byte { return u64bytes(anchor) }

func entryKey(version, anchor uint64) []byte {
	return binary.BigEndian.AppendUint64(u64bytes(version), anchor)
}

// klStore is where a history lives: the bucket, or memory (pastAnchorKL).
type klStore interface {
	head() (klLink, bool, error)
	putHead(klLink) error
	entry(version uint64) (klEntry, bool, error)
	putEntry(version uint64, e klEntry) error
	delEntry(version uint64) error
}

// bucketKL is one anchor's history in the bucket.
type bucketKL struct {
	b      *bolt.Bucket
	anchor uint64
}

func (s bucketKL) head() (klLink, bool, error) {
	k := headKey(s.anchor)
	raw := s.b.Get(k)
	if raw == nil {
		return klLink{}, false, nil
	}
	p, ok := unseal(k, raw)
	l, ok2 := decodeLink(p)
	if !ok || !ok2 {
		return klLink{}, false, corruptf("%s head of anchor %d: checksum mismatch or not a head", bAnchorKL, s.anchor)
	}
	return l, true, nil
}

func (s bucketKL) putHead(l klLink) error { return putSealed(s.b, headKey(s.anchor), l.encode(nil)) }

func (s bucketKL) entry(v uint64) (klEntry, bool, error) {
	k := entryKey(v, s.anchor)
	raw := s.b.Get(k)
	if raw == nil {
		return klEntry{}, false, nil
	}
	p, ok := unseal(k, raw)
	e, ok2 := decodeEntry(p)
	if !ok || !ok2 {
		return klEntry{}, false, corruptf("%s entry of anchor %d at version %d: checksum mismatch or not an entry", bAnchorKL, s.anchor, v)
	}
	return e, true, nil
}

func (s bucketKL) putEntry(v uint64, e klEntry) error {
	return putSealed(s.b, entryKey(v, s.anchor), e.encode())
}

func (s bucketKL) delEntry(v uint64) error { return s.b.Delete(entryKey(v, s.anchor)) }

// memKL is a history in memory.
type memKL struct {
	h       klLink
	entries map[uint64]klEntry
}

func (m *memKL) head() (klLink, bool, error) { return m.h, true, nil }
func (m *memKL) putHead(l klLink) error      { m.h = l; return nil }
func (m *memKL) delEntry(v uint64) error     { delete(m.entries, v); return nil }
func (m *memKL) putEntry(v uint64, e klEntry) error {
	m.entries[v] = e
	return nil
}
func (m *memKL) entry(v uint64) (klEntry, bool, error) {
	e, ok := m.entries[v]
	return e, ok, nil
}

// advance records that the posterior version `version` was committed with the anchor at KL
// kl, its tail having been tailKL at tailVersion; lapsed says a certificate of the anchor lapsed
// at `version`. The old tail becomes an entry if so, or joins the gap; then the entries at or
// above kl are deleted into the gap.
func advance(s klStore, tailVersion uint64, tailKL float64, version uint64, kl float64, lapsed bool) error {
	h, _, err := s.head()
	if err != nil {
		return err
	}
	was := h
	if lapsed {
		if err := s.putEntry(tailVersion, klEntry{kl: tailKL, klLink: h}); err != nil {
			return err
		}
		h = klLink{prev: tailVersion, prevNext: version, hasPrev: true}
	} else {
		h.fold(tailKL)
	}
	for h.hasPrev {
		e, ok, err := s.entry(h.prev)
		if err != nil {
			return err
		}
		if !ok {
			return corruptf("%s: the entry at version %d is missing", bAnchorKL, h.prev)
		}
		if e.kl < kl {
			break
		}
		if err := s.delEntry(h.prev); err != nil {
			return err
		}
		gap := h
		h = e.klLink
		h.fold(e.kl)
		if gap.hasGap {
			h.fold(gap.gapMin)
		}
	}
	if h == was {
		return nil
	}
	return s.putHead(h)
}

// klStep is one link of a history read from the tail back: the gap before what the link ties
// to, then the entry it names (none at the history's start).
type klStep struct {
	gapMin   float64
	hasGap   bool
	kl       float64 // the entry's KL, when hasEntry
	next     uint64  // the version committed after the entry
	hasEntry bool
}

// readChain reads a history from its head back to its start.
func readChain(s klStore) ([]klStep, error) {
	h, ok, err := s.head()
	if err != nil || !ok {
		return nil, err
	}
	var steps []klStep
	for {
		st := klStep{gapMin: h.gapMin, hasGap: h.hasGap}
		if !h.hasPrev {
			return append(steps, st), nil
		}
		e, ok, err := s.entry(h.prev)
		if err != nil || !ok {
			if err == nil {
				err = corruptf("%s: the entry at version %d is missing", bAnchorKL, h.prev)
			}
			return nil, err
		}
		st.kl, st.next, st.hasEntry = e.kl, h.prevNext, true
		steps = append(steps, st)
		h = e.klLink
	}
}

// lapseVersion reads, from the tail back, the version since which a bound that holds at KL k
// iff holds(k) has failed: the version after the first entry at which it holds. ok is false
// when it holds at the tail, or when the version is not known: a gap passed on the way holds a
// KL at which it holds (the last version it held at is not kept), or no entry does.
func lapseVersion(chain []klStep, tailKL float64, holds func(kl float64) bool) (uint64, bool) {
	if holds(tailKL) {
		return 0, false
	}
	for _, st := range chain {
		switch {
		case st.hasGap && holds(st.gapMin), !st.hasEntry:
			return 0, false
		case holds(st.kl):
			return st.next, true
		}
	}
	return 0, false
}

// recordAnchorKL advances anchor's history (advance) in b, the bucket beginAnchorKL gave. A
// history found damaged (since Open checked it) starts again at the new tail: its lapse versions
// become unknown, and the commit goes on.
func recordAnchorKL(b *bolt.Bucket, anchor, tailVersion uint64, tailKL float64, version uint64, kl float64, lapsed bool) error {
	err := advance(bucketKL{b, anchor}, tailVersion, tailKL, version, kl, lapsed)
	if errors.Is(err, ErrCorrupt) {
		return dropHistory(b, anchor)
	}
	return err
}

// beginAnchorKL gives the bucket a commit from posterior version old to a new version records
// the live anchors' KL in: when the last commit that kept the histories was not old's (a build
// without the bucket committed since, or its marker is damaged), every history starts again at
// its tail. endAnchorKL records that the new version kept them.
func beginAnchorKL(tx *bolt.Tx, old uint64) (*bolt.Bucket, error) {
	if b := tx.Bucket(bAnchorKL); b != nil {
		if m, err := getU64(b, kAnchorKLMark, "anchor_kl marker"); err == nil && m == old && b.Get(kAnchorKLMark) != nil {
			return b, nil
		}
		if err := tx.DeleteBucket(bAnchorKL); err != nil {
			return nil, err
		}
	}
	return tx.CreateBucket(bAnchorKL)
}

func endAnchorKL(b *bolt.Bucket, next uint64) error { return putU64(b, kAnchorKLMark, next) }

// dropAnchorKL deletes anchor's history (dropHistory), if the bucket exists.
func dropAnchorKL(tx *bolt.Tx, anchor uint64) error {
	if b := tx.Bucket(bAnchorKL); b != nil {
		return dropHistory(b, anchor)
	}
	return nil
}

// dropHistory deletes anchor's history: its head, and the entries it reaches while they decode
// (Open deletes any others as strays).
func dropHistory(b *bolt.Bucket, anchor uint64) error {
	s := bucketKL{b, anchor}
	h, _, err := s.head()
	if err := b.Delete(headKey(anchor)); err != nil {
		return err
	}
	for err == nil && h.hasPrev {
		var e klEntry
		var ok bool
		if e, ok, err = s.entry(h.prev); err != nil || !ok {
			break
		}
		if err := s.delEntry(h.prev); err != nil {
			return err
		}
		h = e.klLink
	}
	return nil
}

// writeAnchorKL writes m as the history of a new anchor, at the current version cur.
func writeAnchorKL(tx *bolt.Tx, anchor, cur uint64, m *memKL) error {
	b, err := tx.CreateBucketIfNotExists(bAnchorKL)
	if err != nil {
		return err
	}
	if b.Get(kAnchorKLMark) == nil { // the histories are kept from here on
		if err := endAnchorKL(b, cur); err != nil {
			return err
		}
	}
	s := bucketKL{b, anchor}
	for _, v := range slices.Sorted(maps.Keys(m.entries)) {
		if err := s.putEntry(v, m.entries[v]); err != nil {
			return err
		}
	}
	if m.h == (klLink{}) {
		return nil
	}
	return s.putHead(m.h)
}

// pastAnchorKL is the history anchor v (the posterior past[v]) would have here had this ledger
// held it, with the certificates certs under it, over the versions of past that run without a
// gap from cur-1 down (from v itself, at KL 0, when they reach it), for a snapshot anchor stored
// at the current version cur at KL curKL (CEs restored or registered under a past posterior).
// Posterior versions run without gaps (update.Update makes prev.Version+1). Its lapse versions
// for those CEs are those of an owner that held them under the anchor, where past reaches back
// far enough; unknown otherwise. With every set it keeps the KL of every version (as if a
// certificate lapsed at each), so that the lapse version of any certificate under the anchor
// is known.
func pastAnchorKL(past map[uint64]*bnn.Model, v, cur uint64, curKL float64, pol certify.Policy, certs []certify.Certificate, every bool) (*memKL, error) {
	m := &memKL{entries: map[uint64]klEntry{}}
	lo := cur
	for lo > v+1 {
		pm, ok := past[lo-1]
		if !ok || pm == nil || pm.Version != lo-1 {
			break
		}
		lo--
	}
	tv, tkl := lo, curKL // with no past posterior, the history starts at the tail
	switch {
	case lo == v+1:
		tv, tkl = v, 0 // from the anchor itself
	case lo < cur:
		var err error
		if tkl, _, err = certify.KL(past[lo], past[v]); err != nil {
			return nil, fmt.Errorf("KL of posterior %d from anchor %d: %w", lo, v, err)
		}
	}
	for u := tv + 1; u <= cur; u++ {
		kl := curKL
		if u < cur {
			var err error
			if kl, _, err = certify.KL(past[u], past[v]); err != nil {
				return nil, fmt.Errorf("KL of posterior %d from anchor %d: %w", u, v, err)
			}
		}
		lapsed := every || slices.ContainsFunc(certs, func(c certify.Certificate) bool {
			return pol.Bounds(c, tkl).Certified && !pol.Bounds(c, kl).Certified
		})
		if err := advance(m, tv, tkl, u, kl, lapsed); err != nil {
			return nil, err
		}
		tv, tkl = u, kl
	}
	return m, nil
}

// failingSince is the posterior version since which the bound of cert, under anchor a (its
// stored KL), has failed at every version the ledger committed (lapseVersion); ok is false when
// it holds, or the version is not known, or the history is damaged (Open deletes it). reads,
// when not nil, keeps the histories one read transaction has read, for the next CEs of a list.
func failingSince(tx *bolt.Tx, pol certify.Policy, cert certify.Certificate, anchor uint64, a anchorMeta, reads *klReads) (uint64, bool) {
	holds := func(kl float64) bool { return pol.Bounds(cert, kl).Certified }
	if holds(a.kl) {
		return 0, false
	}
	var chain []klStep
	if reads != nil {
		if reads.chains == nil {
			reads.chains, reads.b = map[uint64][]klStep{}, tx.Bucket(bAnchorKL)
		}
		var read bool
		if chain, read = reads.chains[anchor]; !read && reads.b != nil {
			chain, _ = readChain(bucketKL{reads.b, anchor}) // damaged: no chain, no version
			reads.chains[anchor] = chain
		}
	} else if b := tx.Bucket(bAnchorKL); b != nil {
		chain, _ = readChain(bucketKL{b, anchor})
	}
	return lapseVersion(chain, a.kl, holds)
}

// klReads are the anchors' histories one read transaction has read (a list reads the history of
// an anchor once for all its CEs).
type klReads struct {
	b      *bolt.Bucket
	chains map[uint64][]klStep
}

// klDamage is what anchorKLDamage found: the anchors whose history is damaged, with what is
// wrong, and the keys of heads and entries no stored anchor's history reaches.
type klDamage struct {
	anchors map[uint64]string
	strays  [][]byte
}

// anchorKLDamage checks every stored anchor's history: its head and entries decode, each link
// names an entry that is stored, entries' KLs rise toward the tail and stay below it, and every
// entry's version comes after the version after the entry before it. Heads and entries no
// stored anchor reaches, and keys of no kind, are strays.
func anchorKLDamage(tx *bolt.Tx, anchors map[uint64]anchorMeta) klDamage {
	d := klDamage{anchors: map[uint64]string{}}
	b := tx.Bucket(bAnchorKL)
	if b == nil {
		return d
	}
	reached := map[string]bool{string(kAnchorKLMark): true}
	for _, a := range slices.Sorted(maps.Keys(anchors)) {
		if why := historyDamage(bucketKL{b, a}, anchors[a], reached); why != "" {
			d.anchors[a] = why
		}
	}
	if _, err := getU64(b, kAnchorKLMark, "anchor_kl marker"); err != nil {
		delete(reached, string(kAnchorKLMark)) // a damaged marker: deleted, histories start again
	}
	b.ForEach(func(k, _ []byte) error {
		if reached[string(k)] {
			return nil
		}
		a := uint64(math.MaxUint64)
		switch len(k) {
		case 8:
			a = binary.BigEndian.Uint64(k)
		case 16:
			a = binary.BigEndian.Uint64(k[8:])
		}
		if _, bad := d.anchors[a]; !bad {
			d.strays = append(d.strays, bytes.Clone(k))
		}
		return nil
	})
	return d
}

// historyDamage says what is wrong with one anchor's history ("" when nothing), marking the
// keys it reaches.
func historyDamage(s bucketKL, a anchorMeta, reached map[string]bool) string {
	h, ok, err := s.head()
	if err != nil {
		return err.Error()
	}
	if !ok {
		return ""
	}
	reached[string(headKey(s.anchor))] = true
	upper := a.kl // entries' KLs stay below the tail's, and rise toward it
	for h.hasPrev {
		e, ok, err := s.entry(h.prev)
		switch {
		case err != nil:
			return err.Error()
		case !ok:
			return fmt.Sprintf("the entry at version %d is missing", h.prev)
		case e.kl >= upper:
			return fmt.Sprintf("the entry at version %d holds KL %v, not below the next one's %v", h.prev, e.kl, upper)
		case e.hasPrev && e.prevNext > h.prev:
			return fmt.Sprintf("the entry at version %d comes before the version after the entry before it (%d)", h.prev, e.prevNext)
		}
		reached[string(entryKey(h.prev, s.anchor))] = true
		upper, h = e.kl, e.klLink
	}
	return ""
}

// repairAnchorKL deletes the damaged histories and the strays Open's record check found,
// naming each damaged anchor in an ERROR line and counting the strays in a WARN line (heads and
// entries of anchors a build without the bucket released, or of histories that started again).
// The CEs under a damaged anchor lose their lapse versions until their bounds hold again;
// nothing else reads the histories.
func (l *Ledger) repairAnchorKL(d klDamage) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bAnchorKL)
		keys := slices.Clone(d.strays)
		b.ForEach(func(k, _ []byte) error {
			var a uint64
			switch len(k) {
			case 8:
				a = binary.BigEndian.Uint64(k)
			case 16:
				a = binary.BigEndian.Uint64(k[8:])
			default:
				return nil
			}
			if _, bad := d.anchors[a]; bad {
				keys = append(keys, bytes.Clone(k))
			}
			return nil
		})
		for _, k := range keys {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return corrupt(l.path, fmt.Errorf("ledger: deleting %d damaged anchor KL histories: %w", len(d.anchors), err))
	}
	for _, v := range slices.Sorted(maps.Keys(d.anchors)) {
		l.log.Error("ledger: an anchor's KL history is damaged; it was deleted, and starts again at the next update "+
			"(the lapsed certificates under it show no renewal_pending_since until their bounds hold again)",
			"path", l.path, "bucket", string(bAnchorKL), "anchor", v, "reason", d.anchors[v])
	}
	if len(d.strays) > 0 {
		l.log.Warn("ledger: anchor KL records that no stored anchor's history reaches were deleted",
			"path", l.path, "bucket", string(bAnchorKL), "records", len(d.strays))
	}
	return nil
}
