package ledger

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// RecertifyOptions tune the Monte-Carlo fallback of Recertify.
type RecertifyOptions struct {
	// Samples is the number of posterior draws for CEs whose bound fails. Default: Options.MCSamples.
	Samples int
	// Seed makes the Monte-Carlo pass reproducible.
	Seed uint64
}

// Report summarises one re-certification.
type Report struct {
	// PosteriorVersion is the version of the posterior re-certified against.
	PosteriorVersion uint64 `json:"posterior_version"`
	// Counts are the CEs per status after the changes.
	Counts map[certify.Status]int `json:"counts"`
	// Checked is the number of CEs holding a certificate (all but uncertified); MonteCarlo how many
	// of them failed the bound and were sampled; Changed how many changed status.
	Checked    int `json:"checked"`
	MonteCarlo int `json:"monte_carlo"`
	Changed    int `json:"changed"`
	// MinBound is the smallest Theorem 1 bound over checked CEs (1 when there are none).
	MinBound float64 `json:"min_bound"`
	// AnchorKL is KL(q_now || q_anchor) per live anchor version; MaxAnchorKL its largest value.
	AnchorKL    map[uint64]float64 `json:"anchor_kl"`
	MaxAnchorKL float64            `json:"max_anchor_kl"`
	Duration    time.Duration      `json:"duration_ns"`
	// Generation is the ledger's CE generation the scan saw; Checkpoint refuses the report if CEs
	// were registered, deleted or changed since (ErrStale).
	Generation uint64 `json:"generation"`
	fp         [32]byte
}

// liveAnchor is one anchor in the bound pass: its version and the slack its KL allows.
type liveAnchor struct {
	version uint64
	slack   certify.Slack
	gate    certify.Gate
}

// mcItem is a CE whose bound failed and which waits for the Monte-Carlo pass.
type mcItem struct {
	id     string
	from   certify.Status
	target int
	b      certify.Bounds
	kl     float64
	xcf    []float64
}

// Recertify re-judges every stored CE against the posterior `current` (not yet stored), without
// writing anything. KL(current || q_anchor) is computed once per live anchor with certify.KL;
// each CE is then judged by arithmetic on its fixed-size header (Theorems 1 and 2 under the
// ledger's Policy: certified iff p1' - slack_p >= 1/2 and V1 + slack_V <= budget). Only CEs
// whose bound fails are read in full and get a Monte-Carlo estimate under `current`, all in
// batched Predict calls with opts.Seed: at_risk if p2 >= 1/2 and argmax = target, else
// invalidated. Uncertified CEs keep their status.
//
// The report and changes are to be persisted with Checkpoint{Model: current, Recertified: &rep,
// Changes: changes} (or use Commit, which does both under one lock).
func (l *Ledger) Recertify(ctx context.Context, current *bnn.Model, opts RecertifyOptions) (Report, []StatusChange, error) {
	start := time.Now()
	samples := opts.Samples
	if samples == 0 {
		samples = l.opts.MCSamples
	}
	if samples < 2 {
		return Report{}, nil, fmt.Errorf("ledger: recertify: %w: samples = %d, want >= 2", ErrInvalid, samples)
	}
	blob, err := encodeModel(current)
	if err != nil {
		return Report{}, nil, fmt.Errorf("ledger: recertify: %w", err)
	}
	rep := Report{PosteriorVersion: current.Version, AnchorKL: map[uint64]float64{}, MinBound: 1, fp: fingerprint(blob)}
	now := l.opts.Now().UTC()
	var (
		cnt     counts
		changes []StatusChange
		mc      []mcItem
	)
	err = l.db.View(func(tx *bolt.Tx) error {
		rep.Generation = getU64(tx.Bucket(bMeta), kGen)
		anchors, index, err := l.liveAnchors(tx, current, &rep)
		if err != nil {
			return err
		}
		changes, mc, err = l.boundPass(ctx, tx, anchors, index, &rep, &cnt, now)
		if err != nil {
			return err
		}
		bodies := tx.Bucket(bBodies)
		for i := range mc {
			bd, err := decodeBody(bodies.Get([]byte(mc[i].id)), false)
			if err != nil {
				return fmt.Errorf("counterfactual %q: %w", mc[i].id, err)
			}
			mc[i].xcf = bd.xcf
		}
		return nil
	})
	if err != nil {
		return Report{}, nil, fmt.Errorf("ledger: recertify: %w", err)
	}
	if len(mc) > 0 {
		xs := make([][]float64, len(mc))
		for i := range mc {
			xs[i] = mc[i].xcf
		}
		pred, err := l.predict(ctx, current, xs, samples, opts.Seed)
		if err != nil {
			return Report{}, nil, fmt.Errorf("ledger: recertify: %w", err)
		}
		for i, it := range mc {
			p2 := pred.P(i, it.target)
			s := certify.Observed(p2, pred.Argmax(i), it.target)
			cnt.add(s, 1)
			if s != it.from {
				changes = append(changes, StatusChange{ID: it.id, At: now, From: it.from, To: s, PosteriorVersion: current.Version,
					KL: it.kl, Bound: it.b.ProbLower, VarBound: it.b.VarUpper, P2: &p2})
			}
		}
	}
	rep.MonteCarlo, rep.Changed, rep.Counts = len(mc), len(changes), cnt.asMap()
	rep.Duration = time.Since(start)
	return rep, changes, nil
}

