package ledger

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Requests and their outcomes. A registration or deletion that carries a request id (RID) is
// applied once: its outcome is stored under the RID in the transaction that applies it, and a
// request whose RID has an outcome is not applied again, however often it arrives (a producer's
// retry on the CE topic, a client's retry with its Idempotency-Key). The outcome is what the
// request's answer says: what the ledger decided when it applied the request, in its order.
//
// The buckets are optional, like offset_marks: a ledger written before outcomes existed has
// none, and the first request that carries an RID creates them.
//
//	requests      RID -> the outcome (JSON), sealed
//	requests_at   applied-at (u64 unix ns) | RID -> empty: outcomes in the order they expire
var (
	bRequests   = []byte("requests")
	bRequestsAt = []byte("requests_at")
)

// DefaultRequestWindow is how long an outcome is kept when Options.RequestWindow is 0.
const DefaultRequestWindow = 24 * time.Hour

// maxPrune bounds the expired outcomes one transaction deletes.
const maxPrune = 1000

// Outcome results.
const (
	// OutcomeStored: the registration stored its CE.
	OutcomeStored = "stored"
	// OutcomeSame: a CE with the same x, x_cf and target was stored under the id already.
	OutcomeSame = "same"
	// OutcomeExists: another CE was stored under the id (on a single daemon, PutRequests: any CE,
	// or one kept earlier in the same call); nothing was stored.
	OutcomeExists = "exists"
	// OutcomeRefused: the ledger refused the CE (Detail says why); nothing was stored.
	OutcomeRefused = "refused"
	// OutcomeDeleted: the deletion deleted the CE.
	OutcomeDeleted = "deleted"
	// OutcomeAbsent: the deletion found no CE under the id.
	OutcomeAbsent = "absent"
	// OutcomeMismatch: the deletion named the registrations it deletes (ShareOp.IfMatch) and
	// the CE stored under the id is none of them (Detail says which it is); nothing was deleted.
	OutcomeMismatch = "mismatch"
)

// Outcome is what the ledger decided for one request, stored under its RID.
type Outcome struct {
	// Result is one of the Outcome* constants.
	Result string `json:"result"`
	// ID is the CE's id.
	ID string `json:"id"`
	// Status is the status the CE was stored with (OutcomeStored).
	Status string `json:"status,omitempty"`
	// Tag is the tag (CE.Tag) of the CE the registration stored (OutcomeStored) or found stored
	// (OutcomeSame): a CE stored under the id later, deleted and registered again with the same
	// x, x_cf and target, has another. Empty in an outcome stored by a build without it.
	Tag string `json:"tag,omitempty"`
	// Detail says why a CE was refused, or that a deleted CE's record was damaged on disk.
	Detail string `json:"detail,omitempty"`
	// Fingerprint is the request's (an Idempotency-Key's request hash), "" when it has none.
	Fingerprint string `json:"fingerprint,omitempty"`
	// Partition and Offset are where the request was read on the CE topic; Partition is -1
	// for a single daemon's registration.
	Partition int   `json:"partition"`
	Offset    int64 `json:"offset"`
	// At is when the ledger applied the request.
	At time.Time `json:"at"`
	// Duplicate is set on an outcome returned for a request whose RID was applied before: the
	// request was not applied again. Not stored.
	Duplicate bool `json:"-"`
	// State says, for a registration given its previous owner's state (ShareOp.State), what
	// became of it: StateRestored, or why it was not used (the registration was judged as
	// read). Not stored.
	State string `json:"-"`
}

// ShareOp is one request of a CE-topic partition as an owner applies it (ApplyShare).
type ShareOp struct {
	// RID identifies the request ("" for none: applied each time it is read).
	RID string
	// Fingerprint is the request's, stored with its outcome.
	Fingerprint string
	// Offset is the request's offset in its partition.
	Offset int64
	// ID is the CE's id.
	ID string
	// CE is a registration's CE; nil for a deletion.
	CE *CE
	// Refuse, when set, refuses the registration with this detail without judging it (its CE
	// could not be decoded).
	Refuse string
	// IfMatch is, for a deletion, the tags (CE.Tag, or AnyTag) of the registrations it may
	// delete: a CE stored under the id with another tag is kept (OutcomeMismatch). Nil: the
	// deletion deletes whatever the id holds.
	IfMatch []string
	// State is, for a registration, the CE as a previous owner of its partition left it (read
	// from the CE state topic), nil for none: when it is a state of the registration's CE that
	// holds (see the CE states above), the CE is stored with it; else as read. Its anchor
	// version must be current, a live anchor or in past (else *AnchorsNeededError names it).
	State *CE
}

