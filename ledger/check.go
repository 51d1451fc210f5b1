package ledger

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// checkAll decodes every record of a schema-2 ledger and checks the invariants between them:
// status counts and anchor references against the CEs, every CE's status against its bounds
// at its anchor's stored KL (certified iff they hold), the four indexes against the CEs (each
// expected entry present, no other entry), the KL history, the outbox and the prequential
// records against their meta sequence numbers, the reissue entries' seals, and the anchors' KL
// histories against the anchors. It fills in
// info. O(stored CEs); Verify runs it.
func (l *Ledger) checkAll(tx *bolt.Tx, info *Info) error {
	if err := l.checkSmall(tx); err != nil {
		return err
	}
	c, err := readCur(tx)
	if err != nil {
		return err
	}
	info.HasPosterior, info.PosteriorVersion = c.ok, c.version
	anchors := map[uint64]anchorMeta{}
	err = forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		anchors[v] = a
		if a.klVersion != c.version && a.refs > 0 {
			return corruptf("anchor %d holds KL from posterior version %d, current is %d", v, a.klVersion, c.version)
		}
		_, err := l.model(tx, v)
		return err
	})
	if err != nil {
		return err
	}
	info.Anchors = len(anchors)
	if err := l.checkCEs(tx, anchors, info); err != nil {
		return err
	}
	if info.Offsets, err = readOffsets(tx); err != nil {
		return err
	}
	if err := checkMarks(tx, info.Offsets); err != nil {
		return err
	}
	if err := checkOutcomes(tx); err != nil {
		return err
	}
	if err := checkQuality(tx); err != nil {
		return err
	}
	if err := checkReissues(tx); err != nil {
		return err
	}
	if bad := anchorKLDamage(tx, anchors).anchors; len(bad) > 0 {
		v := slices.Min(slices.Collect(maps.Keys(bad)))
		return corruptf("%s history of anchor %d: %s", bAnchorKL, v, bad[v])
	}
	for _, key := range keptEvents() {
		if err := verifyKept(tx, key); err != nil {
			return err
		}
	}
	if _, err := readCounters(tx); err != nil {
		return err
	}
	if _, err := readCountersAt(tx); err != nil {
		return err
	}
	if err := checkSequences(tx, info); err != nil {
		return err
	}
	o, err := getSealed(tx.Bucket(bMeta), kOrigin, "meta origin")
	info.Origin = string(o)
	return err
}

