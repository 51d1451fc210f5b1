package ledger

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
)

// MaxIDLen bounds a CE's ID.
const MaxIDLen = ident.MaxLen

// validID applies the ids' one rule (ident.Check), which record ids from Kafka follow too.
func validID(id string) error {
	if err := ident.Check(id); err != nil {
		return invalidf("%v", err)
	}
	return nil
}

// newID is time-ordered (so List pages in registration order) with 32 random bits drawn by bits.
func newID(now time.Time, bits func() uint32) string {
	return fmt.Sprintf("%016x%08x", uint64(now.UnixNano()), bits())
}

// validate checks a CE to be registered against the current posterior.
func validate(ce *CE, m *bnn.Model) error {
	if ce == nil {
		return invalidf("nil counterfactual")
	}
	if ce.ID != "" {
		if err := validID(ce.ID); err != nil {
			return err
		}
	}
	d := m.Inputs()
	for _, v := range []struct {
		name string
		x    []float64
	}{{"x", ce.X}, {"x_cf", ce.XCF}} {
		if len(v.x) != d {
			return invalidf("%s has %d features, the posterior takes %d", v.name, len(v.x), d)
		}
		for j, x := range v.x {
			if math.IsNaN(x) || math.IsInf(x, 0) {
				return invalidf("%s[%d] = %v", v.name, j, x)
			}
		}
	}
	if ce.Target < 0 || ce.Target >= m.NumClasses() {
		return invalidf("target = %d, the posterior has %d classes", ce.Target, m.NumClasses())
	}
	if ce.Samples > math.MaxUint32 {
		return invalidf("samples = %d too large", ce.Samples)
	}
	if err := ce.Certificate().Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// Put registers counterfactuals, all or none, in one transaction. Each CE's certificate
// (P1, Var1, Samples) must have been measured under posterior AnchorVersion, which must be the
// current posterior or a live anchor (else ErrUnknownAnchor: measure again under the current
// one). A CE outside its <Delta, Epsilon>-set is stored as uncertified. Otherwise it is judged
// by its bounds at the anchor's KL(q_now || q_anchor): certified when they hold; when they fail,
// at_risk, confirmed at once if the anchor is the current posterior (p1 >= 1 - delta > 1/2 was
// measured under q_now itself) and otherwise left for Confirm to sample. Put runs no
// Monte-Carlo.
//
// Put fills in ID (if empty), Status, ConfirmedVersion, Bound, VarBound, KLFromAnchor,
// CreatedAt (if zero) and UpdatedAt of the given CEs. Registering under the current posterior
// stores its snapshot as an anchor. X and XCF are raw features (the posterior's scaler applies).
func (l *Ledger) Put(ctx context.Context, ces ...*CE) error {
	errs, err := l.put(ctx, ces, true, nil, nil)
	if err != nil {
		return fmt.Errorf("ledger: put: %w", err)
	}
	for _, err := range errs {
		if err != nil {
			return fmt.Errorf("ledger: put: %w", err)
		}
	}
	return nil
}

// PutEach registers counterfactuals in one transaction (one fsync) like Put, but judges each on
// its own: a CE that Put would refuse (ErrInvalid, ErrExists, also for an id given twice in
// ces, ErrUnknownAnchor) is left out with its error in errs[i], and the others are stored
// together. err is for the whole call, and then nothing is stored: a failed write (ErrWrite),
// no posterior, a posterior that moved on meanwhile (ErrStale), a damaged ledger. Registrations
// that arrive together share one durable write this way (group commit) without one bad CE
// refusing the others.
func (l *Ledger) PutEach(ctx context.Context, ces []*CE) (errs []error, err error) {
	return l.PutPast(ctx, ces, nil)
}

// PutPast is PutEach for CEs measured under posteriors that may be neither current nor live
// anchors here: past holds those posteriors by version, and a CE anchored to one of them is
// judged at KL(q_now || past[v]), with past[v] stored as its anchor's snapshot. A replica that
// takes over a partition of CEs measured elsewhere gets the posteriors from the posterior log.
func (l *Ledger) PutPast(ctx context.Context, ces []*CE, past map[uint64]*bnn.Model) (errs []error, err error) {
	return l.putEach(ctx, ces, past, nil)
}

// RequestRef names the request a CE of PutRequests comes from.
type RequestRef struct {
	RID         string // "" for none
	Fingerprint string
}

// DuplicateError refuses a CE of PutRequests whose request id has an outcome already (see
// ApplyShare), or is the request id of a CE stored earlier in the same call: the request was
// applied before, and Outcome says what it decided.
type DuplicateError struct{ Outcome Outcome }

func (e *DuplicateError) Error() string {
	return fmt.Sprintf("request for %q applied before (%s at %s)", e.Outcome.ID, e.Outcome.Result, e.Outcome.At.Format(time.RFC3339Nano))
}

// KeyedExistsError refuses, in PutRequests, a registration with a request id whose CE id holds a
// CE (stored, or kept earlier in the same call). It wraps ErrExists; its outcome
// (OutcomeExists) was stored with the call, as an owner stores it (ApplyShare), so that a retry
// answers the same once the id is free. It is the request's first answer, not a replay of an
// earlier one (a *DuplicateError).
type KeyedExistsError struct{ err error }

func (e *KeyedExistsError) Error() string { return e.err.Error() }
func (e *KeyedExistsError) Unwrap() error { return e.err }

// PutRequests is PutEach for CEs that come with request ids (reqs[i] is ces[i]'s): a CE whose
// request id has an outcome, or is an earlier stored CE's of the same call, is refused with a
// *DuplicateError holding that outcome and not stored, and each CE stored has its outcome
// (OutcomeStored, Partition -1) stored under its request id in the same transaction, for
// Options.RequestWindow; so has each refused because its id holds a CE (OutcomeExists,
// *KeyedExistsError).
func (l *Ledger) PutRequests(ctx context.Context, ces []*CE, reqs []RequestRef) (errs []error, err error) {
	if len(reqs) != len(ces) {
		return nil, fmt.Errorf("ledger: put: %w", invalidf("%d request ids for %d counterfactuals", len(reqs), len(ces)))
	}
	return l.putEach(ctx, ces, nil, reqs)
}

func (l *Ledger) putEach(ctx context.Context, ces []*CE, past map[uint64]*bnn.Model, reqs []RequestRef) (errs []error, err error) {
	errs, err = l.put(ctx, ces, false, past, reqs)
	if err != nil {
		return nil, fmt.Errorf("ledger: put: %w", err)
	}
	for i, e := range errs {
		if e != nil {
			errs[i] = fmt.Errorf("ledger: put: %w", e)
		}
	}
	return errs, nil
}

// put judges ces and stores the accepted ones in one transaction. With all, the first refused
// CE refuses the call (its error in errs, nothing judged after it, nothing stored).
func (l *Ledger) put(ctx context.Context, ces []*CE, all bool, past map[uint64]*bnn.Model, reqs []RequestRef) ([]error, error) {
	if len(ces) == 0 {
		return nil, nil
	}
	now := l.opts.Now().UTC()
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var plan *putPlan
	err := l.view(func(tx *bolt.Tx) (err error) {
		if plan, err = l.judgePut(tx, ces, now, all, past); err != nil {
			return err
		}
		return plan.requests(tx, ces, reqs, now)
	})
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	if all && plan.refused > 0 {
		return plan.errs, nil
	}
	if len(plan.ces) > 0 || len(plan.existed) > 0 {
		if err := l.update(func(tx *bolt.Tx) error { return l.writePut(tx, plan, now) }); err != nil {
			return nil, err
		}
	}
	for i, ce := range plan.ces {
		h := &plan.headers[i]
		ce.Status, ce.ConfirmedVersion = h.status, nil
		if h.confirmed {
			cv := h.cv
			ce.ConfirmedVersion = &cv
		}
	}
	return plan.errs, nil
}

// putPlan is what judgePut decided: the CEs to store with one header each, the error of each
// refused CE (by its index in the CEs given), and the anchors' KLs.
type putPlan struct {
	cur     cur
	ces     []*CE
	headers []header
	errs    []error
	refused int
	all     bool // Put: the first refused CE refuses the call
	kl      map[uint64]float64
	current *bnn.Model
	past    map[uint64]*bnn.Model // posteriors given by PutPast
	snap    map[uint64]bool       // anchors to store from past
	reqs    []RequestRef          // the request of each CE in ces (PutRequests), or none
	existed []keyedOutcome        // the outcomes of requests refused for an id that holds a CE
	states  []*CE                 // the previous owner's state of each CE in ces (ShareOp.State), or none
	stated  bool                  // the CEs' states are written (Options.EncodeState): a share's registrations
}

// keyedOutcome is the outcome of request id rid.
type keyedOutcome struct {
	rid string
	o   Outcome
}

// requests refuses the CEs whose request id has an outcome (*DuplicateError) and keeps the
// request of each CE left, for writePut to store its outcome at now; a request refused because
// its id holds a CE has that outcome stored too (OutcomeExists, *KeyedExistsError), so that a
// retry answers the same once the id is free. A request id given to
// several CEs of the call is one request: the first CE accepted claims it, and each later one
// is refused with a *DuplicateError holding the outcome the first gets, as it would be in a
// later call. reqs[i] is the request of the CE given at index i; p.ces holds those judgePut
// accepted, in the order given.
func (p *putPlan) requests(tx *bolt.Tx, given []*CE, reqs []RequestRef, now time.Time) error {
	if reqs == nil {
		return nil
	}
	var (
		ces     []*CE
		headers []header
		j       int                    // index in p.ces
		claimed = map[string]Outcome{} // request id -> the outcome of the CE of the call that claimed it
		held    = map[string]bool{}    // ids of the CEs of the call kept so far
	)
	// holds reports whether id holds a CE: a stored one, or one of the call kept before.
	holds := func(id string) bool { return held[id] || tx.Bucket(bHeaders).Get([]byte(id)) != nil }
	// outcome is the request's outcome: the one stored, or the one a CE of this call claimed.
	outcome := func(rid string) (Outcome, bool, error) {
		if o, ok := claimed[rid]; ok {
			return o, true, nil
		}
		return readOutcome(tx, rid)
	}
	for i, ref := range reqs {
		if p.errs[i] != nil {
			if ref.RID != "" && errors.Is(p.errs[i], ErrExists) { // stored by this very request?
				o, ok, err := outcome(ref.RID)
				if err != nil {
					return err
				}
				if ok {
					p.errs[i] = &DuplicateError{Outcome: o}
					continue
				}
				if !holds(given[i].ID) {
					continue // an id given to an earlier CE of the call that was refused too: nothing to remember
				}
				o = Outcome{Result: OutcomeExists, ID: given[i].ID, Fingerprint: ref.Fingerprint, Partition: -1, At: now}
				claimed[ref.RID] = o
				p.existed = append(p.existed, keyedOutcome{ref.RID, o})
				p.errs[i] = &KeyedExistsError{p.errs[i]}
			}
			continue
		}
		ce, h := p.ces[j], p.headers[j]
		j++
		if ref.RID != "" {
			o, ok, err := outcome(ref.RID)
			if err != nil {
				return err
			}
			if ok {
				p.refuse(i, &DuplicateError{Outcome: o})
				continue
			}
			claimed[ref.RID] = storedOutcome(ce, &h, ref, now)
		}
		ces, headers, p.reqs = append(ces, ce), append(headers, h), append(p.reqs, ref)
		held[ce.ID] = true
	}
	p.ces, p.headers = ces, headers
	return nil
}

// storedOutcome is the outcome of the registration ref that stores ce with header h at now.
func storedOutcome(ce *CE, h *header, ref RequestRef, now time.Time) Outcome {
	return Outcome{Result: OutcomeStored, ID: ce.ID, Status: h.status.String(), Tag: ce.Tag(), Fingerprint: ref.Fingerprint, Partition: -1, At: now}
}

// name names CE i of a call in an error: by its index too when the call is all or none (Put),
// by its id alone when each CE has its own error (PutEach).
func (p *putPlan) name(i int, id string) string {
	if p.all {
		return fmt.Sprintf("%d (id %q)", i, id)
	}
	return fmt.Sprintf("%q", id)
}

// refuse records that CE i is not stored, and why.
func (p *putPlan) refuse(i int, err error) {
	p.errs[i] = err
	p.refused++
}

// judgePut validates the CEs and judges each at its anchor's KL, filling in the derived fields
// of those it accepts. With all, it stops at the first refused CE.
func (l *Ledger) judgePut(tx *bolt.Tx, ces []*CE, now time.Time, all bool, past map[uint64]*bnn.Model) (*putPlan, error) {
	c, err := readCur(tx)
	if err != nil {
		return nil, err
	}
	if !c.ok {
		return nil, ErrNoPosterior
	}
	current, err := l.model(tx, c.version)
	if err != nil {
		return nil, err
	}
	p := &putPlan{cur: c, ces: make([]*CE, 0, len(ces)), headers: make([]header, 0, len(ces)), errs: make([]error, len(ces)),
		all: all, kl: map[uint64]float64{}, current: current, past: past, snap: map[uint64]bool{}}
	seen := make(map[string]bool, len(ces))
	hdrs := tx.Bucket(bHeaders)
	for i, ce := range ces {
		if all && p.refused > 0 {
			break
		}
		if err := validate(ce, current); err != nil {
			p.refuse(i, fmt.Errorf("counterfactual %s: %w", p.name(i, idOf(ce)), err))
			continue
		}
		if ce.ID == "" {
			// The CEs of one call share now, and two draws of 32 bits agree with a chance of
			// 2^-32 per pair (a call of 200 CEs: 5e-6): an id taken is drawn again, so that
			// an id the ledger chose is never refused as existing.
			for ce.ID = newID(now, l.idBits); seen[ce.ID] || hdrs.Get([]byte(ce.ID)) != nil; ce.ID = newID(now, l.idBits) {
			}
		}
		if seen[ce.ID] || hdrs.Get([]byte(ce.ID)) != nil {
			p.refuse(i, fmt.Errorf("counterfactual %s: %w", p.name(i, ce.ID), ErrExists))
			continue
		}
		h := header{status: certify.Uncertified, target: ce.Target, anchor: ce.AnchorVersion, p1: ce.P1, var1: ce.Var1,
			delta: ce.Delta, epsilon: ce.Epsilon, samples: ce.Samples, updated: now.UnixNano()}
		var b certify.Bounds
		kl := 0.0
		if cert := ce.Certificate(); l.admits(cert) {
			var err error
			if kl, err = l.putAnchorKL(tx, p, ce.AnchorVersion); errors.Is(err, ErrUnknownAnchor) {
				p.refuse(i, fmt.Errorf("counterfactual %q: %w", ce.ID, err))
				continue
			} else if err != nil {
				return nil, fmt.Errorf("counterfactual %q: %w", ce.ID, err)
			}
			b = l.opts.Policy.Bounds(cert, kl)
			h.status = certify.Rejudge(certify.Standing{}, b.Certified).Status // a new CE
			if h.status != certify.Certified && ce.AnchorVersion == c.version {
				// Measured under the current posterior: its p1 is the verdict's evidence.
				h.status = certify.Observed(ce.P1, ce.Target, ce.Target)
				h.confirm(c.version, nil, 0)
			}
		}
		seen[ce.ID] = true
		if ce.CreatedAt.IsZero() {
			ce.CreatedAt = now
		}
		ce.UpdatedAt, ce.History = now, nil
		ce.Bound, ce.VarBound, ce.KLFromAnchor = b.ProbLower, b.VarUpper, kl
		p.ces, p.headers = append(p.ces, ce), append(p.headers, h)
	}
	return p, nil
}

// admits says whether a new CE with certificate cert is certified (Options.AdmitByEvidence).
func (l *Ledger) admits(cert certify.Certificate) bool {
	if l.opts.AdmitByEvidence {
		return cert.Admits(l.opts.VerdictAlpha)
	}
	return cert.InSet()
}

func idOf(ce *CE) string {
	if ce == nil {
		return ""
	}
	return ce.ID
}

// putAnchorKL is KL(q_now || q_anchor) for a CE registered under anchor v: 0 for the current
// posterior, the anchor's stored KL otherwise (the one its other CEs are judged at).
func (l *Ledger) putAnchorKL(tx *bolt.Tx, p *putPlan, v uint64) (float64, error) {
	if kl, ok := p.kl[v]; ok {
		return kl, nil
	}
	kl := 0.0
	if v != p.cur.version {
		a, ok, err := readAnchor(tx, v)
		if err != nil {
			return 0, err
		}
		if !ok {
			m, given := p.past[v]
			if !given || m.Version != v {
				return 0, fmt.Errorf("%w: posterior version %d is neither current nor a live anchor", ErrUnknownAnchor, v)
			}
			kl, _, err := certify.KL(p.current, m)
			if err != nil {
				return 0, fmt.Errorf("%w: posterior version %d: %w", ErrInvalid, v, err)
			}
			p.kl[v], p.snap[v] = kl, true
			return kl, nil
		}
		if a.klVersion != p.cur.version {
			return 0, corruptf("anchor %d holds KL from posterior version %d, current is %d", v, a.klVersion, p.cur.version)
		}
		kl = a.kl
	}
	p.kl[v] = kl
	return kl, nil
}

// writePut stores the judged CEs.
func (l *Ledger) writePut(tx *bolt.Tx, p *putPlan, now time.Time) error {
	if c, err := readCur(tx); err != nil || c != p.cur {
		if err == nil {
			err = ErrStale
		}
		return err
	}
	w, err := l.newWriteTx(tx, now)
	if err != nil {
		return err
	}
	hdrs, bodies := tx.Bucket(bHeaders), tx.Bucket(bBodies)
	hdrs.FillPercent, bodies.FillPercent = 0.9, 0.9 // IDs are mostly appended in order
	// The anchors first: a CE's count (lapsed or not) is judged at its anchor's stored KL.
	refs := map[uint64]int64{}
	certs := map[uint64][]certify.Certificate{} // under each anchor, for the KL histories of snapshots
	for i := range p.headers {
		if h := &p.headers[i]; h.status != certify.Uncertified {
			refs[h.anchor]++
			certs[h.anchor] = append(certs[h.anchor], h.certificate())
		}
	}
	for _, v := range slices.Sorted(maps.Keys(refs)) {
		n := refs[v]
		if p.snap[v] {
			if err := l.refSnapshot(tx, p.cur, v, p.kl[v], p.past[v], now); err != nil {
				return err
			}
			hist, err := pastAnchorKL(p.past, v, p.cur.version, p.kl[v], l.opts.Policy, certs[v], false)
			if err != nil {
				return fmt.Errorf("%w: %w", ErrInvalid, err)
			}
			if err := writeAnchorKL(tx, v, p.cur.version, hist); err != nil {
				return err
			}
			n--
		}
		if n == 0 {
			continue
		}
		if err := l.ref(tx, p.cur, v, n, 0, now); err != nil {
			return err
		}
	}
	for i, ce := range p.ces {
		id := []byte(ce.ID)
		if hdrs.Get(id) != nil {
			return fmt.Errorf("%w: %q", ErrExists, ce.ID)
		}
		h := &p.headers[i]
		if err := w.putHeader(id, nil, h); err != nil {
			return err
		}
		bd := body{created: ce.CreatedAt.UnixNano(), x: ce.X, xcf: ce.XCF}
		var state *CE
		if p.states != nil {
			state = p.states[i]
		}
		if state != nil {
			bd.history = state.History
		}
		if err := putSealed(bodies, id, bd.encode()); err != nil {
			return err
		}
		if p.stated {
			w.states.add(id) // the topic's last record of the CE is then this owner's
		}
		if state != nil && h.status != state.Status {
			// Judged here at its anchor's KL, the CE's status is not the one its previous owner left.
			kl := p.kl[h.anchor]
			b := l.opts.Policy.Bounds(h.certificate(), kl)
			if err := w.recordChange(id, StatusChange{From: state.Status, To: h.status, PosteriorVersion: p.cur.version,
				KL: kl, Bound: b.ProbLower, VarBound: b.VarUpper}); err != nil {
				return err
			}
		}
		if q := tx.Bucket(bQuarantine); q != nil && q.Get(id) != nil { // registered again
			if err := q.Delete(id); err != nil {
				return err
			}
			// The quarantined CE is replaced, as if deleted: its reissue goes with it.
			if err := dropReissue(tx, id); err != nil {
				return err
			}
		}
		if state != nil && state.ReissuePendingSince != nil {
			// It waits for a reissue since that version, as its previous owner left it: the new
			// owner reissues it, or, with explain.reissue off, publishes why not. A status change
			// of this transaction that makes it wait writes the entry again (markReissues runs after).
			if err := w.putReissues([]PendingReissue{{ID: ce.ID, Version: *state.ReissuePendingSince}}); err != nil {
				return err
			}
		}
		if p.reqs != nil && p.reqs[i].RID != "" {
			if err := putOutcome(tx, p.reqs[i].RID, storedOutcome(ce, h, p.reqs[i], now)); err != nil {
				return err
			}
		}
	}
	for _, e := range p.existed {
		if err := putOutcome(tx, e.rid, e.o); err != nil {
			return err
		}
	}
	if p.reqs != nil || p.existed != nil {
		if err := l.pruneOutcomes(tx, now); err != nil {
			return err
		}
	}
	return w.finish()
}

// ref adds n (may be negative) references to anchor v, creating its snapshot from the current
// posterior if v is current and not yet an anchor. kl is KL(q_now || q_v), recorded for a new
// anchor (0 for the current posterior).
func (l *Ledger) ref(tx *bolt.Tx, c cur, v uint64, n int64, kl float64, now time.Time) error {
	a, ok, err := readAnchor(tx, v)
	if err != nil {
		return err
	}
	if !ok {
		if n < 0 || v != c.version {
			return corruptf("anchor %d has no record", v)
		}
		blob, err := getSealed(tx.Bucket(bMeta), kCurrent, "current posterior")
		if err != nil {
			return err
		}
		if err := putSealed(tx.Bucket(bAnchorModels), u64bytes(v), blob); err != nil {
			return err
		}
		a = anchorMeta{kl: kl, klVersion: c.version, created: now.UnixNano()}
	}
	if int64(a.refs)+n < 0 {
		return corruptf("anchor %d would have %d references", v, int64(a.refs)+n)
	}
	a.refs = uint64(int64(a.refs) + n)
	return putAnchor(tx, v, a)
}

// refSnapshot adds a reference to anchor v. When v is neither stored as an anchor nor the current
// posterior (ingestion replaced it while CEs were being measured under it), m, the posterior v
// itself, is stored as its snapshot with kl = KL(q_now || m).
func (l *Ledger) refSnapshot(tx *bolt.Tx, now cur, v uint64, kl float64, m *bnn.Model, at time.Time) error {
	if _, ok, err := readAnchor(tx, v); err != nil || ok || v == now.version {
		if err != nil {
			return err
		}
		return l.ref(tx, now, v, 1, 0, at)
	}
	blob, err := encodeModel(m)
	if err != nil {
		return err
	}
	if err := putSealed(tx.Bucket(bAnchorModels), u64bytes(v), blob); err != nil {
		return err
	}
	return putAnchor(tx, v, anchorMeta{refs: 1, kl: kl, klVersion: now.version, created: at.UnixNano()})
}

// gcAnchors deletes every anchor no CE refers to, except the current posterior's.
func (l *Ledger) gcAnchors(tx *bolt.Tx, currentVersion uint64) error {
	var dead []uint64
	err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		if a.refs == 0 && v != currentVersion {
			dead = append(dead, v)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, v := range dead {
		if err := tx.Bucket(bAnchors).Delete(u64bytes(v)); err != nil {
			return err
		}
		if err := tx.Bucket(bAnchorModels).Delete(u64bytes(v)); err != nil {
			return err
		}
		if err := dropAnchorKL(tx, v); err != nil {
			return err
		}
		l.log.Debug("anchor posterior released", "version", v)
	}
	return nil
}

// readHeader reads and decodes the header of id (ok = false when not stored).
func readHeader(tx *bolt.Tx, id []byte) (header, bool, error) {
	p, err := getSealed(tx.Bucket(bHeaders), id, "header")
	if err != nil || p == nil {
		return header{}, false, inRecord(err, "counterfactual %q", id)
	}
	h, err := decodeHeader(p)
	return h, true, inRecord(err, "counterfactual %q: header", id)
}

// Delete removes a CE and releases its anchor reference, or drops the damaged record of a
// quarantined CE or of one found damaged since Open (deleteOne); either way its state is a
// tombstone (Options.EncodeState).
func (l *Ledger) Delete(id string) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var found deletedDamaged
	err := l.update(func(tx *bolt.Tx) error {
		found = deletedDamaged{}
		res, _, err := l.deleteOne(tx, id, nil, found)
		if err == nil && res == OutcomeAbsent {
			err = fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("ledger: delete: %w", err)
	}
	l.reportDamaged(found)
	return nil
}

// load decodes the CE stored under id, with its derived bounds from the anchor's KL.
func (l *Ledger) load(tx *bolt.Tx, id, rawHdr []byte) (*CE, error) {
	return l.loadWith(tx, id, rawHdr, nil)
}

// loadWith is load for a read the API answers; due, when not nil, keeps the anchors' KL
// histories and the verdict versions' slacks read for the CEs of one transaction (a list), so
// that each is computed once, and gives a verdict that stopped carrying its VerdictPendingSince
// from the posteriors Options.Past holds.
func (l *Ledger) loadWith(tx *bolt.Tx, id, rawHdr []byte, due *dueReads) (*CE, error) {
	ce, h, err := loadStored(tx, id, rawHdr)
	if err != nil {
		return nil, err
	}
	var a anchorMeta
	if h.status != certify.Uncertified {
		var ok bool
		if a, ok, err = readAnchor(tx, h.anchor); err != nil {
			return nil, err
		}
		if !ok {
			return nil, corruptf("counterfactual %q refers to anchor %d, which is not stored", id, h.anchor)
		}
		b := l.opts.Policy.Bounds(h.certificate(), a.kl)
		ce.Bound, ce.VarBound, ce.KLFromAnchor = b.ProbLower, b.VarUpper, a.kl
	}
	d, err := l.decide(tx, &h, nil)
	if err != nil {
		return nil, inRecord(err, "counterfactual %q: verdict", id)
	}
	ce.Decided, ce.RenewalPending, ce.VerdictPending = d.decided, d.renewalPending, d.verdictPending
	var reads *klReads
	if due != nil {
		reads = &due.reads
	}
	if d.renewalPending {
		if since, ok := failingSince(tx, l.opts.Policy, h.certificate(), h.anchor, a, reads); ok {
			ce.RenewalPendingSince = &since
		}
	}
	if d.verdictPending && due != nil {
		if since, ok := due.stoppedAt(&h); ok {
			ce.VerdictPendingSince = &since
		}
	}
	return ce, nil
}

// loadStored decodes what is stored of the CE under id: its record without the bounds and the
// decision derived from the current posterior.
func loadStored(tx *bolt.Tx, id, rawHdr []byte) (*CE, header, error) {
	p, ok := unseal(id, rawHdr)
	if !ok {
		return nil, header{}, corruptf("counterfactual %q: header checksum mismatch", id)
	}
	h, err := decodeHeader(p)
	if err != nil {
		return nil, h, inRecord(err, "counterfactual %q: header", id)
	}
	braw, err := getSealed(tx.Bucket(bBodies), id, "body")
	if err == nil && braw == nil {
		err = corruptf("body is missing")
	}
	if err != nil {
		return nil, h, inRecord(err, "counterfactual %q", id)
	}
	bd, err := decodeBody(braw, true)
	if err != nil {
		return nil, h, inRecord(err, "counterfactual %q", id)
	}
	ce := &CE{ID: string(id), X: bd.x, XCF: bd.xcf, Target: h.target, AnchorVersion: h.anchor, P1: h.p1, Var1: h.var1,
		Samples: h.samples, Delta: h.delta, Epsilon: h.epsilon, Status: h.status,
		CreatedAt: time.Unix(0, bd.created).UTC(), UpdatedAt: time.Unix(0, h.updated).UTC(), History: bd.history,
	}
	if h.confirmed {
		cv := h.cv
		ce.ConfirmedVersion = &cv
		if h.carry {
			b := float64(h.cbound)
			ce.VerdictBound = &b
		}
	}
	for i := range ce.History {
		ce.History[i].ID = ce.ID
		ce.History[i].Renewal = ce.History[i].From == certify.Certified && ce.History[i].To == certify.Certified
	}
	if b := tx.Bucket(bReissue); b != nil {
		if v := b.Get(id); v != nil {
			since := reissueVersion(id, v)
			ce.ReissuePendingSince = &since
		}
	}
	return ce, h, nil
}

// decision is what a CE's status says it knows (CE.Decided, CE.RenewalPending,
// CE.VerdictPending).
type decision struct{ decided, renewalPending, verdictPending bool }

// decide is the one rule for decision, used by the CEs the ledger returns, by the status changes
// it records (as of the transaction that writes them) and by the counts of decided statuses.
// memo, when not nil, keeps verdict slacks computed inside a write transaction, which must not
// enter the ledger's cache (the transaction may not commit).
func (l *Ledger) decide(tx *bolt.Tx, h *header, memo map[uint64]slackMemo) (decision, error) {
	var d decision
	switch h.status {
	case certify.Certified:
		lapsed, err := l.lapsed(tx, h)
		if err != nil {
			return d, err
		}
		d.decided, d.renewalPending = !lapsed, lapsed
	case certify.AtRisk, certify.Invalidated:
		held, err := l.verdictHolds(tx, h, memo)
		if err != nil {
			return d, err
		}
		d.decided, d.verdictPending = held, !held
	}
	return d, nil
}

// slackMemo is one verdict slack of a write transaction (known: the posterior is stored).
type slackMemo struct {
	s     certify.Slack
	known bool
}

// verdictHolds says whether the CE's verdict was decided by evidence and carries to the current
// posterior: measured under it, or under one whose KL from it the verdict's bound absorbs.
func (l *Ledger) verdictHolds(tx *bolt.Tx, h *header, memo map[uint64]slackMemo) (bool, error) {
	if !h.confirmed || !h.carry {
		return false, nil
	}
	now, err := readCur(tx)
	if err != nil || !now.ok {
		return false, err
	}
	if h.cv == now.version {
		return true, nil
	}
	var (
		s     certify.Slack
		known bool
	)
	if memo == nil {
		s, known, err = l.verdictSlack(tx, now, h.cv)
	} else if m, ok := memo[h.cv]; ok {
		s, known = m.s, m.known
	} else {
		s, known, err = l.verdictSlackUncached(tx, now, h.cv)
		memo[h.cv] = slackMemo{s, known}
	}
	if err != nil || !known {
		return false, err
	}
	return h.carries(s), nil
}

// Get returns the CE stored under id, or ErrNotFound.
func (l *Ledger) Get(id string) (*CE, error) {
	var ce *CE
	err := l.view(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bHeaders).Get([]byte(id))
		if why, q := quarantineReason(tx, []byte(id)); raw == nil && q {
			return fmt.Errorf("%w: %q (%s): register it again, or DELETE it to drop the damaged record", ErrQuarantined, id, why)
		}
		if raw == nil {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		if ce, err = l.loadWith(tx, []byte(id), raw, l.newDueReads(tx, c, l.opts.Past)); err == nil {
			ce.PosteriorVersion = c.version
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: get: %w", err)
	}
	return ce, nil
}

// Page is List for one page of an API's list: up to limit CEs (as List takes it), and whether
// any CE follows them (read as one more CE, so that a page that ends exactly at the last CE is
// the last page).
func (l *Ledger) Page(status certify.Status, limit int, after string) (ces []*CE, more bool, err error) {
	limit = listLimit(limit)
	ces, err = l.list(status, limit+1, after)
	if err != nil || len(ces) <= limit {
		return ces, false, err
	}
	return ces[:limit], true, nil
}

// List pages through CEs in ID order: up to limit (default 100, at most 10000) CEs with IDs
// after `after` ("" = from the start) and, if status is not 0, that status. The next page
// starts after the last ID returned.
func (l *Ledger) List(status certify.Status, limit int, after string) ([]*CE, error) {
	return l.list(status, listLimit(limit), after)
}

// listLimit is List's page size for limit: 100 when limit is not positive, at most 10000.
func listLimit(limit int) int {
	if limit <= 0 {
		return 100
	}
	return min(limit, 10000)
}

// list is List for a page size already set (listLimit; Page reads one more).
func (l *Ledger) list(status certify.Status, limit int, after string) ([]*CE, error) {
	if status != 0 && !status.Valid() {
		return nil, fmt.Errorf("ledger: list: %w: status %d", ErrInvalid, status)
	}
	var out []*CE
	err := l.view(func(tx *bolt.Tx) error {
		now, err := readCur(tx)
		if err != nil {
			return err
		}
		c := tx.Bucket(bHeaders).Cursor()
		due := l.newDueReads(tx, now, l.opts.Past)
		k, v := c.First()
		if after != "" {
			k, v = c.Seek([]byte(after))
			if k != nil && string(k) == after {
				k, v = c.Next()
			}
		}
		for ; k != nil && len(out) < limit; k, v = c.Next() {
			p, ok := unseal(k, v)
			if !ok {
				l.noteDamaged(k, corruptf("counterfactual %q: header checksum mismatch", k))
				continue
			}
			if status != 0 && (len(p) < 2 || certify.Status(p[hStatus]) != status) {
				continue
			}
			ce, err := l.loadWith(tx, k, v, due)
			if errors.Is(err, ErrCorrupt) {
				l.noteDamaged(k, err) // one damaged record does not take the list down
				continue
			}
			if err != nil {
				return err
			}
			ce.PosteriorVersion = now.version
			out = append(out, ce)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: list: %w", err)
	}
	return out, nil
}

// NewID returns a fresh CE id of the form Put gives a CE without one: time-ordered, with 32
// random bits. A replica names a CE before it sends its registration to the CE's owner.
func NewID() string { return newID(time.Now().UTC(), rand.Uint32) }
