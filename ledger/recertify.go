package ledger

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Report summarises one re-certification.
type Report struct {
	// PosteriorVersion is the version of the posterior re-certified against.
	PosteriorVersion uint64 `json:"posterior_version"`
	// Counts are the CEs per status after the changes.
	Counts map[certify.Status]int `json:"counts"`
	// Checked is the number of CEs holding a certificate (all but uncertified): each is judged,
	// most without being looked at (see index.go). Candidates is how many index entries were
	// judged because their anchor's KL moved across one of their thresholds (a CE is read only
	// when its status changes); Changed how many changed status.
	Checked    int `json:"checked"`
	Candidates int `json:"candidates"`
	Changed    int `json:"changed"`
	// Lapsed is how many certified CEs' bounds failed at this version: they stay certified,
	// pending, until Confirm renews or judges them; Restored how many pending CEs' bounds hold
	// again. Neither is a status change. Pending is the renewal backlog after this
	// re-certification: every certified CE whose bound has lapsed.
	Lapsed   int `json:"lapsed"`
	Restored int `json:"restored"`
	Pending  int `json:"pending"`
	// MinBound is the smallest Theorem 1 bound that holds (>= 1/2) over certified CEs (1 when
	// there is none). A certified CE whose Theorem 2 bound alone lapsed still counts: its
	// Theorem 1 bound is a true statement about p_now.
	MinBound float64 `json:"min_bound"`
	// AnchorKL is KL(q_now || q_anchor) per live anchor version; MaxAnchorKL its largest value.
	AnchorKL    map[uint64]float64 `json:"anchor_kl"`
	MaxAnchorKL float64            `json:"max_anchor_kl"`
	Duration    time.Duration      `json:"duration_ns"`
	// Generation is the ledger's CE generation the scan saw; Checkpoint refuses the report if CEs
	// were registered, deleted or changed since (ErrStale).
	Generation uint64 `json:"generation"`
	fp         [32]byte
	// lapsed holds the anchors under which a certificate lapsed (their KL histories keep the
	// version before: lapse.go).
	lapsed map[uint64]bool
}

// Recertify re-judges every stored CE holding a certificate against the posterior `current`
// (not yet stored), without writing anything. KL(current || q_anchor) is computed once per live
// anchor with certify.KL; each CE is certified iff Theorems 1 and 2 hold at its anchor's KL
// under the ledger's Policy:
//
//	p1' - slack_p(KL) >= 1/2   and   min(V1 + slack_V(KL), 1/4) <= max(epsilon_max, epsilon)
//
// Only the index entries whose verdict can change are judged: those between the thresholds of
// the anchor's stored KL and its new one (see index.go), from the terms they carry; a CE is read
// only when its status changes. Each moves by certify.Rejudge: a certified CE whose bound starts
// failing lapses (it stays certified, a lapse in the report, not a status change and not a write:
// a lapse is the bound failing at the anchor's stored KL; Recertify runs no Monte-Carlo, Confirm
// renews or judges it later); an at_risk or invalidated CE whose bound holds again is certified.
// Uncertified CEs keep their status.
//
// The report and changes are to be persisted with Checkpoint{Model: current, Recertified: &rep,
// Changes: changes} (or use Commit, which does both under one lock).
func (l *Ledger) Recertify(ctx context.Context, current *bnn.Model) (Report, []StatusChange, error) {
	blob, err := encodeModel(current)
	if err != nil {
		return Report{}, nil, fmt.Errorf("ledger: recertify: %w", err)
	}
	return l.recertify(ctx, current, blob)
}