// AnchorsNeededError is returned by ApplyShare when registrations were measured under
// posteriors that are neither current nor live anchors here nor given: nothing was written.
// The caller gets those posteriors (or measures the CEs again under the current one) and calls
// ApplyShare again. It matches ErrUnknownAnchor.
type AnchorsNeededError struct {
	Ops      []int    // indexes of the operations
	Versions []uint64 // their anchor versions, sorted, once each
}

func (e *AnchorsNeededError) Error() string {
	return fmt.Sprintf("%v: %d registrations measured under posterior versions %v", ErrUnknownAnchor, len(e.Ops), e.Versions)
}

// Is makes errors.Is(err, ErrUnknownAnchor) hold.
func (e *AnchorsNeededError) Is(target error) bool { return target == ErrUnknownAnchor }

// ApplyShare applies the requests of CE-topic partition p, in order, and stores next as p's
// offset (ShareOffset), with w when it is not nil (a record before next: ShareWitness; one
// stored before stays while it is before next), all in one transaction: a crash leaves either none of them applied and
// the old offset, or all of them and next. A request whose RID has an outcome is not applied
// again (outs[i].Duplicate); every other request with an RID gets its outcome stored. A
// registration of an id that holds a CE is not stored (OutcomeSame or OutcomeExists); a deletion
// of an id that holds none changes nothing (OutcomeAbsent). past holds posteriors by version for
// CEs measured under versions that are neither current nor live anchors (PutPast); when some are
// missing, ApplyShare writes nothing and returns an *AnchorsNeededError. Outcomes older than
// Options.RequestWindow are deleted, a bounded number per call.
func (l *Ledger) ApplyShare(p int, ops []ShareOp, next int64, w *ShareWitness, past map[uint64]*bnn.Model) ([]Outcome, error) {
	if p < 0 || next < 0 {
		return nil, fmt.Errorf("ledger: apply share: %w", invalidf("partition %d offset %d", p, next))
	}
	now := l.opts.Now().UTC()
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var (
		outs  []Outcome
		found deletedDamaged
	)
	err := l.update(func(tx *bolt.Tx) error {
		outs, found = make([]Outcome, len(ops)), deletedDamaged{}
		need := &AnchorsNeededError{}
		for i, op := range ops {
			o, dup, err := l.applyOp(tx, p, op, now, past, found)
			var unknown *unknownAnchorError
			if errors.As(err, &unknown) {
				need.Ops = append(need.Ops, i)
				if !slices.Contains(need.Versions, unknown.version) {
					need.Versions = append(need.Versions, unknown.version)
				}
				continue
			}
			if err != nil {
				return err
			}
			if !dup && op.RID != "" {
				if err := putOutcome(tx, op.RID, o); err != nil {
					return err
				}
			}
			o.Duplicate = dup
			outs[i] = o
		}
		if len(need.Ops) > 0 {
			slices.Sort(need.Versions)
			return need // bbolt rolls the transaction back
		}
		if err := putShareOffset(tx, p, next, w); err != nil {
			return err
		}
		return l.pruneOutcomes(tx, now)
	})
	var need *AnchorsNeededError
	if errors.As(err, &need) {
		return nil, need
	}
	if err != nil {
		return nil, fmt.Errorf("ledger: apply share of partition %d: %w", p, err)
	}
	l.reportDamaged(found)
	return outs, nil
}