// checkCEs reads every CE and checks counts, anchor references, statuses and index entries.
// The index entries are checked when the indexes have the current layout (l.oldIndexes false):
// indexes of an older layout are rebuilt by Open, not read.
func (l *Ledger) checkCEs(tx *bolt.Tx, anchors map[uint64]anchorMeta, info *Info) error {
	var cnt counts
	refs := map[uint64]uint64{}
	var entries [3]int
	pol := l.opts.Policy
	err := tx.Bucket(bHeaders).ForEach(func(k, v []byte) error {
		if _, err := l.load(tx, k, v); err != nil {
			return err
		}
		p, _ := unseal(k, v)
		h, _ := decodeHeader(p)
		info.CEs++
		holds := false
		if h.status != certify.Uncertified {
			refs[h.anchor]++
			a := anchors[h.anchor]
			// Every stored CE is a fixed point of the rule at its anchor's stored KL: an at_risk
			// or invalidated CE's bound fails there (a certified one is lapsed or not by it).
			holds = pol.Bounds(h.certificate(), a.kl).Certified
			next := h
			if next.rejudge(holds); next.status != h.status {
				return corruptf("counterfactual %q is %v but its bounds at its anchor's KL %v hold", k, h.status, a.kl)
			}
		}
		cnt.addHeader(&h, !holds, 1)
		if l.oldIndexes {
			return nil
		}
		for i, e := range l.indexKeys(k, &h) {
			if e.key == nil {
				continue
			}
			entries[i]++
			val := tx.Bucket(indexBuckets[i]).Get(e.key)
			if val == nil {
				return corruptf("counterfactual %q has no %s entry", k, indexBuckets[i])
			}
			p, ok := unseal(e.key, val)
			if !ok {
				return corruptf("%s entry of counterfactual %q: checksum mismatch", indexBuckets[i], k)
			}
			if !bytes.Equal(p, e.val) {
				return corruptf("%s entry of counterfactual %q holds terms %x, its record says %x", indexBuckets[i], k, p, e.val)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if n := tx.Bucket(bBodies).Stats().KeyN; n != info.CEs {
		return corruptf("%d counterfactual bodies for %d headers", n, info.CEs)
	}
	if !l.oldIndexes {
		for i, b := range indexBuckets {
			if n := tx.Bucket(b).Stats().KeyN; n != entries[i] {
				return corruptf("%s has %d entries, the counterfactuals need %d", b, n, entries[i])
			}
		}
		if n := tx.Bucket(bIdxCert).Stats().KeyN; n != 0 {
			return corruptf("%s has %d entries; this index layout keeps it empty", bIdxCert, n)
		}
	}
	stored, err := readCounts(tx)
	if err != nil {
		return err
	}
	if stored != cnt {
		return corruptf("meta counts %v (lapsed %d), the counterfactuals are %v (lapsed %d)", stored.asMap(), stored[lapsedSlot], cnt.asMap(), cnt[lapsedSlot])
	}
	info.Counts = cnt.asMap()
	for v, a := range anchors {
		if a.refs != refs[v] {
			return corruptf("anchor %d has %d references, %d counterfactuals hold a certificate under it", v, a.refs, refs[v])
		}
		delete(refs, v)
	}
	for v := range refs {
		return corruptf("counterfactuals refer to anchor %d, which is not stored", v)
	}
	return nil
}

// checkSequences decodes the KL history and the outbox and checks them against their meta
// sequence numbers.
func checkSequences(tx *bolt.Tx, info *Info) error {
	if err := checkSeq(tx, bKLHistory, kKLSeq, 0, func(k, p []byte) error {
		_, err := decodeKLEntry(k, p)
		info.KLHistory++
		return err
	}); err != nil {
		return err
	}
	acked, err := metaU64(tx, kOutboxAcked)
	if err != nil {
		return err
	}
	if err := checkSeq(tx, bOutbox, kOutboxSeq, acked, func(k, p []byte) error {
		_, err := decodeOutboxEntry(k, p)
		info.OutboxLen++
		return err
	}); err != nil {
		return err
	}
	if n, err := outboxLen(tx); err != nil || n != info.OutboxLen {
		if err == nil {
			err = corruptf("the outbox holds %d entries, its sequence numbers say %d", info.OutboxLen, n)
		}
		return err
	}
	return nil
}

// checkSeq decodes every entry of a sequence-keyed bucket: keys must be in (floor, meta seq].
func checkSeq(tx *bolt.Tx, bucket, seqKey []byte, floor uint64, decode func(k, p []byte) error) error {
	last, err := metaU64(tx, seqKey)
	if err != nil {
		return err
	}
	return tx.Bucket(bucket).ForEach(func(k, v []byte) error {
		p, ok := unseal(k, v)
		if !ok || len(k) != 8 {
			return corruptf("%s entry %x: checksum mismatch", bucket, k)
		}
		if s := binary.BigEndian.Uint64(k); s <= floor || s > last {
			return corruptf("%s entry %d outside (%d, %d]", bucket, s, floor, last)
		}
		return inRecord(decode(k, p), "%s entry %x", bucket, k)
	})
}

// parsePolicyFingerprint is the inverse of policyFingerprint. It also reads the fingerprint of
// indexes of an older layout (index v1), reporting old: their policy, not their entries, can be
// checked; Open rebuilds them.
func parsePolicyFingerprint(fp string) (p certify.Policy, old bool, err error) {
	var layout, mode, eps, alpha string
	if _, err := fmt.Sscanf(strings.ReplaceAll(fp, ";", ""), "index %s mode %s epsilon_max %s hoeffding alpha %s", &layout, &mode, &eps, &alpha); err != nil {
		return certify.Policy{}, false, corruptf("meta policy %q: %v", fp, err)
	}
	if layout != "v1" && layout != indexLayout {
		var n, ours int
		fmt.Sscanf(indexLayout, "v%d", &ours)
		if _, err := fmt.Sscanf(layout, "v%d", &n); err == nil && n > ours {
			return certify.Policy{}, false, fmt.Errorf("%w: meta policy %q: index layout %s, this build reads v1 and %s: open or restore it with the cfguard that wrote it",
				ErrNewerSchema, fp, layout, indexLayout)
		}
		return certify.Policy{}, false, corruptf("meta policy %q: index layout %s; this build reads v1 and %s", fp, layout, indexLayout)
	}
	p = certify.Policy{Mode: certify.Mode(mode), Alpha: certify.DefaultAlpha}
	if p.EpsilonMax, err = strconv.ParseFloat(eps, 64); err != nil {
		return p, false, corruptf("meta policy %q: %v", fp, err)
	}
	if alpha != "off" {
		p.Hoeffding = true
		if p.Alpha, err = strconv.ParseFloat(alpha, 64); err != nil {
			return p, false, corruptf("meta policy %q: %v", fp, err)
		}
	}
	old = layout != indexLayout
	if err := p.Validate(); err != nil || strings.Replace(policyFingerprint(p), indexLayout, layout, 1) != fp {
		return p, false, corruptf("meta policy %q does not parse back (%v)", fp, err)
	}
	return p, old, nil
}
