package ledger

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// The anchor_kl bucket keeps, per live anchor a, a history of KL(q_v || q_a) over the posterior
// versions v the ledger committed, so that the version at which a certificate's bound began to
// fail is a walk of its anchor's history instead of a write per CE at every lapse.
//
// A certificate's bound holds at KL k iff it holds at every smaller k (Theorems 1 and 2 only
// widen their slack with KL), so a CE whose bound fails at the newest version has been failing
// since the version committed after the last version at which its anchor's KL let it hold.
// Only that last version matters, for any threshold, so the history keeps the strict suffix
// minima of the anchor's KL: appending KL(q_v || q_a) deletes every entry whose KL is at or
// above it, and what stays has KL rising with the version.
//
//	key   posterior version v u64 | anchor version a u64
//	value KL(q_v || q_a) f64 | the version of the entry before it in a's history u64 |
//	      the version committed after that entry u64 | flags u8 (1: there is an entry before
//	      it), sealed
//
// Keys lead with the posterior version, so that a commit's writes (one entry per live anchor,
// the entries it outdates, which are recent, and the entries that pass the horizon, which are
// the oldest) fall on a few pages whatever the number of anchors. An anchor's history is read
// from its newest entry, at the anchor's stored KL version (anchorMeta.klVersion), back through
// each entry's predecessor. The version committed after an entry is kept in its successor,
// since the entries between the two may be gone.
//
// The history covers the last anchorKLHorizon posterior versions: a commit deletes the entries
// of older versions (pruneAnchorKL), after which a CE whose bound fails at every entry kept has
// no known lapse version (never a wrong one). A history is contiguous within the horizon: every
// checkpoint that replaces the posterior records every live anchor's KL
// (applyRecertification), after the anchor's previous version; an anchor whose newest entry is
// not at its stored KL version (a build without the bucket moved it on) starts again.
//
// The bucket is optional, like reissue: a ledger written by a build without it opens as it did,
// its anchors' histories starting at their next KL. At Open, a history that does not decode or
// breaks its order is deleted, as are entries no history reaches (repairAnchorKL): the CEs under
// the anchor lose their lapse versions until their bounds hold again.
var bAnchorKL = []byte("anchor_kl")

// anchorKLHorizon is how many posterior versions back the anchors' KL histories reach.
const anchorKLHorizon = 1024

// klPoint is one entry of an anchor's KL history.
type klPoint struct {
	version uint64  // the posterior version
	kl      float64 // KL(q_version || q_anchor)
	next    uint64  // the version committed after it; 0 on the newest (in memory only)
}

// klEntry is a klPoint as stored: it names the entry before it, and that entry's next version.
type klEntry struct {
	kl       float64
	prev     uint64 // the version of the entry before it, when hasPrev
	prevNext uint64 // the version committed after that entry
	hasPrev  bool
}

func anchorKLKey(version, anchor uint64) []byte {
	return binary.BigEndian.AppendUint64(u64bytes(version), anchor)
}

func (e klEntry) encode() []byte {
	v := binary.BigEndian.AppendUint64(nil, math.Float64bits(e.kl))
	v = binary.BigEndian.AppendUint64(v, e.prev)
	v = binary.BigEndian.AppendUint64(v, e.prevNext)
	flags := byte(0)
	if e.hasPrev {
		flags = 1
	}
	return append(v, flags)
}

// decodeAnchorKL decodes a sealed entry with its key's versions; ok is false when the checksum,
// key or values are wrong.
func decodeAnchorKL(k, v []byte) (version, anchor uint64, e klEntry, ok bool) {
	p, ok := unseal(k, v)
	if !ok || len(k) != 16 || len(p) != 25 || p[24] > 1 {
		return 0, 0, klEntry{}, false
	}
	version, anchor = binary.BigEndian.Uint64(k), binary.BigEndian.Uint64(k[8:])
	e = klEntry{kl: math.Float64frombits(binary.BigEndian.Uint64(p)), prev: binary.BigEndian.Uint64(p[8:]),
		prevNext: binary.BigEndian.Uint64(p[16:]), hasPrev: p[24] == 1}
	if !(e.kl >= 0) || math.IsInf(e.kl, 0) || e.hasPrev && !(e.prev < e.prevNext && e.prevNext <= version) {
		return 0, 0, klEntry{}, false
	}
	return version, anchor, e, true
}