// liveAnchors computes KL(current || q_anchor) once per anchor that CEs refer to.
func (l *Ledger) liveAnchors(tx *bolt.Tx, current *bnn.Model, rep *Report) ([]liveAnchor, map[uint64]int, error) {
	var out []liveAnchor
	index := map[uint64]int{}
	err := tx.Bucket(bAnchors).ForEach(func(k, v []byte) error {
		a, err := decodeAnchor(v)
		if err != nil {
			return err
		}
		if a.refs == 0 {
			return nil
		}
		ver := binary.BigEndian.Uint64(k)
		m, err := l.model(tx, ver)
		if err != nil {
			return err
		}
		kl, _, err := certify.KL(current, m)
		if err != nil {
			return fmt.Errorf("anchor %d: %w", ver, err)
		}
		index[ver] = len(out)
		slack := l.opts.Policy.Slack(kl)
		out = append(out, liveAnchor{version: ver, slack: slack, gate: l.opts.Policy.Gate(slack)})
		rep.AnchorKL[ver] = kl
		rep.MaxAnchorKL = math.Max(rep.MaxAnchorKL, kl)
		return nil
	})
	return out, index, err
}

// boundPass walks every CE header once. It allocates only for CEs that change status or need
// Monte-Carlo; everything else is arithmetic on the header bytes in place.
func (l *Ledger) boundPass(ctx context.Context, tx *bolt.Tx, anchors []liveAnchor, index map[uint64]int,
	rep *Report, cnt *counts, now time.Time) ([]StatusChange, []mcItem, error) {
	pol := l.opts.Policy
	var (
		changes []StatusChange
		mc      []mcItem
		lastV   uint64
		lastI   = -1
	)
	c := tx.Bucket(bHeaders).Cursor()
	n := 0
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if n++; n&8191 == 0 {
			if err := ctx.Err(); err != nil {
				return nil, nil, err
			}
		}
		if len(v) != headerSize || v[0] != recordFormat {
			return nil, nil, fmt.Errorf("%w: counterfactual %q: header of %d bytes", ErrCorrupt, k, len(v))
		}
		from := certify.Status(v[hStatus])
		if from == certify.Uncertified {
			cnt.add(from, 1)
			continue
		}
		av := binary.LittleEndian.Uint64(v[hAnchor:])
		if lastI < 0 || av != lastV {
			i, ok := index[av]
			if !ok {
				return nil, nil, fmt.Errorf("%w: counterfactual %q refers to anchor %d, which is not live", ErrCorrupt, k, av)
			}
			lastV, lastI = av, i
		}
		a := &anchors[lastI]
		samples := int(binary.LittleEndian.Uint32(v[hSamples:]))
		lower, ok := a.gate.Check(f64(v, hP1), f64(v, hVar1), f64(v, hEps), samples)
		rep.Checked++
		if lower < rep.MinBound {
			rep.MinBound = lower
		}
		if ok && from == certify.Certified {
			cnt.add(certify.Certified, 1)
			continue
		}
		// Slow path (a change or a Monte-Carlo check): the full bounds for the record.
		b := pol.Evaluate(certify.Certificate{P1: f64(v, hP1), Var1: f64(v, hVar1), Samples: samples,
			Delta: f64(v, hDelta), Epsilon: f64(v, hEps)}, a.slack)
		if ok {
			cnt.add(certify.Certified, 1)
			changes = append(changes, StatusChange{ID: string(k), At: now, From: from, To: certify.Certified,
				PosteriorVersion: rep.PosteriorVersion, KL: a.slack.KL, Bound: b.ProbLower, VarBound: b.VarUpper})
			continue
		}
		mc = append(mc, mcItem{id: string(k), from: from, target: int(binary.LittleEndian.Uint32(v[hTarget:])), b: b, kl: a.slack.KL})
	}
	return changes, mc, nil
}