// applyOp applies one request in tx: its stored outcome when its RID has one (dup), else what
// applying it decided. found gets the CEs a deletion found damaged and quarantined (deleteOne).
func (l *Ledger) applyOp(tx *bolt.Tx, p int, op ShareOp, now time.Time, past map[uint64]*bnn.Model, found deletedDamaged) (o Outcome, dup bool, err error) {
	if op.RID != "" {
		if o, ok, err := readOutcome(tx, op.RID); err != nil || ok {
			return o, ok, err
		}
	}
	o = Outcome{ID: op.ID, Fingerprint: op.Fingerprint, Partition: p, Offset: op.Offset, At: now}
	switch {
	case op.Refuse != "":
		o.Result, o.Detail = OutcomeRefused, op.Refuse
	case op.CE == nil:
		o.Result, o.Detail, err = l.deleteOne(tx, op.ID, op.IfMatch, found)
	default:
		err = l.registerOne(tx, op.CE, op.State, now, past, &o)
		if d, ok := found[op.ID]; ok && err == nil { // swept into the quarantine by a deletion before it
			if _, q := quarantineReason(tx, []byte(op.ID)); !q {
				d.replaced = true
				found[op.ID] = d
			}
		}
	}
	return o, false, err
}

// unknownAnchorError is registerOne's ErrUnknownAnchor for the anchor version it lacks.
type unknownAnchorError struct {
	version uint64
	err     error
}

func (e *unknownAnchorError) Error() string { return e.err.Error() }
func (e *unknownAnchorError) Unwrap() error { return e.err }

// deleteOne deletes CE id in tx: OutcomeDeleted, or OutcomeAbsent when nothing is stored under
// id. A quarantined CE's damaged record is dropped. A CE whose header is found damaged here
// (since Open) is deleted too: it is quarantined as Open would (quarantineDamaged, with any
// other damaged header, which found gets) and its record dropped; detail then says so. With
// ifMatch (not nil), only a CE whose tag (CE.Tag) it names is deleted; another, or one whose
// record is damaged (its tag unknown) unless ifMatch holds AnyTag, is kept: OutcomeMismatch.
func (l *Ledger) deleteOne(tx *bolt.Tx, id string, ifMatch []string, found deletedDamaged) (result, detail string, err error) {
	key := []byte(id)
	ok, err := l.readHeaderForDeletion(tx, key, found)
	if err != nil {
		return "", "", err
	}
	_, q := quarantineReason(tx, key)
	if !ok && !q {
		return OutcomeAbsent, "", nil
	}
	if ifMatch != nil && !slices.Contains(ifMatch, AnyTag) {
		var ce *CE
		if ok {
			ce, _, err = loadStored(tx, key, tx.Bucket(bHeaders).Get(key))
		}
		switch {
		case !ok || err != nil:
			return OutcomeMismatch, fmt.Sprintf("the record of %q is damaged on disk, so its registration's tag cannot be read: "+
				"nothing was deleted; delete it without If-Match (or with If-Match: *)", id), nil
		case !slices.Contains(ifMatch, ce.Tag()):
			return OutcomeMismatch, fmt.Sprintf("%q holds the registration tagged %q, which the deletion does not name "+
				"(registered at %s): nothing was deleted", id, ce.Tag(), ce.CreatedAt.Format(time.RFC3339Nano)), nil
		}
	}
	if err := l.deleteStored(tx, [][]byte{key}, true); err != nil {
		return "", "", err
	}
	if d, ok := found[id]; ok { // found damaged by this transaction
		d.deleted = true
		found[id] = d
		detail = fmt.Sprintf("the counterfactual's record was damaged on disk (%s); it was deleted", d.why)
	}
	return OutcomeDeleted, detail, nil
}