// getAnchorKL reads anchor's entry at version; ok is false when there is none or it does not
// decode.
func getAnchorKL(b *bolt.Bucket, version, anchor uint64) (klEntry, bool) {
	k := anchorKLKey(version, anchor)
	v := b.Get(k)
	if v == nil {
		return klEntry{}, false
	}
	_, _, e, ok := decodeAnchorKL(k, v)
	return e, ok
}

// anchorKL reads anchor's history from its newest entry at version newest, oldest first (back
// to the horizon); ok is false when the newest entry is missing or an entry does not decode.
func anchorKL(tx *bolt.Tx, anchor, newest uint64) (pts []klPoint, ok bool) {
	b := tx.Bucket(bAnchorKL)
	if b == nil {
		return nil, false
	}
	v, next := newest, uint64(0)
	for {
		e, ok := getAnchorKL(b, v, anchor)
		if !ok {
			if len(pts) > 0 && b.Get(anchorKLKey(v, anchor)) == nil {
				break // past the horizon
			}
			return nil, false
		}
		pts = append(pts, klPoint{version: v, kl: e.kl, next: next})
		if !e.hasPrev {
			break
		}
		v, next = e.prev, e.prevNext
	}
	slices.Reverse(pts)
	return pts, true
}

// appendKL is pts, a history (oldest first), after the posterior version `version` at KL kl was
// committed: the newest entry learns its next version, every entry at or above kl goes, the new
// entry is appended, and the entries past the horizon go. pts is not changed.
func appendKL(pts []klPoint, version uint64, kl float64) []klPoint {
	out := slices.Clone(pts)
	if len(out) > 0 {
		out[len(out)-1].next = version
	}
	for len(out) > 0 && out[len(out)-1].kl >= kl {
		out = out[:len(out)-1]
	}
	out = append(out, klPoint{version: version, kl: kl})
	for version >= anchorKLHorizon && out[0].version < version-anchorKLHorizon {
		out = out[1:]
	}
	return out
}

// recordAnchorKL appends KL(q_version || q_anchor) = kl to anchor's history, as appendKL does
// (pruneAnchorKL drops what passes the horizon), reading and writing only the entries it
// changes: the new one and those it outdates (recent). prev is the version the anchor's KL was
// last recorded at (its newest entry); with fresh (a new anchor), or when there is no entry at
// prev or it does not decode, the history starts again at this entry. The same version again (a
// checkpoint that re-certifies the current posterior) changes nothing.
func recordAnchorKL(tx *bolt.Tx, anchor, prev, version uint64, kl float64, fresh bool) error {
	b, err := tx.CreateBucketIfNotExists(bAnchorKL)
	if err != nil {
		return err
	}
	if prev == version && !fresh {
		return nil
	}
	key := anchorKLKey(version, anchor)
	tail, ok := getAnchorKL(b, prev, anchor)
	if fresh || !ok {
		return putSealed(b, key, klEntry{kl: kl}.encode())
	}
	// Walk back over the entries the new one outdates (KL at or above kl): the one it stops at,
	// if any, precedes the new entry, and the version after it is the one after the last entry
	// dropped, or the new one.
	e := klEntry{kl: kl, prev: prev, prevNext: version, hasPrev: true}
	for cur := tail; e.hasPrev && cur.kl >= kl; {
		if err := b.Delete(anchorKLKey(e.prev, anchor)); err != nil {
			return err
		}
		e.prev, e.prevNext, e.hasPrev = cur.prev, cur.prevNext, cur.hasPrev
		if !e.hasPrev {
			break
		}
		if cur, ok = getAnchorKL(b, e.prev, anchor); !ok {
			e.hasPrev = false // past the horizon, or damaged: the history starts here
			break
		}
	}
	return putSealed(b, key, e.encode())
}

// pruneAnchorKL deletes the entries of every history from versions past the horizon of the
// version now committed: the first keys of the bucket.
func pruneAnchorKL(tx *bolt.Tx, version uint64) error {
	b := tx.Bucket(bAnchorKL)
	if b == nil || version < anchorKLHorizon {
		return nil
	}
	cut := u64bytes(version - anchorKLHorizon)
	c := b.Cursor()
	var old [][]byte
	for k, _ := c.First(); k != nil && bytes.Compare(k, cut) < 0; k, _ = c.Next() {
		old = append(old, bytes.Clone(k))
	}
	for _, k := range old {
		if err := b.Delete(k); err != nil {
			return err
		}
	}
	return nil
}