// Step describes the update a checkpoint records in the KL history.
type Step struct {
	// Version is the posterior version the update produced (or proposed, if rejected).
	Version uint64
	// KL is the step's KL(q_new || q_prev).
	KL float64
	// Outcome is a short word from a bounded set, e.g. promoted, rejected, clipped, failed.
	Outcome string
}

// Checkpoint is everything one increment of the daemon persists, written in one transaction.
type Checkpoint struct {
	// Model becomes the current posterior (nil keeps the current one). Its version must exceed the
	// current version unless it is bit-identical to the current posterior.
	Model *bnn.Model
	// Recertified and Changes are what Recertify returned for Model. They are required when Model
	// replaces the current posterior while CEs hold certificates.
	Recertified *Report
	Changes     []StatusChange
	// Step, if not nil, is appended to the KL history.
	Step *Step
	// Offsets are the next offsets to consume per partition (absolute, replacing the stored ones
	// for the partitions given).
	Offsets map[int]int64
	// Applied is the number of records applied in this increment (added to the total).
	Applied int64
	// Counters are added to the named counters (non-negative deltas).
	Counters map[string]int64
}

func (c *Checkpoint) validate() error {
	for p, off := range c.Offsets {
		if p < 0 || p > math.MaxInt32 || off < 0 {
			return fmt.Errorf("%w: offset %d for partition %d", ErrInvalid, off, p)
		}
	}
	if c.Applied < 0 {
		return fmt.Errorf("%w: applied = %d, want >= 0", ErrInvalid, c.Applied)
	}
	for name, d := range c.Counters {
		if name == "" || len(name) > 64 || d < 0 {
			return fmt.Errorf("%w: counter %q += %d (want a name of 1-64 bytes and a delta >= 0)", ErrInvalid, name, d)
		}
	}
	if s := c.Step; s != nil && (!(s.KL >= 0) || math.IsInf(s.KL, 0) || len(s.Outcome) > 64) {
		return fmt.Errorf("%w: step kl = %v, outcome %q (want a finite kl >= 0 and an outcome of at most 64 bytes)", ErrInvalid, s.KL, s.Outcome)
	}
	if c.Recertified == nil && len(c.Changes) > 0 {
		return fmt.Errorf("%w: %d status changes without the re-certification report they came from", ErrInvalid, len(c.Changes))
	}
	for _, ch := range c.Changes {
		if !ch.From.Valid() || !ch.To.Valid() {
			return fmt.Errorf("%w: status change of %q from %d to %d", ErrInvalid, ch.ID, ch.From, ch.To)
		}
	}
	return nil
}

// Checkpoint writes c in one bbolt transaction (fsynced on commit): the new current posterior,
// the anchors' KL from it, the CE status changes, offsets, counters and the KL history; then
// releases anchors no CE refers to any more. On any error nothing is written. ErrStale means
// the CEs changed since Recertify ran: re-certify and try again (or use Commit).
func (l *Ledger) Checkpoint(c *Checkpoint) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	return l.checkpoint(c)
}

