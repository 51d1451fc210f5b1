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
// variance slack s, the same for every CE under that anchor, and the CE's bound holds iff
//
//	p1' - m >= 1/2                       (Theorem 1; p1' = p1 or its Hoeffding lower bound)
//	min(V1 + s, 1/4) <= ceiling(epsilon)  (Theorem 2; ceiling = max(epsilon_max, epsilon))
//
// The first holds for every CE whose p1' is above a threshold and fails below it; the second
// likewise in the variance headroom h = ceiling - V1 (h = +Inf when ceiling >= 1/4: the cap
// makes the condition hold at any KL). So two indexes sorted by anchor, then p1' (idx_p1) or h
// (idx_var), tell which CEs an anchor's KL moving from k_old to k_new can change: those with p1'
// between 1/2 + m(k_old) and 1/2 + m(k_new), and those with h between s(k_old) and s(k_new).
// Each entry carries what judging reads (p1', V1, ceiling: terms), so Recertify range-scans
// exactly those entries (with a margin of 1e-9 for rounding) and judges each with certify.Gate's
// arithmetic (Theorem1, Theorem2) without reading the CE: the result is bit-identical to judging
// every CE, in time proportional to the entries between the thresholds.
//
// Both indexes keep two classes apart under each anchor: certified CEs (class 0) and at_risk or
// invalidated ones (class 1). A certified CE whose bound fails at its anchor's stored KL has
// lapsed; nothing about it is written when it does. The lapsed certificates under an anchor are
// the front of its certified class in idx_p1 (p1' below 1/2 + m) and in idx_var (h below s), which
// is where Confirm takes them from, and the smallest Theorem 1 bound that holds (Report.MinBound)
// is the first certified idx_p1 entry at or above 1/2 + m. idx_fail holds the at_risk and
// invalidated CEs by the posterior version of their last Monte-Carlo verdict (0 = none yet, else
// version + 1), so Confirm takes the ones to measure from its front; verdicts that carry to later
// posteriors follow, by version and carry margin (failKey), so Confirm reads only those the KL
// from their posterior no longer carries.
//
// Keys: anchor u64 BE | class | ordered float64 (8 bytes) | id, or in idx_fail those of failKey.
// Values: in idx_p1 and idx_var the terms (24 bytes), sealed; in idx_fail only the seal (the
// CRC-32C of the key). Keys and terms depend on the policy (mode, epsilon_max, Hoeffding alpha):
// Open rebuilds the indexes when the stored policy fingerprint differs.

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

// The classes of idx_p1 and idx_var entries under an anchor.
const (
	classCertified byte = 0 // certified, its bound holding or lapsed
	classFailing   byte = 1 // at_risk or invalidated
)

// idxPrefix is the length of an idx_p1 or idx_var key before the id.
const idxPrefix = 17

func idxKey(anchor uint64, class byte, f float64, id []byte) []byte {
	k := make([]byte, idxPrefix+len(id))
	binary.BigEndian.PutUint64(k, anchor)
	k[8] = class
	floatKey(k[9:], f)
	copy(k[idxPrefix:], id)
	return k
}

// terms are what judging a certificate reads, under the ledger's policy: p1' (Policy.StartP1),
// V1 and the variance ceiling (Policy.VarCeiling). idx_p1 and idx_var entries carry them.
type terms struct{ p1s, v1, ceil float64 }

const termsSize = 24

func (l *Ledger) termsOf(h *header) terms {
	pol := l.opts.Policy
	return terms{p1s: pol.StartP1(h.certificate()), v1: h.var1, ceil: pol.VarCeiling(h.epsilon)}
}

// holds reports whether both bounds hold under gate g (certify.Gate's arithmetic).
func (t terms) holds(g *certify.Gate) bool { return g.Theorem1(t.p1s) && g.Theorem2(t.v1, t.ceil) }

// headroom is the idx_var key: ceiling - V1, or +Inf when the ceiling is at least 1/4.
func (t terms) headroom() float64 {
	if t.ceil >= 0.25 {
		return math.Inf(1)
	}
	return t.ceil - t.v1
}

func (t terms) encode() []byte {
	v := make([]byte, termsSize)
	putF64(v, 0, t.p1s)
	putF64(v, 8, t.v1)
	putF64(v, 16, t.ceil)
	return v
}

// idxEntry is one entry of an idx_p1 or idx_var cursor: its class, CE id and terms.
type idxEntry struct {
	class byte
	id    []byte
	terms terms
}