// dropChain deletes the entries before e in anchor's history.
func dropChain(b *bolt.Bucket, anchor uint64, e klEntry) error {
	for e.hasPrev {
		v := e.prev
		var ok bool
		e, ok = getAnchorKL(b, v, anchor)
		if err := b.Delete(anchorKLKey(v, anchor)); err != nil {
			return err
		}
		if !ok {
			return nil // the rest, if any, is no history's: Open deletes it
		}
	}
	return nil
}

// dropAnchorKL deletes anchor's history, whose newest entry is at version newest.
func dropAnchorKL(tx *bolt.Tx, anchor, newest uint64) error {
	b := tx.Bucket(bAnchorKL)
	if b == nil {
		return nil
	}
	tail, ok := getAnchorKL(b, newest, anchor)
	if err := b.Delete(anchorKLKey(newest, anchor)); err != nil || !ok {
		return err
	}
	return dropChain(b, anchor, tail)
}

// writeAnchorKL writes pts (oldest first) as the history of a new anchor.
func writeAnchorKL(tx *bolt.Tx, anchor uint64, pts []klPoint) error {
	b, err := tx.CreateBucketIfNotExists(bAnchorKL)
	if err != nil {
		return err
	}
	for i, p := range pts {
		e := klEntry{kl: p.kl}
		if i > 0 {
			e.prev, e.prevNext, e.hasPrev = pts[i-1].version, pts[i-1].next, true
		}
		if err := putSealed(b, anchorKLKey(p.version, anchor), e.encode()); err != nil {
			return err
		}
	}
	return nil
}

// pastAnchorKL is the history anchor v (the posterior past[v]) would have here had this ledger
// held it all along, for a snapshot anchor stored at the current version cur at KL curKL (a CE
// restored or registered under a past posterior): KL(q_u || q_v) for the versions u of past that
// run without a gap from cur-1 down (with v itself, at KL 0, when they reach it), then cur.
// Posterior versions run without gaps (update.Update makes prev.Version+1), so the history is
// the one an owner that committed those versions holds, cut to the versions past has.
func pastAnchorKL(past map[uint64]*bnn.Model, v, cur uint64, curKL float64) ([]klPoint, error) {
	lo := cur
	for lo > v+1 {
		m, ok := past[lo-1]
		if !ok || m == nil || m.Version != lo-1 {
			break
		}
		lo--
	}
	var pts []klPoint
	if lo == v+1 {
		pts = appendKL(pts, v, 0)
	}
	for u := lo; u < cur; u++ {
		kl, _, err := certify.KL(past[u], past[v])
		if err != nil {
			return nil, fmt.Errorf("KL of posterior %d from anchor %d: %w", u, v, err)
		}
		pts = appendKL(pts, u, kl)
	}
	return appendKL(pts, cur, curKL), nil
}

// failingSince is the posterior version since which the bound of cert, under anchor a (its
// stored KL at a.klVersion), has failed at every version the ledger committed: the version
// committed after the last one at which the anchor's KL let it hold. ok is false when the bound
// holds at a's stored KL, or when the history does not reach back to a version at which it held
// (started after the lapse, or cut to its newest entries), or does not decode.
func failingSince(tx *bolt.Tx, pol certify.Policy, cert certify.Certificate, anchor uint64, a anchorMeta) (uint64, bool) {
	b := tx.Bucket(bAnchorKL)
	if b == nil {
		return 0, false
	}
	// Newest first, as lapsedSince reads them, stopping at the first entry at which it holds.
	v, next, newest := a.klVersion, uint64(0), true
	for {
		e, ok := getAnchorKL(b, v, anchor)
		switch {
		case !ok: // damaged, or past the horizon
			return 0, false
		case pol.Bounds(cert, e.kl).Certified:
			return next, !newest
		case !e.hasPrev:
			return 0, false
		}
		v, next, newest = e.prev, e.prevNext, false
	}
}

// lapsedSince is the version since which a bound that holds at KL k iff holds(k) has failed, by
// the history pts (oldest first): the next version of the last entry at which it holds. ok is
// false when it holds at the newest entry, or at none.
func lapsedSince(pts []klPoint, holds func(kl float64) bool) (uint64, bool) {
	for i := len(pts) - 1; i >= 0; i-- {
		if holds(pts[i].kl) {
			if i == len(pts)-1 {
				return 0, false
			}
			return pts[i].next, true
		}
	}
	return 0, false
}

// damagedEntry is historyDamage's reason for an entry that does not decode.
const damagedEntry = "checksum mismatch or not an entry"