// Commit re-certifies against c.Model (when given) and checkpoints, holding the writer lock
// across both so that the result cannot go stale. It returns the re-certification (zero Report
// when c.Model is nil).
func (l *Ledger) Commit(ctx context.Context, c *Checkpoint, opts RecertifyOptions) (Report, []StatusChange, error) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var (
		rep     Report
		changes []StatusChange
	)
	if c.Model != nil {
		var err error
		if rep, changes, err = l.Recertify(ctx, c.Model, opts); err != nil {
			return Report{}, nil, err
		}
		c.Recertified, c.Changes = &rep, changes
	}
	if err := l.checkpoint(c); err != nil {
		return Report{}, nil, err
	}
	return rep, changes, nil
}

func (l *Ledger) checkpoint(c *Checkpoint) error {
	if err := c.validate(); err != nil {
		return fmt.Errorf("ledger: checkpoint: %w", err)
	}
	var blob []byte
	if c.Model != nil {
		var err error
		if blob, err = encodeModel(c.Model); err != nil {
			return fmt.Errorf("ledger: checkpoint: %w", err)
		}
	}
	now := l.opts.Now().UTC()
	err := l.db.Update(func(tx *bolt.Tx) error {
		old := readCur(tx)
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
		changed, err := l.applyRecertification(tx, c, old, next, now)
		if err != nil {
			return err
		}
		if next != old {
			meta := tx.Bucket(bMeta)
			if err := meta.Put(kCurrent, blob); err != nil {
				return err
			}
			if err := meta.Put(kCurSHA, next.sha[:]); err != nil {
				return err
			}
			if err := meta.Put(kCurVer, u64bytes(next.version)); err != nil {
				return err
			}
		}
		if next != old || changed {
			if err := bumpGen(tx); err != nil {
				return err
			}
		}
		if err := l.gcAnchors(tx, next.version); err != nil {
			return err
		}
		return l.writeProgress(tx, c, now)
	})
	if err != nil {
		return fmt.Errorf("ledger: checkpoint: %w", err)
	}
	return nil
}

// applyRecertification checks that c.Recertified belongs to the posterior that is current after
// this checkpoint and to the CEs as stored, then records the anchors' KL and the status changes.
func (l *Ledger) applyRecertification(tx *bolt.Tx, c *Checkpoint, old, next cur, now time.Time) (bool, error) {
	anchors := tx.Bucket(bAnchors)
	live := 0
	err := anchors.ForEach(func(_, v []byte) error {
		a, err := decodeAnchor(v)
		if a.refs > 0 {
			live++
		}
		return err
	})
	if err != nil {
		return false, err
	}
	r := c.Recertified
	if r == nil {
		if next != old && live > 0 {
			return false, fmt.Errorf("%w: posterior %d replaces %d while %d anchors hold certificates", ErrNotRecertified, next.version, old.version, live)
		}
		return false, nil
	}
	if !next.ok || r.fp != next.sha {
		return false, fmt.Errorf("%w: the report is for posterior version %d, which is not the posterior this checkpoint makes current", ErrNotRecertified, r.PosteriorVersion)
	}
	if g := getU64(tx.Bucket(bMeta), kGen); g != r.Generation {
		return false, fmt.Errorf("%w: counterfactuals changed since re-certification (generation %d, now %d)", ErrStale, r.Generation, g)
	}
	var updates [][2][]byte
	err = anchors.ForEach(func(k, v []byte) error {
		a, err := decodeAnchor(v)
		if err != nil || a.refs == 0 {
			return err
		}
		kl, ok := r.AnchorKL[binary.BigEndian.Uint64(k)]
		if !ok {
			return fmt.Errorf("%w: anchor %d is not in the re-certification", ErrStale, binary.BigEndian.Uint64(k))
		}
		a.kl, a.klVersion = kl, next.version
		updates = append(updates, [2][]byte{append([]byte(nil), k...), a.encode()})
		return nil
	})
	if err != nil {
		return false, err
	}
	for _, u := range updates {
		if err := anchors.Put(u[0], u[1]); err != nil {
			return false, err
		}
	}
	if len(c.Changes) == 0 {
		return false, nil
	}
	cnt := readCounts(tx)
	for _, ch := range c.Changes {
		if ch.At.IsZero() {
			ch.At = now
		}
		ch.PosteriorVersion = next.version
		if err := setStatus(tx, ch, &cnt); err != nil {
			return false, err
		}
	}
	return true, cnt.put(tx)
}