// recertify is Recertify with current already encoded (blob), which Commit shares with the
// checkpoint instead of encoding the posterior twice.
func (l *Ledger) recertify(ctx context.Context, current *bnn.Model, blob []byte) (Report, []StatusChange, error) {
	start := time.Now()
	rep := Report{PosteriorVersion: current.Version, AnchorKL: map[uint64]float64{}, MinBound: 1, fp: fingerprint(blob),
		lapsed: map[uint64]bool{}}
	r := &recert{l: l, rep: &rep, now: l.opts.Now().UTC()}
	var cnt counts
	err := l.view(func(tx *bolt.Tx) error {
		var err error
		if rep.Generation, err = metaU64(tx, kGen); err != nil {
			return err
		}
		if cnt, err = readCounts(tx); err != nil {
			return err
		}
		return forEachAnchor(tx, func(v uint64, a anchorMeta) error {
			if a.refs == 0 {
				return nil
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			return r.anchor(tx, current, v, a)
		})
	})
	if err != nil {
		return Report{}, nil, fmt.Errorf("ledger: recertify: %w", err)
	}
	// In ID order: deterministic, and the order the records are stored in.
	slices.SortFunc(r.changes, func(a, b StatusChange) int { return strings.Compare(a.ID, b.ID) })
	for _, ch := range r.changes {
		cnt.add(ch.From, -1)
		cnt.add(ch.To, 1)
	}
	cnt[lapsedSlot] += int64(rep.Lapsed - rep.Restored)
	rep.Pending = int(cnt[lapsedSlot])
	rep.Counts, rep.Changed = cnt.asMap(), len(r.changes)
	rep.Checked = int(cnt[certify.Certified-1] + cnt[certify.AtRisk-1] + cnt[certify.Invalidated-1])
	rep.Duration = time.Since(start)
	return rep, r.changes, nil
}

// recert is one re-certification in progress.
type recert struct {
	l       *Ledger
	rep     *Report
	now     time.Time
	changes []StatusChange
}

// anchor re-judges the CEs under anchor v whose verdict the move of its KL can change, and
// folds the anchor's certified CEs into MinBound.
func (r *recert) anchor(tx *bolt.Tx, current *bnn.Model, v uint64, a anchorMeta) error {
	pol := r.l.opts.Policy
	m, err := r.l.model(tx, v)
	if err != nil {
		return err
	}
	kl, _, err := certify.KL(current, m)
	if err != nil {
		return fmt.Errorf("anchor %d: %w", v, err)
	}
	r.rep.AnchorKL[v] = kl
	r.rep.MaxAnchorKL = math.Max(r.rep.MaxAnchorKL, kl)
	so, sn := pol.Slack(a.kl), pol.Slack(kl)
	gold, gnew := pol.Gate(so), pol.Gate(sn)
	first := len(r.changes)
	// The p1' range whose Theorem 1 verdict can change; an idx_var entry inside it was judged
	// in the idx_p1 scan already.
	plo, phi := math.Inf(1), math.Inf(-1)
	visit := func(e idxEntry) error {
		r.rep.Candidates++
		was, is := e.terms.holds(&gold), e.terms.holds(&gnew)
		switch {
		case was == is:
			return nil
		case e.class == classCertified && was:
			r.rep.Lapsed++ // not a status change: the confirmer renews or judges it
			r.rep.lapsed[v] = true
			return nil
		case e.class == classCertified:
			r.rep.Restored++
			return nil
		case was:
			return corruptf("counterfactual %q under anchor %d is at_risk or invalidated, yet its bound held at the anchor's stored KL", e.id, v)
		}
		h, ok, err := readHeader(tx, e.id)
		if err == nil && (!ok || h.anchor != v || !h.failing()) {
			err = corruptf("index entry of counterfactual %q under anchor %d has no matching record", e.id, v)
		}
		if err != nil {
			return err
		}
		b := pol.Evaluate(h.certificate(), sn)
		r.changes = append(r.changes, StatusChange{ID: string(e.id), At: r.now, From: h.status, To: certify.Certified,
			PosteriorVersion: current.Version, KL: kl, Bound: b.ProbLower, VarBound: b.VarUpper})
		return nil
	}
	if so.Mean != sn.Mean {
		lo, hi := 0.5+math.Min(so.Mean, sn.Mean), 0.5+math.Max(so.Mean, sn.Mean)
		plo, phi = lo-margin(lo), hi+margin(hi)
		for _, class := range []byte{classCertified, classFailing} {
			if err := scanIndex(tx, bIdxP1, v, class, plo, phi, visit); err != nil {
				return err
			}
		}
	}
	if so.Var != sn.Var {
		lo, hi := math.Min(so.Var, sn.Var), math.Max(so.Var, sn.Var)
		for _, class := range []byte{classCertified, classFailing} {
			err := scanIndex(tx, bIdxVar, v, class, lo-margin(lo), hi+margin(hi), func(e idxEntry) error {
				if e.terms.p1s >= plo && e.terms.p1s <= phi {
					return nil
				}
				return visit(e)
			})
			if err != nil {
				return err
			}
		}
	}
	return r.minBound(tx, v, &gnew, sn, r.changes[first:])
}

func margin(x float64) float64 { return scanMargin * math.Max(1, math.Abs(x)) }

// minBound folds into MinBound the smallest Theorem 1 bound p1' - slack_p that holds (>= 1/2)
// over the CEs under anchor v that are certified after this re-certification: the first entry
// of idx_p1's certified class at or above the threshold, and the CEs that just gained a
// certificate (changes).
func (r *recert) minBound(tx *bolt.Tx, v uint64, g *certify.Gate, sn certify.Slack, changes []StatusChange) error {
	for _, ch := range changes {
		r.rep.MinBound = math.Min(r.rep.MinBound, ch.Bound)
	}
	b, ok, err := firstHolding(tx, v, g, sn)
	if ok {
		r.rep.MinBound = math.Min(r.rep.MinBound, b)
	}
	return err
}

// firstHolding is the smallest Theorem 1 bound p1' - slack_p that holds under gate g (the slack
// sn) over the certified CEs under anchor v, read from the first idx_p1 entry of the certified
// class at or above the threshold 1/2 + slack_p; ok is false when there is none.
func firstHolding(tx *bolt.Tx, v uint64, g *certify.Gate, sn certify.Slack) (float64, bool, error) {
	thr := 0.5 + sn.Mean
	found, b := false, 0.0
	err := scanIndex(tx, bIdxP1, v, classCertified, thr-margin(thr), math.Inf(1), func(e idxEntry) error {
		if !g.Theorem1(e.terms.p1s) {
			return nil // within the margin below the threshold
		}
		found, b = true, e.terms.p1s-sn.Mean
		return errStop
	})
	if err == errStop {
		err = nil
	}
	return b, found, err
}

// errStop ends an index scan early without an error.
var errStop = errors.New("stop")

// scanIndex calls fn with every entry of idx_p1 or idx_var (bucket) with anchor v, the given
// class and key value in [lo, hi], in key order. fn may return errStop to end the scan.
func scanIndex(tx *bolt.Tx, bucket []byte, v uint64, class byte, lo, hi float64, fn func(e idxEntry) error) error {
	c := tx.Bucket(bucket).Cursor()
	for k, val := c.Seek(idxKey(v, class, lo, nil)); k != nil; k, val = c.Next() {
		if len(k) < idxPrefix || binary.BigEndian.Uint64(k) != v || k[8] != class || keyFloat(k[9:idxPrefix]) > hi {
			return nil
		}
		e, err := decodeIdx(bucket, k, val)
		if err != nil {
			return err
		}
		if err := fn(e); err != nil {
			return err
		}
	}
	return nil
}

// UpdateRecord describes the update a checkpoint records in the KL history.
type UpdateRecord struct {
	// Version is the posterior version the update produced (or proposed, if not promoted).
	Version uint64
	// KL is the update KL, KL(q_new || q_prev).
	KL      float64
	Outcome certify.Outcome
	// Breached marks an update that breached the KL budget in force when it was made
	// (KLEntry.Breached): the ledger keeps the newest such entry after its KL history window has
	// dropped it (LastKLOver).
	Breached bool
	// Quality, if not empty, is the increment's prequential record, stored beside the KL history
	// entry in the same transaction (see quality.go).
	Quality []byte
}

// Checkpoint is everything one increment of the daemon persists, written in one transaction.
type Checkpoint struct {
	// Model becomes the current posterior (nil keeps the current one). Its version must exceed the
	// current version unless it is bit-identical to the current posterior.
	Model *bnn.Model
	// Origin names where the first posterior came from (a model path, a data set). It is stored
	// with the first posterior; a checkpoint naming a different one is refused with ErrOrigin.
	Origin string
	// Recertified and Changes are what Recertify returned for Model. They are required when Model
	// replaces the current posterior while CEs hold certificates.
	Recertified *Report
	Changes     []StatusChange
	// Update, if not nil, is appended to the KL history, at At.
	Update *UpdateRecord
	// At is when the update was made: a replica replaying the posterior log gives the time its
	// entry was written, so that a log replayed long after keeps its updates' (and breaches')
	// times. Zero: the time of the write.
	At time.Time
	// Offsets are the next offsets to consume per partition (absolute, replacing the stored ones
	// for the partitions given).
	Offsets map[int]int64
	// Marks identify, per partition, the last record read before its offset (see OffsetMark);
	// each needs an offset in Offsets above it. A partition given an offset without a mark keeps
	// its stored mark, which stays valid: the consumer read on in the same log.
	Marks map[int]OffsetMark
	// ForgetMarks are partitions whose stored mark belongs to a log they no longer read (a
	// confirmed topic reset moved their offset to a new log): the marks are deleted.
	ForgetMarks []int
	// Applied is the number of records applied in this increment (added to the total).
	Applied int64
	// Counters are added to the named counters (non-negative deltas).
	Counters map[string]int64
	// Events are put in the outbox in this transaction (their Seq is assigned by the ledger),
	// before the status changes.
	Events []OutboxEntry
	// Reissued are CEs whose reissue these Events settle (Options.Reissue): each one's entry is
	// deleted unless a status change after its Version wrote it again.
	Reissued []PendingReissue
	// LogHead, when not nil, replaces the stored head of the posterior log (a replica's position
	// in the log it follows, opaque to the ledger: see package postlog). It is written in the
	// transaction that stores the posterior it describes.
	LogHead []byte
}

func (c *Checkpoint) validate() error {
	for p, off := range c.Offsets {
		if p < 0 || p > math.MaxInt32 || off < 0 {
			return invalidf("offset %d for partition %d", off, p)
		}
	}
	if err := c.validateMarks(); err != nil {
		return err
	}
	if c.Applied < 0 {
		return invalidf("applied = %d, want >= 0", c.Applied)
	}
	for name, d := range c.Counters {
		if name == "" || len(name) > 64 || d < 0 {
			return invalidf("counter %q += %d (want a name of 1-64 bytes and a delta >= 0)", name, d)
		}
	}
	if u := c.Update; u != nil && (!(u.KL >= 0) || math.IsInf(u.KL, 0) || !u.Outcome.Valid()) {
		return invalidf("update kl = %v, outcome %q (want a finite kl >= 0 and one of %v)", u.KL, u.Outcome, certify.Outcomes())
	}
	if c.Recertified == nil && len(c.Changes) > 0 {
		return invalidf("%d status changes without the re-certification report they came from", len(c.Changes))
	}
	for _, ch := range c.Changes {
		if !ch.From.Valid() || !ch.To.Valid() {
			return invalidf("status change of %q from %d to %d", ch.ID, ch.From, ch.To)
		}
	}
	if len(c.Origin) > 4096 {
		return invalidf("origin of %d bytes (at most 4096)", len(c.Origin))
	}
	for i, e := range c.Events {
		if len(e.Key) > maxOutboxKey {
			return invalidf("event %d: key of %d bytes (at most %d)", i, len(e.Key), maxOutboxKey)
		}
	}
	return nil
}

// Checkpoint writes c in one bbolt transaction (fsynced on commit): the new current posterior,
// the anchors' KL from it, the CE status changes (with their outbox entries), offsets,
// counters, the KL history and c.Events; then releases anchors no CE refers to any more. On any
// error nothing is written. ErrStale means the CEs changed since Recertify ran: re-certify and
// try again (or use Commit). ErrWrite means the commit failed (see ErrWrite).
func (l *Ledger) Checkpoint(c *Checkpoint) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	return l.checkpoint(c, nil)
}

