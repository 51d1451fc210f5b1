package ledger

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
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
	// most without being read (see index.go). Candidates is how many were read because their
	// anchor's KL moved across one of their thresholds; Changed how many changed status.
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
	// MinBound is the smallest Theorem 1 bound over certified CEs (1 when there are none).
	MinBound float64 `json:"min_bound"`
	// AnchorKL is KL(q_now || q_anchor) per live anchor version; MaxAnchorKL its largest value.
	AnchorKL    map[uint64]float64 `json:"anchor_kl"`
	MaxAnchorKL float64            `json:"max_anchor_kl"`
	Duration    time.Duration      `json:"duration_ns"`
	// Generation is the ledger's CE generation the scan saw; Checkpoint refuses the report if CEs
	// were registered, deleted or changed since (ErrStale).
	Generation uint64 `json:"generation"`
	fp         [32]byte
	lapses     []lapse
}

// lapse is a certified CE whose bound starts failing (lapsed) or holds again (!lapsed).
type lapse struct {
	id     string
	lapsed bool
}

// Recertify re-judges every stored CE holding a certificate against the posterior `current`
// (not yet stored), without writing anything. KL(current || q_anchor) is computed once per live
// anchor with certify.KL; each CE is certified iff Theorems 1 and 2 hold at its anchor's KL
// under the ledger's Policy:
//
//	p1' - slack_p(KL) >= 1/2   and   min(V1 + slack_V(KL), 1/4) <= max(epsilon_max, epsilon)
//
// Only CEs whose verdict can change are read: those the indexes place between the thresholds
// of the anchor's stored KL and its new one (see index.go). Each moves by certify.Rejudge: a
// certified CE whose bound starts failing lapses (it stays certified, a lapse in the report, not
// a status change: Recertify runs no Monte-Carlo, Confirm renews or judges it later); a lapsed,
// at_risk or invalidated CE whose bound holds again is certified. Uncertified CEs keep their
// status.
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
	rep := Report{PosteriorVersion: current.Version, AnchorKL: map[uint64]float64{}, MinBound: 1, fp: fingerprint(blob)}
	r := &recert{l: l, rep: &rep, now: l.opts.Now().UTC(), seen: map[string]bool{}}
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
	slices.SortFunc(r.lapses, func(a, b lapse) int { return strings.Compare(a.id, b.id) })
	for _, lp := range r.lapses {
		if lp.lapsed {
			rep.Lapsed++
			cnt[lapsedSlot]++
		} else {
			rep.Restored++
			cnt[lapsedSlot]--
		}
	}
	rep.Pending, rep.lapses = int(cnt[lapsedSlot]), r.lapses
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
	seen    map[string]bool
	changes []StatusChange
	lapses  []lapse
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
	gate := pol.Gate(sn)
	first, firstLapse := len(r.changes), len(r.lapses)
	visit := func(id []byte) error {
		if r.seen[string(id)] {
			return nil
		}
		r.seen[string(id)] = true
		r.rep.Candidates++
		h, ok, err := readHeader(tx, id)
		if err == nil && (!ok || h.anchor != v || h.status == certify.Uncertified) {
			err = corruptf("index entry of counterfactual %q under anchor %d has no matching record", id, v)
		}
		if err != nil {
			return err
		}
		_, holds := gate.Check(h.p1, h.var1, h.epsilon, h.samples)
		prev := h.standing()
		next := certify.Rejudge(prev, holds)
		switch {
		case next == prev:
			return nil
		case next.Status == prev.Status:
			// A certificate lapses, or a lapsed one holds again: not a status change. The
			// confirmer measures a lapsed CE and renews it or gives it a verdict.
			r.lapses = append(r.lapses, lapse{id: string(id), lapsed: next.Lapsed})
			return nil
		}
		b := pol.Evaluate(h.certificate(), sn)
		r.changes = append(r.changes, StatusChange{ID: string(id), At: r.now, From: prev.Status, To: next.Status,
			PosteriorVersion: current.Version, KL: kl, Bound: b.ProbLower, VarBound: b.VarUpper})
		return nil
	}
	if so.Mean != sn.Mean {
		lo, hi := 0.5+math.Min(so.Mean, sn.Mean), 0.5+math.Max(so.Mean, sn.Mean)
		if err := scanIndex(tx.Bucket(bIdxP1), v, lo-margin(lo), hi+margin(hi), visit); err != nil {
			return err
		}
	}
	if so.Var != sn.Var {
		lo, hi := math.Min(so.Var, sn.Var), math.Max(so.Var, sn.Var)
		if err := scanIndex(tx.Bucket(bIdxVar), v, lo-margin(lo), hi+margin(hi), visit); err != nil {
			return err
		}
	}
	return r.minBound(tx, v, sn, r.changes[first:], r.lapses[firstLapse:])
}

func margin(x float64) float64 { return scanMargin * math.Max(1, math.Abs(x)) }