// registerOne judges and stores ce in tx, unless its id holds a CE already; with the previous
// owner's state when state is one that holds. It sets o's Result, and as they apply its Status,
// Detail, State (what became of a state given) and Tag (that of the CE stored, OutcomeStored, or
// found, OutcomeSame). A CE refused for its anchor (or its state's) is an *unknownAnchorError;
// one refused for another reason is OutcomeRefused.
func (l *Ledger) registerOne(tx *bolt.Tx, ce, state *CE, now time.Time, past map[uint64]*bnn.Model, o *Outcome) error {
	if raw := tx.Bucket(bHeaders).Get([]byte(ce.ID)); raw != nil {
		have, err := l.load(tx, []byte(ce.ID), raw)
		switch {
		case err != nil: // a damaged record holds the id: it is not replaced, nor does it stop the share
			o.Result, o.Detail = OutcomeExists, fmt.Sprintf("%q holds a damaged record: %v", ce.ID, err)
		case have.Target == ce.Target && slices.Equal(have.X, ce.X) && slices.Equal(have.XCF, ce.XCF):
			o.Result, o.Status, o.Tag = OutcomeSame, have.Status.String(), have.Tag()
		default:
			o.Result, o.Detail = OutcomeExists, fmt.Sprintf("%q holds another counterfactual", ce.ID)
		}
		return nil
	}
	put := ce
	if state != nil {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		if err := l.checkState(state, ce, c.version); err != nil {
			o.State, state = "previous owner's state not used: "+err.Error(), nil
		} else {
			cp := *ce
			cp.AnchorVersion, cp.P1, cp.Var1, cp.Samples = state.AnchorVersion, state.P1, state.Var1, state.Samples
			put = &cp
		}
	}
	plan, err := l.judgePut(tx, []*CE{put}, now, false, past)
	if err != nil {
		return err
	}
	// Its state is written whether or not one came: a replica's CE state topic then holds every
	// CE of the share, which restores those whose registration the CE topic no longer holds.
	plan.stated = true
	if e := plan.errs[0]; e != nil {
		if errors.Is(e, ErrUnknownAnchor) {
			return &unknownAnchorError{version: put.AnchorVersion, err: e}
		}
		o.Result, o.Detail = OutcomeRefused, e.Error()
		return nil
	}
	h := &plan.headers[0]
	if state != nil && h.status != certify.Uncertified {
		l.restoreHeader(h, state, plan.kl[state.AnchorVersion], past)
		plan.states = []*CE{state}
		o.State = StateRestored
	}
	if err := l.writePut(tx, plan, now); err != nil {
		return err
	}
	o.Result, o.Status, o.Tag = OutcomeStored, h.status.String(), plan.ces[0].Tag()
	return nil
}

// DeleteRequest deletes CE id (a damaged record of it is dropped, see deleteOne), as the
// request ref, in one transaction, when ifMatch is nil or names its tag (CE.Tag; AnyTag: any
// stored CE), else it keeps it (OutcomeMismatch). A request whose RID has an outcome is not
// applied again, and its stored outcome is returned with Duplicate set; any other request with
// an RID gets its outcome (OutcomeDeleted, OutcomeAbsent when nothing is stored under id, or
// OutcomeMismatch; Partition -1)
// stored under the RID for Options.RequestWindow. A request without an RID is applied and
// nothing is stored for it. A single daemon's DELETE is this, with the request id of its
// Idempotency-Key, so that a retry deletes nothing again: not a CE registered under the id after
// the first attempt.
func (l *Ledger) DeleteRequest(id string, ref RequestRef, ifMatch []string) (Outcome, error) {
	now := l.opts.Now().UTC()
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var (
		o     Outcome
		found deletedDamaged
	)
	err := l.update(func(tx *bolt.Tx) error {
		found = deletedDamaged{}
		if ref.RID != "" {
			had, ok, err := readOutcome(tx, ref.RID)
			if err != nil {
				return err
			}
			if ok {
				had.Duplicate = true
				o = had
				return nil
			}
		}
		o = Outcome{ID: id, Fingerprint: ref.Fingerprint, Partition: -1, At: now}
		var err error
		if o.Result, o.Detail, err = l.deleteOne(tx, id, ifMatch, found); err != nil || ref.RID == "" {
			return err
		}
		if err := putOutcome(tx, ref.RID, o); err != nil {
			return err
		}
		return l.pruneOutcomes(tx, now)
	})
	if err != nil {
		return Outcome{}, fmt.Errorf("ledger: delete %q: %w", id, err)
	}
	l.reportDamaged(found)
	return o, nil
}

// Outcome returns the outcome stored under rid, and false when there is none (the request was
// not applied yet, carried no RID, or its outcome expired).
func (l *Ledger) Outcome(rid string) (Outcome, bool, error) {
	var (
		o  Outcome
		ok bool
	)
	err := l.view(func(tx *bolt.Tx) (err error) {
		o, ok, err = readOutcome(tx, rid)
		return err
	})
	if err != nil {
		return Outcome{}, false, fmt.Errorf("ledger: outcome of request %q: %w", rid, err)
	}
	return o, ok, nil
}