// Commit re-certifies against c.Model (when given) and checkpoints, holding the writer lock
// across both so that the result cannot go stale. It returns the re-certification (zero Report
// when c.Model is nil). Like Recertify it runs no Monte-Carlo: call Confirm afterwards.
func (l *Ledger) Commit(ctx context.Context, c *Checkpoint) (Report, []StatusChange, error) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var (
		rep     Report
		changes []StatusChange
	)
	var blob []byte
	if c.Model != nil {
		var err error
		if blob, err = encodeModel(c.Model); err != nil {
			return Report{}, nil, fmt.Errorf("ledger: recertify: %w", err) // as Recertify says it
		}
		if rep, changes, err = l.recertify(ctx, c.Model, blob); err != nil {
			return Report{}, nil, err
		}
		c.Recertified, c.Changes = &rep, changes
	}
	if err := l.checkpoint(c, blob); err != nil {
		return Report{}, nil, err
	}
	return rep, changes, nil
}

// checkpoint writes c; blob is c.Model encoded, or nil to encode it here.
func (l *Ledger) checkpoint(c *Checkpoint, blob []byte) error {
	if err := c.validate(); err != nil {
		return fmt.Errorf("ledger: checkpoint: %w", err)
	}
	if c.Model != nil && blob == nil {
		var err error
		if blob, err = encodeModel(c.Model); err != nil {
			return fmt.Errorf("ledger: checkpoint: %w", err)
		}
	}
	now := l.opts.Now().UTC()
	err := l.update(func(tx *bolt.Tx) error {
		old, err := readCur(tx)
		if err != nil {
			return err
		}
		next := old
		if blob != nil {
			fp := fingerprint(blob)
			if !old.ok || fp != old.sha {
				if old.ok && c.Model.Version <= old.version {
					return fmt.Errorf("%w: new posterior has version %d, current is %d", ErrVersion, c.Model.Version, old.version)
				}
				next = cur{ok: true, version: c.Model.Version, sha: fp}
			}
		}
		if err := checkOrigin(tx, c.Origin); err != nil {
			return err
		}
		w, err := l.newWriteTx(tx, now)
		if err != nil {
			return err
		}
		// The checkpoint's events (an update over budget, for one) come before the status
		// changes they explain.
		for _, e := range c.Events {
			if err := w.enqueue(e); err != nil {
				return err
			}
		}
		if err := w.settleReissues(c.Reissued); err != nil {
			return err
		}
		changed, err := l.applyRecertification(w, c, old, next)
		if err != nil {
			return err
		}
		if next != old {
			meta := tx.Bucket(bMeta)
			if err := putSealed(meta, kCurrent, blob); err != nil {
				return err
			}
			if err := putSealed(meta, kCurSHA, next.sha[:]); err != nil {
				return err
			}
			if err := putU64(meta, kCurVer, next.version); err != nil {
				return err
			}
		}
		if err := l.gcAnchors(tx, next.version); err != nil {
			return err
		}
		if err := l.writeProgress(tx, c, now); err != nil {
			return err
		}
		if c.LogHead != nil {
			if err := putSealed(tx.Bucket(bMeta), kLogHead, c.LogHead); err != nil {
				return err
			}
		}
		if next == old && !changed {
			return w.finishNoGen()
		}
		return w.finish()
	})
	if err != nil {
		return fmt.Errorf("ledger: checkpoint: %w", err)
	}
	return nil
}