// minBound folds into MinBound the smallest Theorem 1 bound p1' - slack_p over the CEs under
// anchor v that are certified after this re-certification: the first idx_cert entry that did
// not just lose its certificate, and the CEs that just gained one.
func (r *recert) minBound(tx *bolt.Tx, v uint64, sn certify.Slack, changes []StatusChange, lapses []lapse) error {
	pol := r.l.opts.Policy
	lost := map[string]bool{}
	gain := func(id string) error {
		h, _, err := readHeader(tx, []byte(id))
		if err != nil {
			return err
		}
		r.rep.MinBound = math.Min(r.rep.MinBound, pol.StartP1(h.certificate())-sn.Mean)
		return nil
	}
	for _, ch := range changes {
		if ch.To == certify.Certified {
			if err := gain(ch.ID); err != nil {
				return err
			}
		} else {
			lost[ch.ID] = true
		}
	}
	for _, lp := range lapses {
		if !lp.lapsed {
			if err := gain(lp.id); err != nil {
				return err
			}
		} else {
			lost[lp.id] = true
		}
	}
	prefix := u64bytes(v)
	c := tx.Bucket(bIdxCert).Cursor()
	for k, val := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, val = c.Next() {
		if _, ok := unseal(k, val); !ok || len(k) < 16 {
			return corruptf("idx_cert entry %x is damaged", k)
		}
		if lost[string(k[16:])] {
			continue
		}
		r.rep.MinBound = math.Min(r.rep.MinBound, keyFloat(k[8:16])-sn.Mean)
		break
	}
	return nil
}

// scanIndex calls fn with the id of every entry of an anchor-keyed index with anchor v and key
// value in [lo, hi].
func scanIndex(b *bolt.Bucket, v uint64, lo, hi float64, fn func(id []byte) error) error {
	c := b.Cursor()
	for k, val := c.Seek(idxKey(v, lo, nil)); k != nil; k, val = c.Next() {
		if len(k) < 16 || binary.BigEndian.Uint64(k) != v || keyFloat(k[8:16]) > hi {
			return nil
		}
		if _, ok := unseal(k, val); !ok {
			return corruptf("index entry %x is damaged", k)
		}
		if err := fn(k[16:]); err != nil {
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
	// Update, if not nil, is appended to the KL history.
	Update *UpdateRecord
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
	for v, a := range live {
		kl, ok := r.AnchorKL[v]
		if !ok {
			return false, fmt.Errorf("%w: anchor %d is not in the re-certification", ErrStale, v)
		}
		a.kl, a.klVersion = kl, next.version
		if err := putAnchor(tx, v, a); err != nil {
			return false, err
		}
	}
	for _, ch := range c.Changes {
		ch.PosteriorVersion = next.version
		if err := w.applyChange(ch, nil); err != nil {
			return false, err
		}
	}
	for _, lp := range r.lapses {
		if err := w.applyLapse(lp); err != nil {
			return false, err
		}
	}
	return len(c.Changes) > 0 || len(r.lapses) > 0, nil
}

// applyLapse sets or clears the lapsed flag of a certified CE.
func (w *writeTx) applyLapse(lp lapse) error {
	id := []byte(lp.id)
	h, ok, err := readHeader(w.tx, id)
	switch {
	case err != nil:
		return err
	case !ok:
		return fmt.Errorf("%w: counterfactual %q is gone", ErrStale, lp.id)
	case h.status != certify.Certified || h.lapsed == lp.lapsed:
		return fmt.Errorf("%w: counterfactual %q is %v (lapsed %v), the re-certification expects certified (lapsed %v)", ErrStale, lp.id, h.status, h.lapsed, !lp.lapsed)
	}
	nh := h
	nh.lapsed, nh.updated = lp.lapsed, w.now.UnixNano()
	return w.putHeader(id, &h, &nh)
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
	case h.lapsed && ch.To != certify.Certified:
		return fmt.Errorf("%w: counterfactual %q has a lapsed certificate, which only its renewal or verdict changes", ErrStale, ch.ID)
	case ch.From == certify.Uncertified || ch.To == certify.Uncertified:
		return invalidf("counterfactual %q: re-certification cannot move %v to %v", ch.ID, ch.From, ch.To)
	}
	nh := h
	nh.status, nh.lapsed = ch.To, false
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
	ctrs := tx.Bucket(bCounters)
	for name, d := range c.Counters {
		n, err := getU64(ctrs, []byte(name), fmt.Sprintf("counter %q", name))
		if err != nil {
			return err
		}
		if err := putU64(ctrs, []byte(name), n+uint64(d)); err != nil {
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
	s := KLEntry{Seq: seq, At: now, PosteriorVersion: c.Update.Version, KL: c.Update.KL, Outcome: c.Update.Outcome}
	if c.Recertified != nil {
		s.MaxAnchorKL = c.Recertified.MaxAnchorKL
	}
	hist := tx.Bucket(bKLHistory)
	if err := putSealed(hist, u64bytes(seq), s.encode()); err != nil {
		return err
	}
	if err := putU64(meta, kKLSeq, seq); err != nil {
		return err
	}
	keep := min(uint64(l.opts.KLHistory), seq)
	cur := hist.Cursor()
	for k, _ := cur.First(); k != nil && binary.BigEndian.Uint64(k) <= seq-keep; k, _ = cur.First() {
		if err := cur.Delete(); err != nil {
			return err
		}
	}
	return nil
}