// decodeIdx unseals and parses an idx_p1 or idx_var entry.
func decodeIdx(bucket, k, v []byte) (idxEntry, error) {
	p, ok := unseal(k, v)
	if !ok || len(k) <= idxPrefix || k[8] > classFailing || len(p) != termsSize {
		return idxEntry{}, corruptf("%s entry %x is damaged", bucket, k)
	}
	return idxEntry{class: k[8], id: k[idxPrefix:], terms: terms{p1s: f64(p, 0), v1: f64(p, 8), ceil: f64(p, 16)}}, nil
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

// indexEntry is one index entry a CE needs: its key and the payload its value seals.
type indexEntry struct{ key, val []byte }

// indexKeys are the index entries of a CE with header h (none for nil or uncertified), in the
// order of indexBuckets.
func (l *Ledger) indexKeys(id []byte, h *header) (e [3]indexEntry) {
	if h == nil || h.status == certify.Uncertified {
		return e
	}
	t := l.termsOf(h)
	class := classCertified
	if h.failing() {
		class = classFailing
	}
	val := t.encode()
	e[0] = indexEntry{idxKey(h.anchor, class, t.p1s, id), val}
	e[1] = indexEntry{idxKey(h.anchor, class, t.headroom(), id), val}
	if h.failing() {
		e[2] = indexEntry{key: failKey(h, id)}
	}
	return e
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
	idx      [3][]idxOp
	states   stateSet           // CEs whose state this transaction changed (Options.EncodeState)
	klAt     map[uint64]float64 // anchor -> KL(q_sampled || q_anchor) of a confirmation behind (anchorKLAt)
	inexact  int                // measurements at a point whose aftermath the posteriors held did not tell (ConfirmReport.Inexact)
}

// idxOp is one pending index change: put key (with val, the payload to seal) or delete it.
type idxOp struct {
	key, val []byte
	put      bool
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

// lapsed reports whether h is a certified CE whose bound fails at its anchor's stored KL: a
// lapsed certificate, waiting for Confirm to renew or judge it. Nothing stores a lapse; it is
// this, read anew wherever it matters.
func (l *Ledger) lapsed(tx *bolt.Tx, h *header) (bool, error) {
	if h.status != certify.Certified {
		return false, nil
	}
	a, err := certifiedAnchor(tx, h)
	if err != nil {
		return false, err
	}
	return !l.opts.Policy.Bounds(h.certificate(), a.kl).Certified, nil
}

// certifiedAnchor reads the anchor of the certified CE h, which must be stored.
func certifiedAnchor(tx *bolt.Tx, h *header) (anchorMeta, error) {
	a, ok, err := readAnchor(tx, h.anchor)
	if err == nil && !ok {
		err = corruptf("a certified counterfactual refers to anchor %d, which is not stored", h.anchor)
	}
	return a, err
}

// pending reports whether h waits for a Monte-Carlo measurement: failing (at_risk,
// invalidated), or certified with a lapsed bound.
func (l *Ledger) pending(tx *bolt.Tx, h *header) (bool, error) {
	if h.failing() {
		return true, nil
	}
	return l.lapsed(tx, h)
}

// addCount adds d times h's contribution to the status counts (with the lapsed count, judged at
// its anchor's stored KL, which must be stored).
func (w *writeTx) addCount(h *header, d int64) error {
	lapsed, err := w.l.lapsed(w.tx, h)
	if err != nil {
		return err
	}
	w.cnt.addHeader(h, lapsed, d)
	return nil
}

// putHeader stores h under id, replacing old (nil for a new CE), and moves its index entries
// and status count. The anchors of both must be stored.
func (w *writeTx) putHeader(id []byte, old, h *header) error {
	if old != nil {
		if err := w.addCount(old, -1); err != nil {
			return err
		}
	}
	if err := w.addCount(h, 1); err != nil {
		return err
	}
	if err := putSealed(w.tx.Bucket(bHeaders), id, h.encode()); err != nil {
		return err
	}
	w.moveIndex(id, old, h)
	if old != nil {
		w.states.add(id)
	}
	return nil
}

// deleteCE removes a CE's header, body, index entries and reissue entry.
func (w *writeTx) deleteCE(id []byte, old *header) error {
	if err := w.addCount(old, -1); err != nil {
		return err
	}
	if err := w.tx.Bucket(bHeaders).Delete(id); err != nil {
		return err
	}
	if err := w.tx.Bucket(bBodies).Delete(id); err != nil {
		return err
	}
	if err := dropReissue(w.tx, id); err != nil {
		return err
	}
	w.moveIndex(id, old, nil)
	return nil
}

// moveIndex queues the index changes that take id from old to h (nil: absent); applyIndex
// writes them.
func (w *writeTx) moveIndex(id []byte, old, h *header) {
	oe, ne := w.l.indexKeys(id, old), w.l.indexKeys(id, h)
	for i := range w.idx {
		if bytes.Equal(oe[i].key, ne[i].key) && bytes.Equal(oe[i].val, ne[i].val) {
			continue
		}
		if oe[i].key != nil {
			w.idx[i] = append(w.idx[i], idxOp{key: oe[i].key})
		}
		if ne[i].key != nil {
			w.idx[i] = append(w.idx[i], idxOp{key: ne[i].key, val: ne[i].val, put: true})
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
				if err := b.Put(op.key, seal(op.key, op.val)); err != nil {
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
	case i == 2 && len(key) >= 24 && binary.BigEndian.Uint64(key) == carriedPrefix:
		return len(key) - 24
	case i == 2:
		return len(key) - 8
	}
	return len(key) - idxPrefix
}

// recordChange appends ch to the CE's history and to the transaction's list of changes, which
// finish puts in the outbox (Options.EncodeChange) and, when Options.Reissue selects it, in the
// reissue bucket. The one place a status change is recorded.
func (w *writeTx) recordChange(id []byte, ch StatusChange) error {
	if err := w.recordHistory(id, &ch); err != nil {
		return err
	}
	w.changes = append(w.changes, ch)
	return nil
}

// decideChanges sets each recorded change's Decided, RenewalPending and VerdictPending by the rule
// of CE.Decided, from the CE as this transaction leaves it (its header, the anchors' KL and the
// current posterior are final only here), and puts the changes in the outbox in the order they
// were recorded, after the transaction's other events.
func (w *writeTx) decideChanges() error {
	memo := map[uint64]slackMemo{}
	for i := range w.changes {
		ch := &w.changes[i]
		h, ok, err := readHeader(w.tx, []byte(ch.ID))
		if err != nil {
			return err
		}
		if ok && h.status == ch.To {
			d, err := w.l.decide(w.tx, &h, memo)
			if err != nil {
				return inRecord(err, "counterfactual %q: verdict", ch.ID)
			}
			ch.Decided, ch.RenewalPending, ch.VerdictPending = d.decided, d.renewalPending, d.verdictPending
		}
		if enc := w.l.opts.EncodeChange; enc != nil {
			if err := w.enqueue(enc(*ch)); err != nil {
				return err
			}
		}
	}
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
	w.states.add(id)
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
	if err := w.decideChanges(); err != nil {
		return err
	}
	if err := w.markReissues(); err != nil {
		return err
	}
	if err := w.enqueueStates(); err != nil {
		return err
	}
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

// anchorGates maps each live anchor to the gate at its stored KL, and to that KL.
func (l *Ledger) anchorGates(tx *bolt.Tx) (map[uint64]certify.Gate, map[uint64]float64, error) {
	gates, kls := map[uint64]certify.Gate{}, map[uint64]float64{}
	err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		gates[v] = l.opts.Policy.Gate(l.opts.Policy.Slack(a.kl))
		kls[v] = a.kl
		return nil
	})
	return gates, kls, err
}

// rebuildTx recreates the indexes, re-judging every CE holding a certificate at its anchor's
// stored KL: a status that changes is recorded like any other change (history, outbox). It
// returns the number of CEs and of status changes. The bucket of layout v1's certified index
// (bIdxCert) is emptied.
func (l *Ledger) rebuildTx(tx *bolt.Tx) (n, changed int, err error) {
	for _, b := range append([][]byte{bIdxCert}, indexBuckets...) {
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
	var entries [3][]indexEntry
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
		holds := false
		if h.status != certify.Uncertified {
			g, ok := gates[h.anchor]
			if !ok {
				return corruptf("counterfactual %q refers to anchor %d, which is not stored", k, h.anchor)
			}
			_, holds = g.Check(h.p1, h.var1, h.epsilon, h.samples)
			h.rejudge(holds) // a certificate that lapses here is renewed or judged by the confirmer
		}
		id := append([]byte(nil), k...)
		if h != old {
			redo = append(redo, rejudged{id, old, h})
		}
		w.cnt.addHeader(&h, !holds, 1)
		for i, e := range l.indexKeys(id, &h) {
			if e.key != nil {
				entries[i] = append(entries[i], e)
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
	for i, es := range entries {
		slices.SortFunc(es, func(a, b indexEntry) int { return bytes.Compare(a.key, b.key) })
		b := tx.Bucket(indexBuckets[i])
		b.FillPercent = 0.9
		for _, e := range es {
			if err := b.Put(e.key, seal(e.key, e.val)); err != nil {
				return 0, 0, err
			}
		}
	}
	if err := putSealed(tx.Bucket(bMeta), kPolicy, []byte(policyFingerprint(l.opts.Policy))); err != nil {
		return 0, 0, err
	}
	return n, len(redo), w.finish()
}