// checkOrigin stores origin if none is stored and refuses a different one.
func checkOrigin(tx *bolt.Tx, origin string) error {
	if origin == "" {
		return nil
	}
	meta := tx.Bucket(bMeta)
	stored, err := getSealed(meta, kOrigin, "meta origin")
	switch {
	case err != nil:
		return err
	case stored == nil:
		return putSealed(meta, kOrigin, []byte(origin))
	case string(stored) != origin:
		return fmt.Errorf("%w: the ledger's first posterior came from %q, this checkpoint names %q", ErrOrigin, stored, origin)
	}
	return nil
}

// applyRecertification checks that c.Recertified belongs to the posterior that is current after
// this checkpoint and to the CEs as stored, then records the anchors' KL and the status changes.
func (l *Ledger) applyRecertification(w *writeTx, c *Checkpoint, old, next cur) (bool, error) {
	tx := w.tx
	live := map[uint64]anchorMeta{}
	if err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		if a.refs > 0 {
			live[v] = a
		}
		return nil
	}); err != nil {
		return false, err
	}
	r := c.Recertified
	if r == nil {
		if next != old && len(live) > 0 {
			return false, fmt.Errorf("%w: posterior %d replaces %d while %d anchors hold certificates", ErrNotRecertified, next.version, old.version, len(live))
		}
		if b := tx.Bucket(bAnchorKL); next.version != old.version && b != nil {
			return false, endAnchorKL(b, next.version) // no live anchor: nothing else to keep
		}
		return false, nil
	}
	if !next.ok || r.fp != next.sha {
		return false, fmt.Errorf("%w: the report is for posterior version %d, which is not the posterior this checkpoint makes current", ErrNotRecertified, r.PosteriorVersion)
	}
	if g, err := metaU64(tx, kGen); err != nil || g != r.Generation {
		if err == nil {
			err = fmt.Errorf("%w: counterfactuals changed since re-certification (generation %d, now %d)", ErrStale, r.Generation, g)
		}
		return false, err
	}
	// The anchors' KL histories move on with a new version (the same version re-certified again
	// leaves them as they are).
	var hist *bolt.Bucket
	if next.version != old.version {
		var err error
		if hist, err = beginAnchorKL(tx, old.version); err != nil {
			return false, err
		}
	}
	for _, v := range slices.Sorted(maps.Keys(live)) {
		a := live[v]
		kl, ok := r.AnchorKL[v]
		if !ok {
			return false, fmt.Errorf("%w: anchor %d is not in the re-certification", ErrStale, v)
		}
		if hist != nil {
			if err := recordAnchorKL(hist, v, a.klVersion, a.kl, next.version, kl, r.lapsed[v]); err != nil {
				return false, err
			}
		}
		a.kl, a.klVersion = kl, next.version
		if err := putAnchor(tx, v, a); err != nil {
			return false, err
		}
	}
	if hist != nil {
		if err := endAnchorKL(hist, next.version); err != nil {
			return false, err
		}
	}
	for _, ch := range c.Changes {
		ch.PosteriorVersion = next.version
		if err := w.applyChange(ch, nil); err != nil {
			return false, err
		}
	}
	// Lapses are written as what they are: a count. The CEs stay as they are; their bounds at
	// the anchors' new KL say they lapsed.
	w.cnt[lapsedSlot] += int64(r.Lapsed - r.Restored)
	return len(c.Changes) > 0, nil
}