// setStatus applies one status change to a stored CE: header status and time, history entry.
func setStatus(tx *bolt.Tx, ch StatusChange, cnt *counts) error {
	hdrs, bodies := tx.Bucket(bHeaders), tx.Bucket(bBodies)
	key := []byte(ch.ID)
	raw := hdrs.Get(key)
	if raw == nil {
		return fmt.Errorf("%w: counterfactual %q is gone", ErrStale, ch.ID)
	}
	h, err := decodeHeader(raw)
	if err != nil {
		return fmt.Errorf("counterfactual %q: %w", ch.ID, err)
	}
	if h.status != ch.From {
		return fmt.Errorf("%w: counterfactual %q is %v, change expects %v", ErrStale, ch.ID, h.status, ch.From)
	}
	if ch.From == certify.Uncertified || ch.To == certify.Uncertified {
		return fmt.Errorf("%w: counterfactual %q: re-certification cannot move %v to %v", ErrInvalid, ch.ID, ch.From, ch.To)
	}
	bd, err := decodeBody(bodies.Get(key), true)
	if err != nil {
		return fmt.Errorf("counterfactual %q: %w", ch.ID, err)
	}
	h.status, h.updated = ch.To, ch.At.UnixNano()
	bd.history = appendHistory(bd.history, ch)
	cnt.add(ch.From, -1)
	cnt.add(ch.To, 1)
	if err := hdrs.Put(key, h.encode()); err != nil {
		return err
	}
	return bodies.Put(key, bd.encode())
}

// writeProgress stores offsets, counters and the KL history entry of a checkpoint.
func (l *Ledger) writeProgress(tx *bolt.Tx, c *Checkpoint, now time.Time) error {
	offs := tx.Bucket(bOffsets)
	for p, off := range c.Offsets {
		if err := offs.Put(binary.BigEndian.AppendUint32(nil, uint32(p)), u64bytes(uint64(off))); err != nil {
			return err
		}
	}
	meta := tx.Bucket(bMeta)
	if c.Applied > 0 {
		if err := meta.Put(kApplied, u64bytes(getU64(meta, kApplied)+uint64(c.Applied))); err != nil {
			return err
		}
	}
	ctrs := tx.Bucket(bCounters)
	for name, d := range c.Counters {
		if err := ctrs.Put([]byte(name), u64bytes(getU64(ctrs, []byte(name))+uint64(d))); err != nil {
			return err
		}
	}
	if c.Step == nil {
		return nil
	}
	seq := getU64(meta, kKLSeq) + 1
	s := KLStep{Seq: seq, At: now, PosteriorVersion: c.Step.Version, KL: c.Step.KL, Outcome: c.Step.Outcome}
	if c.Recertified != nil {
		s.MaxAnchorKL = c.Recertified.MaxAnchorKL
	}
	hist := tx.Bucket(bKLHistory)
	if err := hist.Put(u64bytes(seq), s.encode()); err != nil {
		return err
	}
	if err := meta.Put(kKLSeq, u64bytes(seq)); err != nil {
		return err
	}
	cur := hist.Cursor()
	for k, _ := cur.First(); k != nil && binary.BigEndian.Uint64(k) <= seq-uint64(min(uint64(l.opts.KLHistory), seq)); k, _ = cur.First() {
		if err := cur.Delete(); err != nil {
			return err
		}
	}
	return nil
}
