package ledger

import (
	"bytes"
	"encoding/binary"
	"math"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// The indexes. A CE's verdict under its anchor is a pair of thresholds. With the anchor's
// KL(q_now || q_anchor) fixed, the policy's slack (certify.Policy.Slack) is a mean slack m and a
// variance slack s, the same for every CE under that anchor, and the CE is certified iff
//
//	p1' - m >= 1/2                       (Theorem 1; p1' = p1 or its Hoeffding lower bound)
//	min(V1 + s, 1/4) <= ceiling(epsilon)  (Theorem 2; ceiling = max(epsilon_max, epsilon))
//
// The first holds for every CE whose p1' is above a threshold and fails below it; the second
// likewise in the variance headroom h = ceiling - V1 (h = +Inf when ceiling >= 1/4: the cap
// makes the condition hold at any KL). So two indexes sorted by anchor, then p1' (idx_p1) or h
// (idx_var), tell which CEs an anchor's KL moving from k_old to k_new can change: those with p1'
// between 1/2 + m(k_old) and 1/2 + m(k_new), and those with h between s(k_old) and s(k_new).
// Recertify range-scans exactly those (with a margin of 1e-9 for rounding) and judges each
// candidate with the same float operations as a full scan (certify.Gate), so the result is
// bit-identical to judging every CE, in time proportional to the candidates.
//
// idx_cert holds the certified CEs whose bounds hold by anchor and p1', so the smallest Theorem
// 1 bound over them (Report.MinBound) is the first entry per anchor. idx_fail holds the CEs whose
// bound fails (certified with a lapsed bound, at_risk, invalidated) by the posterior version of
// their last Monte-Carlo verdict (0 = none yet, else version + 1), so Confirm takes the ones to
// measure from its front; verdicts that carry to later posteriors follow, by version and carry
// margin (failKey), so Confirm reads only those the KL from their posterior no longer carries.
//
// Keys: anchor u64 BE | ordered float64 (8 bytes) | id, or in idx_fail those of failKey. Values: the
// CRC-32C of the key (seal). The keys depend on the policy (mode, epsilon_max, Hoeffding alpha):
// Open rebuilds them when the stored policy fingerprint differs.

// scanMargin widens index range scans past the thresholds, which are computed with rounding
// (1/2 + m, ceiling - V1) while the verdict is computed as p1' - m >= 1/2 and V1 + s <= ceiling.
// Rounding errors are below 1e-15 for values of order 1.
const scanMargin = 1e-9

// floatKey maps f to 8 bytes whose byte order is the numeric order (NaN excluded).
func floatKey(dst []byte, f float64) {
	b := math.Float64bits(f)
	if b>>63 == 1 {
		b = ^b
	} else {
		b |= 1 << 63
	}
	binary.BigEndian.PutUint64(dst, b)
}

// keyFloat is the inverse of floatKey.
func keyFloat(k []byte) float64 {
	b := binary.BigEndian.Uint64(k)
	if b>>63 == 1 {
		b &^= 1 << 63
	} else {
		b = ^b
	}
	return math.Float64frombits(b)
}

func idxKey(anchor uint64, f float64, id []byte) []byte {
	k := make([]byte, 16+len(id))
	binary.BigEndian.PutUint64(k, anchor)
	floatKey(k[8:], f)
	copy(k[16:], id)
	return k
}

// failKey orders failing CEs by their last Monte-Carlo verdict: none first, then by version. A
// verdict with a carry bound (certify.VerdictBound) goes after every other entry, grouped by its
// version and sorted by its carry margin (certify.CarryMargin), so that the verdicts a KL from
// their posterior no longer carries are one range scan per version (carriedKey):
//
//	cv + 1 (0 = none) | id                       a lapsed certificate, or a verdict without bound
//	0xFFFFFFFFFFFFFFFF | cv | margin | id        a verdict with a carry bound
func failKey(h *header, id []byte) []byte {
	if h.confirmed && h.carry {
		return carriedKey(h.cv, h.carryMargin(), id)
	}
	k := make([]byte, 8+len(id))
	if h.confirmed {
		binary.BigEndian.PutUint64(k, h.cv+1)
	}
	copy(k[8:], id)
	return k
}

// carriedPrefix is the first 8 bytes of every idx_fail key of a carried verdict: above any
// version + 1 an uncarried entry can have.
const carriedPrefix = math.MaxUint64

func carriedKey(cv uint64, margin float64, id []byte) []byte {
	k := make([]byte, 24+len(id))
	binary.BigEndian.PutUint64(k, carriedPrefix)
	binary.BigEndian.PutUint64(k[8:], cv)
	floatKey(k[16:], margin)
	copy(k[24:], id)
	return k
}

// varHeadroom is ceiling(epsilon) - V1, or +Inf when the ceiling is at least 1/4.
func varHeadroom(pol certify.Policy, v1, eps float64) float64 {
	c := pol.VarCeiling(eps)
	if c >= 0.25 {
		return math.Inf(1)
	}
	return c - v1
}

// indexKeys are the index entries of a CE with header h (none for nil or uncertified), in the
// order of indexBuckets.
func (l *Ledger) indexKeys(id []byte, h *header) (k [4][]byte) {
	if h == nil || h.status == certify.Uncertified {
		return k
	}
	pol := l.opts.Policy
	p1s := pol.StartP1(h.certificate())
	k[0] = idxKey(h.anchor, p1s, id)
	k[1] = idxKey(h.anchor, varHeadroom(pol, h.var1, h.epsilon), id)
	if h.holds() {
		k[2] = k[0]
	}
	if h.pending() {
		k[3] = failKey(h, id)
	}
	return k
}

// writeTx collects what one write transaction changes: headers with their index entries,
// status counts, status changes (history and outbox), and outbox entries.
//
// Index entries are not written as each CE changes but collected and applied in key order when
// the transaction finishes: bbolt keeps a leaf's new entries in one in-memory node until commit,
// and inserting n keys in random order into one node moves O(n^2) entries (10^5 status changes
// at once took seconds that way).
type writeTx struct {
	l        *Ledger
	tx       *bolt.Tx
	now      time.Time
	cnt      counts
	changes  []StatusChange
	outSeq   uint64
	outDirty bool
	idx      [4][]idxOp
}

// idxOp is one pending index change: put or delete key.
type idxOp struct {
	key []byte
	put bool
}

func (l *Ledger) newWriteTx(tx *bolt.Tx, now time.Time) (*writeTx, error) {
	w := &writeTx{l: l, tx: tx, now: now}
	var err error
	if w.cnt, err = readCounts(tx); err != nil {
		return nil, err
	}
	if w.outSeq, err = metaU64(tx, kOutboxSeq); err != nil {
		return nil, err
	}
	return w, nil
}

// putHeader stores h under id, replacing old (nil for a new CE), and moves its index entries
// and status count.
func (w *writeTx) putHeader(id []byte, old, h *header) error {
	if err := putSealed(w.tx.Bucket(bHeaders), id, h.encode()); err != nil {
		return err
	}
	w.moveIndex(id, old, h)
	if old != nil {
		w.cnt.addHeader(old, -1)
	}
	w.cnt.addHeader(h, 1)
	return nil
}

// deleteCE removes a CE's header, body and index entries.
func (w *writeTx) deleteCE(id []byte, old *header) error {
	if err := w.tx.Bucket(bHeaders).Delete(id); err != nil {
		return err
	}
	if err := w.tx.Bucket(bBodies).Delete(id); err != nil {
		return err
	}
	w.cnt.addHeader(old, -1)
	w.moveIndex(id, old, nil)
	return nil
}

// moveIndex queues the index changes that take id from old to h (nil: absent); applyIndex
// writes them.
func (w *writeTx) moveIndex(id []byte, old, h *header) {
	ok, nk := w.l.indexKeys(id, old), w.l.indexKeys(id, h)
	for i := range w.idx {
		if bytes.Equal(ok[i], nk[i]) {
			continue
		}
		if ok[i] != nil {
			w.idx[i] = append(w.idx[i], idxOp{key: ok[i]})
		}
		if nk[i] != nil {
			w.idx[i] = append(w.idx[i], idxOp{key: nk[i], put: true})
		}
	}
}

// applyIndex writes the pending index changes in key order (changes to one key keep their order).
func (w *writeTx) applyIndex() error {
	for i, ops := range w.idx {
		slices.SortStableFunc(ops, func(a, b idxOp) int { return bytes.Compare(a.key, b.key) })
		b := w.tx.Bucket(indexBuckets[i])
		for _, op := range ops {
			if op.put {
				if err := b.Put(op.key, seal(op.key, nil)); err != nil {
					return err
				}
				continue
			}
			if b.Get(op.key) == nil {
				return corruptf("counterfactual %q: its %s entry is missing", op.key[len(op.key)-idLen(i, op.key):], indexBuckets[i])
			}
			if err := b.Delete(op.key); err != nil {
				return err
			}
		}
		w.idx[i] = nil
	}
	return nil
}

// idLen is the length of the CE id at the end of an index key of bucket i.
func idLen(i int, key []byte) int {
	switch {
	case i == 3 && len(key) >= 24 && binary.BigEndian.Uint64(key) == carriedPrefix:
		return len(key) - 24
	case i == 3:
		return len(key) - 8
	}
	return len(key) - 16
}

// recordChange appends ch to the CE's history, puts it in the outbox (Options.EncodeChange)
// and in the transaction's list of changes. The one place a status change is recorded.
func (w *writeTx) recordChange(id []byte, ch StatusChange) error {
	if err := w.recordHistory(id, &ch); err != nil {
		return err
	}
	if enc := w.l.opts.EncodeChange; enc != nil {
		if err := w.enqueue(enc(ch)); err != nil {
			return err
		}
	}
	w.changes = append(w.changes, ch)
	return nil
}

// recordHistory appends ch to the CE's history only: a renewal (From = To = certified) is kept
// in the history but is not a status change, so it has no outbox entry.
func (w *writeTx) recordHistory(id []byte, ch *StatusChange) error {
	ch.ID = string(id)
	if ch.At.IsZero() {
		ch.At = w.now
	}
	bodies := w.tx.Bucket(bBodies)
	raw, err := getSealed(bodies, id, "body")
	if err == nil && raw == nil {
		err = corruptf("body is missing")
	}
	if err != nil {
		return inRecord(err, "counterfactual %q", id)
	}
	bd, err := decodeBody(raw, true)
	if err != nil {
		return inRecord(err, "counterfactual %q", id)
	}
	bd.history = appendHistory(bd.history, *ch)
	return putSealed(bodies, id, bd.encode())
}

// enqueue writes an outbox entry with the next sequence number.
func (w *writeTx) enqueue(e OutboxEntry) error {
	if len(e.Key) > maxOutboxKey {
		return invalidf("outbox entry key of %d bytes (at most %d)", len(e.Key), maxOutboxKey)
	}
	w.outSeq++
	w.outDirty = true
	e.Seq = w.outSeq
	k := u64bytes(e.Seq)
	return putSealed(w.tx.Bucket(bOutbox), k, e.encode())
}

// finish stores the counts and the outbox sequence and bumps the CE generation, which makes
// re-certification reports made before this transaction stale.
func (w *writeTx) finish() error {
	if err := w.finishNoGen(); err != nil {
		return err
	}
	return bumpGen(w.tx)
}

// finishNoGen is finish for a transaction that changed no CE and no posterior.
func (w *writeTx) finishNoGen() error {
	if err := w.applyIndex(); err != nil {
		return err
	}
	if err := w.cnt.put(w.tx); err != nil {
		return err
	}
	if w.outDirty {
		return putU64(w.tx.Bucket(bMeta), kOutboxSeq, w.outSeq)
	}
	return nil
}

// anchorSlacks maps each live anchor to the gate at its stored KL.
func (l *Ledger) anchorGates(tx *bolt.Tx) (map[uint64]certify.Gate, map[uint64]float64, error) {
	gates, kls := map[uint64]certify.Gate{}, map[uint64]float64{}
	err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		gates[v] = l.opts.Policy.Gate(l.opts.Policy.Slack(a.kl))
		kls[v] = a.kl
		return nil
	})
	return gates, kls, err
}