// applyChange moves a stored CE from ch.From to ch.To and records the change. A CE entering
// at_risk or invalidated is confirmed at *confirmed when that is given (a Monte-Carlo verdict),
// unconfirmed otherwise.
func (w *writeTx) applyChange(ch StatusChange, confirmed *uint64) error {
	id := []byte(ch.ID)
	h, ok, err := readHeader(w.tx, id)
	if err != nil {
		return err
	}
	switch {
	case !ok:
		return fmt.Errorf("%w: counterfactual %q is gone", ErrStale, ch.ID)
	case h.status != ch.From:
		return fmt.Errorf("%w: counterfactual %q is %v, change expects %v", ErrStale, ch.ID, h.status, ch.From)
	case ch.From == certify.Uncertified || ch.To == certify.Uncertified:
		return invalidf("counterfactual %q: re-certification cannot move %v to %v", ch.ID, ch.From, ch.To)
	}
	nh := h
	nh.status = ch.To
	nh.unconfirm()
	if confirmed != nil && nh.failing() {
		nh.confirm(*confirmed, nil, 0)
	}
	if ch.At.IsZero() {
		ch.At = w.now
	}
	nh.updated = ch.At.UnixNano()
	if err := w.putHeader(id, &h, &nh); err != nil {
		return err
	}
	return w.recordChange(id, ch)
}