// klDamage is what anchorKLDamage found: the anchors whose history is damaged, with what is
// wrong, and the keys of entries no history reaches (left by a history that started again).
type klDamage struct {
	anchors map[uint64]string
	strays  [][]byte
}

// anchorKLDamage checks every entry of the bucket and every stored anchor's history, as of the
// current posterior version cur: each entry decodes, each history reached from its anchor's
// stored KL version holds that KL, has KL rising and versions after their predecessors' next,
// and reaches back to the horizon or to its first entry. Entries of no history, or of an anchor
// not stored, are strays.
func anchorKLDamage(tx *bolt.Tx, anchors map[uint64]anchorMeta, cur uint64) klDamage {
	d := klDamage{anchors: map[uint64]string{}}
	b := tx.Bucket(bAnchorKL)
	if b == nil {
		return d
	}
	reached := map[string]bool{}
	for _, a := range slices.Sorted(maps.Keys(anchors)) {
		horizon := uint64(0)
		if cur >= anchorKLHorizon {
			horizon = cur - anchorKLHorizon
		}
		if why := historyDamage(b, a, anchors[a], horizon, reached); why != "" {
			d.anchors[a] = why
		}
	}
	var unreached [][]byte
	b.ForEach(func(k, v []byte) error {
		if reached[string(k)] {
			return nil
		}
		if _, a, _, ok := decodeAnchorKL(k, v); !ok && len(k) == 16 {
			if _, stored := anchors[a]; stored {
				d.anchors[a] = damagedEntry
			}
		}
		unreached = append(unreached, bytes.Clone(k))
		return nil
	})
	// The entries of a damaged history go with it; the others no history reaches are strays.
	for _, k := range unreached {
		if len(k) == 16 {
			if _, bad := d.anchors[binary.BigEndian.Uint64(k[8:])]; bad {
				continue
			}
		}
		d.strays = append(d.strays, k)
	}
	return d
}

// historyDamage says what is wrong with anchor's history ("" when nothing, or when it has
// none), marking the keys it reaches. An entry before horizon may be gone (pruneAnchorKL).
func historyDamage(b *bolt.Bucket, anchor uint64, a anchorMeta, horizon uint64, reached map[string]bool) string {
	k := anchorKLKey(a.klVersion, anchor)
	raw := b.Get(k)
	if raw == nil {
		return ""
	}
	_, _, tail, ok := decodeAnchorKL(k, raw)
	switch {
	case !ok:
		return damagedEntry
	case tail.kl != a.kl:
		return fmt.Sprintf("its newest entry holds KL %v at version %d, the anchor KL %v", tail.kl, a.klVersion, a.kl)
	}
	e, v := tail, a.klVersion
	for {
		reached[string(anchorKLKey(v, anchor))] = true
		if !e.hasPrev {
			break
		}
		pk := anchorKLKey(e.prev, anchor)
		pv := b.Get(pk)
		if pv == nil && horizon > 0 && e.prev < horizon {
			break // pruned
		}
		if pv == nil {
			return fmt.Sprintf("the entry at version %d names one at version %d, which is missing", v, e.prev)
		}
		_, _, p, ok := decodeAnchorKL(pk, pv)
		if !ok {
			return damagedEntry
		}
		if p.kl >= e.kl || p.hasPrev && p.prevNext > e.prev {
			return fmt.Sprintf("entries at versions %d and %d are out of order", e.prev, v)
		}
		v, e = e.prev, p
	}
	return ""
}

// repairAnchorKL deletes the damaged histories and the stray entries Open's record check found,
// naming each damaged anchor in an ERROR line and counting the strays in a WARN line (a history
// that started again, or whose anchor a build without the bucket released). The CEs under a
// damaged anchor lose their lapse versions until their bounds hold again; nothing else reads
// the history.
func (l *Ledger) repairAnchorKL(d klDamage) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var strays int
	err := l.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bAnchorKL)
		var keys [][]byte
		b.ForEach(func(k, _ []byte) error {
			if len(k) == 16 {
				if _, bad := d.anchors[binary.BigEndian.Uint64(k[8:])]; bad {
					keys = append(keys, bytes.Clone(k))
				}
			}
			return nil
		})
		keys = append(keys, d.strays...)
		for _, k := range keys {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		strays = len(d.strays)
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
	if strays > 0 {
		l.log.Log(context.Background(), slog.LevelWarn, "ledger: anchor KL entries that no history reaches were deleted",
			"path", l.path, "bucket", string(bAnchorKL), "entries", strays)
	}
	return nil
}