// rebuild recreates the indexes for the ledger's policy (see rebuildTx) in one transaction.
func (l *Ledger) rebuild() error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	start := time.Now()
	var n, changed int
	err := l.update(func(tx *bolt.Tx) (err error) {
		n, changed, err = l.rebuildTx(tx)
		return err
	})
	if err != nil {
		return err
	}
	l.log.Info("ledger: indexes built", "path", l.path, "counterfactuals", n, "changed_status", changed, "took", time.Since(start))
	return nil
}

// rebuildTx recreates the indexes, re-judging every CE holding a certificate at its anchor's
// stored KL: a status that changes is recorded like any other change (history, outbox). It
// returns the number of CEs and of status changes.
func (l *Ledger) rebuildTx(tx *bolt.Tx) (n, changed int, err error) {
	for _, b := range indexBuckets {
		if tx.Bucket(b) != nil {
			if err := tx.DeleteBucket(b); err != nil {
				return 0, 0, err
			}
		}
		if _, err := tx.CreateBucket(b); err != nil {
			return 0, 0, err
		}
	}
	w, err := l.newWriteTx(tx, l.opts.Now().UTC())
	if err != nil {
		return 0, 0, err
	}
	w.cnt = counts{}
	c, err := readCur(tx)
	if err != nil {
		return 0, 0, err
	}
	gates, kls, err := l.anchorGates(tx)
	if err != nil {
		return 0, 0, err
	}
	type rejudged struct {
		id     []byte
		old, h header
	}
	var redo []rejudged
	var keys [4][][]byte
	err = tx.Bucket(bHeaders).ForEach(func(k, v []byte) error {
		p, ok := unseal(k, v)
		if !ok {
			return corruptf("counterfactual %q: header checksum mismatch", k)
		}
		h, err := decodeHeader(p)
		if err != nil {
			return inRecord(err, "counterfactual %q: header", k)
		}
		n++
		old := h
		if h.status != certify.Uncertified {
			g, ok := gates[h.anchor]
			if !ok {
				return corruptf("counterfactual %q refers to anchor %d, which is not stored", k, h.anchor)
			}
			_, holds := g.Check(h.p1, h.var1, h.epsilon, h.samples)
			h.rejudge(holds) // a certificate that lapses here is renewed or judged by the confirmer
		}
		id := append([]byte(nil), k...)
		if h != old {
			redo = append(redo, rejudged{id, old, h})
		}
		w.cnt.addHeader(&h, 1)
		for i, key := range l.indexKeys(id, &h) {
			if key != nil {
				keys[i] = append(keys[i], key)
			}
		}
		return nil
	})
	if err != nil {
		return 0, 0, err
	}
	for _, r := range redo {
		h := r.h
		h.updated = w.now.UnixNano()
		if err := putSealed(tx.Bucket(bHeaders), r.id, h.encode()); err != nil {
			return 0, 0, err
		}
		b := l.opts.Policy.Bounds(h.certificate(), kls[h.anchor])
		if err := w.recordChange(r.id, StatusChange{From: r.old.status, To: h.status, PosteriorVersion: c.version,
			KL: kls[h.anchor], Bound: b.ProbLower, VarBound: b.VarUpper}); err != nil {
			return 0, 0, err
		}
	}
	for i, ks := range keys {
		slices.SortFunc(ks, bytes.Compare)
		b := tx.Bucket(indexBuckets[i])
		b.FillPercent = 0.9
		for _, k := range ks {
			if err := b.Put(k, seal(k, nil)); err != nil {
				return 0, 0, err
			}
		}
	}
	if err := putSealed(tx.Bucket(bMeta), kPolicy, []byte(policyFingerprint(l.opts.Policy))); err != nil {
		return 0, 0, err
	}
	return n, len(redo), w.finish()
}