// writeProgress stores offsets (with their marks), counters and the KL history entry of a
// checkpoint.
func (l *Ledger) writeProgress(tx *bolt.Tx, c *Checkpoint, now time.Time) error {
	if err := writeMarks(tx, c); err != nil {
		return err
	}
	offs := tx.Bucket(bOffsets)
	for p, off := range c.Offsets {
		if err := putSealed(offs, binary.BigEndian.AppendUint32(nil, uint32(p)), u64bytes(uint64(off))); err != nil {
			return err
		}
	}
	meta := tx.Bucket(bMeta)
	if c.Applied > 0 {
		applied, err := metaU64(tx, kApplied)
		if err != nil {
			return err
		}
		if err := putU64(meta, kApplied, applied+uint64(c.Applied)); err != nil {
			return err
		}
		if err := putU64(meta, kAppliedAt, uint64(now.UnixNano())); err != nil {
			return err
		}
	}
	for name, d := range c.Counters {
		if err := addCounter(tx, name, d, now); err != nil {
			return err
		}
	}
	if c.Update == nil {
		return nil
	}
	last, err := metaU64(tx, kKLSeq)
	if err != nil {
		return err
	}
	seq := last + 1
	at := now
	if !c.At.IsZero() {
		at = c.At.UTC()
	}
	s := KLEntry{Seq: seq, At: at, PosteriorVersion: c.Update.Version, KL: c.Update.KL, Outcome: c.Update.Outcome}
	if c.Recertified != nil {
		s.MaxAnchorKL = c.Recertified.MaxAnchorKL
	}
	hist := tx.Bucket(bKLHistory)
	if err := putSealed(hist, u64bytes(seq), s.encode()); err != nil {
		return err
	}
	// The newest breach and the newest failure outlive the history: each dates an alert.
	if c.Update.Breached {
		if err := putSealed(meta, kKLBreach, append(u64bytes(seq), s.encode()...)); err != nil {
			return err
		}
	}
	if c.Update.Outcome == certify.OutcomeFailed {
		if err := putSealed(meta, kKLFailed, append(u64bytes(seq), s.encode()...)); err != nil {
			return err
		}
	}
	if err := putU64(meta, kKLSeq, seq); err != nil {
		return err
	}
	keep := min(uint64(l.opts.KLHistory), seq)
	if err := writeQuality(tx, seq, c.Update.Quality, seq-keep); err != nil {
		return err
	}
	cur := hist.Cursor()
	for k, _ := cur.First(); k != nil && binary.BigEndian.Uint64(k) <= seq-keep; k, _ = cur.First() {
		if err := cur.Delete(); err != nil {
			return err
		}
	}
	return nil
}