func readOutcome(tx *bolt.Tx, rid string) (Outcome, bool, error) {
	b := tx.Bucket(bRequests)
	if b == nil {
		return Outcome{}, false, nil
	}
	v, err := getSealed(b, []byte(rid), "request outcome")
	if err != nil || v == nil {
		return Outcome{}, false, err
	}
	var o Outcome
	if err := json.Unmarshal(v, &o); err != nil {
		return Outcome{}, false, corruptf("request outcome %q: %v", rid, err)
	}
	return o, true, nil
}

// putOutcome stores o under rid, and rid in the order outcomes expire.
func putOutcome(tx *bolt.Tx, rid string, o Outcome) error {
	reqs, err := tx.CreateBucketIfNotExists(bRequests)
	if err != nil {
		return err
	}
	at, err := tx.CreateBucketIfNotExists(bRequestsAt)
	if err != nil {
		return err
	}
	v, err := json.Marshal(o)
	if err != nil {
		return err
	}
	if err := putSealed(reqs, []byte(rid), v); err != nil {
		return err
	}
	return at.Put(outcomeAtKey(o.At, rid), nil)
}

func outcomeAtKey(at time.Time, rid string) []byte {
	return append(binary.BigEndian.AppendUint64(nil, uint64(at.UnixNano())), rid...)
}

// pruneOutcomes deletes up to maxPrune outcomes stored before now - RequestWindow.
func (l *Ledger) pruneOutcomes(tx *bolt.Tx, now time.Time) error {
	at, reqs := tx.Bucket(bRequestsAt), tx.Bucket(bRequests)
	if at == nil || reqs == nil {
		return nil
	}
	cutoff := binary.BigEndian.AppendUint64(nil, uint64(now.Add(-l.opts.RequestWindow).UnixNano()))
	var dead [][]byte
	c := at.Cursor()
	for k, _ := c.First(); k != nil && len(dead) < maxPrune && bytes.Compare(k[:min(8, len(k))], cutoff) < 0; k, _ = c.Next() {
		dead = append(dead, bytes.Clone(k))
	}
	for _, k := range dead {
		if err := at.Delete(k); err != nil {
			return err
		}
		if len(k) > 8 {
			if err := reqs.Delete(k[8:]); err != nil {
				return err
			}
		}
	}
	return nil
}

// forgetOutcomes deletes in tx every outcome of requests read from CE-topic partition p at
// offsets from `from` on: a partition read again from its start must apply them again.
func forgetOutcomes(tx *bolt.Tx, p int, from int64) error {
	at, reqs := tx.Bucket(bRequestsAt), tx.Bucket(bRequests)
	if at == nil || reqs == nil {
		return nil
	}
	var dead [][]byte
	err := at.ForEach(func(k, _ []byte) error {
		if len(k) <= 8 {
			return nil
		}
		o, ok, err := readOutcome(tx, string(k[8:]))
		if err != nil {
			return err
		}
		if ok && o.Partition == p && o.Offset >= from {
			dead = append(dead, bytes.Clone(k))
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, k := range dead {
		if err := at.Delete(k); err != nil {
			return err
		}
		if err := reqs.Delete(k[8:]); err != nil {
			return err
		}
	}
	return nil
}

// checkOutcomes checks that every outcome decodes, and that requests and requests_at index the
// same request ids, each at its outcome's time (Verify runs it).
func checkOutcomes(tx *bolt.Tx) error {
	at, reqs := tx.Bucket(bRequestsAt), tx.Bucket(bRequests)
	if at == nil && reqs == nil {
		return nil
	}
	if at == nil || reqs == nil {
		return corruptf("request outcomes: one of buckets %q and %q is missing", bRequests, bRequestsAt)
	}
	n := 0
	err := at.ForEach(func(k, _ []byte) error {
		if len(k) <= 8 {
			return corruptf("requests_at: key %x is too short", k)
		}
		o, ok, err := readOutcome(tx, string(k[8:]))
		if err != nil {
			return err
		}
		if !ok || !bytes.Equal(outcomeAtKey(o.At, string(k[8:])), k) {
			return corruptf("requests_at: request %q has no outcome at the time its key names", k[8:])
		}
		n++
		return nil
	})
	if err != nil {
		return err
	}
	if have := reqs.Stats().KeyN; have != n {
		return corruptf("request outcomes: %d outcomes, %d in requests_at", have, n)
	}
	return nil
}
