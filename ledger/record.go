package ledger

import (
	"encoding/binary"
	"math"
	"time"

	"github.com/cfguard/cfguard/certify"
)

// CE is a stored counterfactual: the instance X, its counterfactual XCF with target class Target,
// and the certificate measured under the anchor posterior (AnchorVersion): P1 = E_q1[f],
// Var1 = Var_q1[f] from Samples Monte-Carlo draws (the unbiased estimate, which may exceed 1/4 by
// the factor Samples/(Samples - 1): certify.MaxSampleVar), f(w) = p(Target | XCF, w), admitted to
// the <Delta, Epsilon>-set.
//
// Bound, VarBound and KLFromAnchor are not stored per record: they are derived on read from the
// anchor's KL(q_now || q_anchor) as of the last checkpoint, so that a re-certification that changes
// no status writes nothing per CE. They are 0 for uncertified CEs, which hold no certificate.
//
// ConfirmedVersion is set for an at_risk or invalidated CE whose status was decided by a
// Monte-Carlo estimate: the posterior version of that estimate. It is nil while the status rests
// on the failed bound alone (at_risk, unconfirmed: Confirm will sample it), and for certified and
// uncertified CEs.
type CE struct {
	ID               string         `json:"id"`
	X                []float64      `json:"x"`
	XCF              []float64      `json:"x_cf"`
	Target           int            `json:"target"`
	AnchorVersion    uint64         `json:"anchor_version"`
	P1               float64        `json:"p1"`
	Var1             float64        `json:"var1"`
	Samples          int            `json:"samples"`
	Delta            float64        `json:"delta"`
	Epsilon          float64        `json:"epsilon"`
	Status           certify.Status `json:"status"`
	ConfirmedVersion *uint64        `json:"confirmed_version,omitempty"`
	// PosteriorVersion is the current posterior when the CE was read (Get, List): the version at
	// which Bound, VarBound, KLFromAnchor, Decided and the pending flags are judged.
	PosteriorVersion uint64    `json:"posterior_version"`
	Bound            float64   `json:"bound"`
	VarBound         float64   `json:"var_bound"`
	KLFromAnchor     float64   `json:"kl_from_anchor"`
	CreatedAt        time.Time `json:"created_at"`
	UpdatedAt        time.Time `json:"updated_at"`
	// RenewalPending is set on a certified CE whose bound has lapsed (Bound < 1/2 or VarBound over
	// its ceiling at KLFromAnchor): it waits for the confirmer, which renews it (a new anchor,
	// still certified) or gives it a verdict (at_risk, invalidated).
	RenewalPending bool `json:"renewal_pending,omitempty"`
	// RenewalPendingSince is set with RenewalPending when the ledger knows since which posterior
	// version the bound has failed: the version committed after the last one at which the
	// anchor's KL let it hold, a scan of the anchor's KL history (anchor_kl), the same at every
	// ledger that committed the same versions. It is absent when that history does not reach back
	// to a version at which the bound held (an anchor taken over, or older than the history).
	RenewalPendingSince *uint64 `json:"renewal_pending_since,omitempty"`
	// VerdictBound is the confidence bound that decided the verdict of ConfirmedVersion
	// (certify.VerdictBound: lower(p2) for at_risk, upper(p2) for invalidated, rounded to float32
	// away from its side), nil when the evidence decided nothing. The verdict stays in force
	// under a later posterior q while certify.Carries holds at KL(q || q_ConfirmedVersion).
	VerdictBound *float64 `json:"verdict_bound,omitempty"`
	// Decided says whether the status is backed by a bound that holds under the current posterior:
	// a certified CE whose certificate has not lapsed (not RenewalPending), or an at_risk or
	// invalidated CE whose verdict the evidence decided and still carries to the current posterior
	// (certify.Carries at KL(q_now || q_ConfirmedVersion)). An undecided status asserts nothing
	// about p: a lapsed certificate waiting for the confirmer, a verdict kept by hysteresis, or
	// one that no longer carries. uncertified CEs are never decided (no theorem applies).
	Decided bool `json:"decided"`
	// VerdictPending is set on an at_risk or invalidated CE whose status is undecided: the
	// confirmer measures it again (one kept by hysteresis under the current posterior, at the next
	// posterior), as RenewalPending is for certificates.
	VerdictPending bool `json:"verdict_pending,omitempty"`
	// VerdictPendingSince is set with VerdictPending on a CE whose decided verdict (VerdictBound)
	// no longer carries, when the reader knows since which posterior version: the first version
	// after ConfirmedVersion at which certify.Carries fails, computed from the posteriors of
	// every version since ConfirmedVersion (Options.Past), the same at every ledger whose caller
	// holds them. It is absent for a verdict that decided nothing (kept by hysteresis: it waits
	// at every version) and when the caller does not hold one of those posteriors.
	VerdictPendingSince *uint64 `json:"verdict_pending_since,omitempty"`
	// ReissuePendingSince is set on a CE that waits for its replacement (explain.reissue): the
	// posterior version of the status change that made it wait (PendingReissue). It goes with
	// the CE's state to a new owner, which reissues it.
	ReissuePendingSince *uint64 `json:"reissue_pending_since,omitempty"`
	// History holds the last MaxHistory status changes and renewals, oldest first.
	History []StatusChange `json:"history,omitempty"`
}

// Certificate is the CE's certificate in certify's terms.
func (c *CE) Certificate() certify.Certificate {
	return certify.Certificate{P1: c.P1, Var1: c.Var1, Samples: c.Samples, Delta: c.Delta, Epsilon: c.Epsilon}
}

// StatusChange records one transition of a CE's status at posterior version v =
// PosteriorVersion: KL is KL(q_v || q_anchor) and Bound, VarBound are Theorems 1 and 2 at that
// KL; P2 is the Monte-Carlo estimate of p(Target | XCF) when one decided the change, nil when
// the bound alone did (Commit, Recertify). The confirmer records a change at the version it
// measured, written later or not (a renewal at its new anchor: KL 0); an audit at the version
// current when it writes, measured under the audit's (a renewal then at the KL from it).
type StatusChange struct {
	ID               string         `json:"id,omitempty"`
	At               time.Time      `json:"at"`
	From             certify.Status `json:"from"`
	To               certify.Status `json:"to"`
	PosteriorVersion uint64         `json:"posterior_version"`
	KL               float64        `json:"kl"`
	Bound            float64        `json:"bound"`
	VarBound         float64        `json:"var_bound"`
	P2               *float64       `json:"p2,omitempty"`
	// Renewal marks a history entry from certified to certified: the certificate was renewed
	// (re-anchored to PosteriorVersion, with p1 = P2), which is not a status change.
	Renewal bool `json:"renewal,omitempty"`
	// Decided, RenewalPending and VerdictPending are the CE's (see CE) as the transaction that
	// recorded the change left it: set on the changes the ledger returns and puts in its outbox,
	// not kept in the history (whose entries say nothing of them).
	Decided        bool `json:"-"`
	RenewalPending bool `json:"-"`
	VerdictPending bool `json:"-"`
	// LapsedSince is set on a verdict given to a certified CE whose certificate had lapsed, when
	// the ledger knew since which version its bound had failed (the CE's RenewalPendingSince
	// before the change): the versions since then served a lapsed certificate. Not kept in the
	// history.
	LapsedSince *uint64 `json:"-"`
}

// MaxHistory is how many status changes a CE keeps; older ones are dropped.
const MaxHistory = 32

// Record layout. A CE is two values under the same key (its ID): a fixed-size header in bucket
// ce_hdr holding everything judging reads, and a body in ce_body with the vectors and the
// history. Both are sealed (a CRC-32C of key and payload follows the payload, see store.Seal).
//
//	header payload (72 bytes, little endian), format 2
//	  0 format (2)   1 status   2 flags (bit 0: confirmed, bit 1: unused, bit 2: carry bound)
//	  3 reserved   4 target u32   8 anchor version u64   16 p1 f64   24 var1 f64   32 delta f64
//	 40 epsilon f64   48 samples u32   52 carry bound f32 (0 without bit 2)
//	 56 updated-at unix ns i64   64 confirmed version u64
//
// The carry bound is the confidence bound of a confirmed verdict (certify.VerdictBound), rounded
// to float32 away from 1/2's side it proves (down for at_risk, up for invalidated), so that the
// rounded bound carries the verdict no further than the exact one (certify.Carries). A file
// written with it is refused by a cfguard that predates it (flags or reserved bytes set).
//
// Whether a certified CE's certificate has lapsed is not stored: it is its bound failing at its
// anchor's stored KL (see doc.go). Flag bit 1 is never written; files that stored a lapse there
// are read with the bit ignored.
//
// Format 1 (schema 1) was the first 64 bytes with format 1 and no checksum; Open migrates it.
//
//	body payload
//	  format (1), created-at unix ns i64, uvarint n, n x f64 (X), uvarint n, n x f64 (XCF),
//	  uvarint h, h x 50-byte history entries:
//	  at i64, from u8, to u8, posterior version u64, kl f64, bound f64, var bound f64, p2 f64 (NaN = none)
const (
	headerSize      = 72
	headerFormat    = 2
	header1Size     = 64
	bodyFormat      = 1
	histSize        = 50
	flagConfirmed   = 1
	flagStoredLapse = 2 // ignored on read (see the layout above)
	flagCarry       = 4
	hStatus         = 1
	hFlags          = 2
	hTarget         = 4
	hAnchor         = 8
	hP1             = 16
	hVar1           = 24
	hDelta          = 32
	hEps            = 40
	hSamples        = 48
	hCarry          = 52
	hUpdated        = 56
	hConfirmed      = 64
	maxVectorLen    = 1 << 20
	maxHistoryRecs  = 1 << 16
)

// header is the decoded fixed-size part of a record.
type header struct {
	status         certify.Status
	confirmed      bool    // the status of a failing CE was decided by Monte-Carlo ...
	cv             uint64  // ... under this posterior version
	carry          bool    // the verdict (confirmed, cv) has a carry bound ...
	cbound         float32 // ... certify.VerdictBound of its evidence, rounded away from its side
	target         int
	anchor         uint64
	p1, var1       float64
	delta, epsilon float64
	samples        int
	updated        int64
}

func (h *header) certificate() certify.Certificate {
	return certify.Certificate{P1: h.p1, Var1: h.var1, Samples: h.samples, Delta: h.delta, Epsilon: h.epsilon}
}

// failing reports whether the CE holds a certificate whose bound fails (at_risk, invalidated).
func (h *header) failing() bool { return h.status == certify.AtRisk || h.status == certify.Invalidated }

// rejudge moves the CE by certify.Rejudge, the rule for bounds that hold or fail at its anchor's
// KL. A CE that is certified after it carries no verdict (confirmed, cv). A certified CE keeps its
// status whether its bound holds or not: a lapse is derived, never stored.
func (h *header) rejudge(holds bool) {
	s := certify.Rejudge(certify.Standing{Status: h.status, Lapsed: h.status == certify.Certified && !holds}, holds)
	h.status = s.Status
	if s.Status == certify.Certified {
		h.unconfirm()
	}
}

// newCertificate gives the CE a new certificate (a renewal, or an audit's measurement): certified,
// with no verdict. Measured under a posterior whose KL from the current one already breaks the
// bound, it is certified with a lapsed bound, to be renewed again.
func (h *header) newCertificate() {
	h.status = certify.Certified
	h.unconfirm()
}

func f64(b []byte, off int) float64 { return math.Float64frombits(binary.LittleEndian.Uint64(b[off:])) }

func putF64(b []byte, off int, v float64) {
	binary.LittleEndian.PutUint64(b[off:], math.Float64bits(v))
}

// decodeHeader parses a header payload (already unsealed). It accepts format 1 (64 bytes) for
// the schema-1 migration.
func decodeHeader(v []byte) (header, error) {
	switch {
	case len(v) == headerSize && v[0] == headerFormat:
	case len(v) == header1Size && v[0] == 1:
	default:
		return header{}, corruptf("header of %d bytes, format %d", len(v), firstByte(v))
	}
	h := header{
		status:  certify.Status(v[hStatus]),
		target:  int(binary.LittleEndian.Uint32(v[hTarget:])),
		anchor:  binary.LittleEndian.Uint64(v[hAnchor:]),
		p1:      f64(v, hP1),
		var1:    f64(v, hVar1),
		delta:   f64(v, hDelta),
		epsilon: f64(v, hEps),
		samples: int(binary.LittleEndian.Uint32(v[hSamples:])),
		updated: int64(binary.LittleEndian.Uint64(v[hUpdated:])),
	}
	if !h.status.Valid() {
		return header{}, corruptf("header status %d", v[hStatus])
	}
	if v[0] == headerFormat {
		h.carry = v[hFlags]&flagCarry != 0
		if v[hFlags]&^(flagConfirmed|flagStoredLapse|flagCarry) != 0 || v[3] != 0 || !h.carry && binary.LittleEndian.Uint32(v[hCarry:]) != 0 {
			return header{}, corruptf("header flags %#x or reserved bytes set", v[hFlags])
		}
		h.confirmed = v[hFlags]&flagConfirmed != 0
		h.cbound = math.Float32frombits(binary.LittleEndian.Uint32(v[hCarry:]))
		if h.carry && (!h.confirmed || !(h.cbound >= 0 && h.cbound <= 1) ||
			math.IsInf(certify.CarryMargin(h.status, float64(h.cbound)), -1) ||
			h.status == certify.AtRisk && h.cbound < 0.5 || h.status == certify.Invalidated && h.cbound > 0.5) {
			return header{}, corruptf("header: carry bound %v for status %v (confirmed %v)", h.cbound, h.status, h.confirmed)
		}
		h.cv = binary.LittleEndian.Uint64(v[hConfirmed:])
		if !h.confirmed && h.cv != 0 || h.confirmed && !h.failing() {
			return header{}, corruptf("header: confirmed flag %v with version %d for status %v", h.confirmed, h.cv, h.status)
		}
	}
	for _, x := range []float64{h.p1, h.var1, h.delta, h.epsilon} {
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return header{}, corruptf("header holds a non-finite number (p1 %v var1 %v delta %v epsilon %v)", h.p1, h.var1, h.delta, h.epsilon)
		}
	}
	return h, nil
}

func firstByte(v []byte) int {
	if len(v) == 0 {
		return -1
	}
	return int(v[0])
}

// encode returns the format-2 payload.
func (h *header) encode() []byte {
	v := make([]byte, headerSize)
	v[0] = headerFormat
	v[hStatus] = byte(h.status)
	if h.confirmed {
		v[hFlags] = flagConfirmed
		binary.LittleEndian.PutUint64(v[hConfirmed:], h.cv)
		if h.carry {
			v[hFlags] |= flagCarry
			binary.LittleEndian.PutUint32(v[hCarry:], math.Float32bits(h.cbound))
		}
	}
	binary.LittleEndian.PutUint32(v[hTarget:], uint32(h.target))
	binary.LittleEndian.PutUint64(v[hAnchor:], h.anchor)
	putF64(v, hP1, h.p1)
	putF64(v, hVar1, h.var1)
	putF64(v, hDelta, h.delta)
	putF64(v, hEps, h.epsilon)
	binary.LittleEndian.PutUint32(v[hSamples:], uint32(h.samples))
	binary.LittleEndian.PutUint64(v[hUpdated:], uint64(h.updated))
	return v
}

// body is the decoded variable part of a record.
type body struct {
	created int64
	x, xcf  []float64
	history []StatusChange
}

func (b *body) encode() []byte {
	n := 1 + 8 + 3*binary.MaxVarintLen64 + 8*(len(b.x)+len(b.xcf)) + histSize*len(b.history)
	v := make([]byte, 0, n)
	v = append(v, bodyFormat)
	v = binary.LittleEndian.AppendUint64(v, uint64(b.created))
	for _, xs := range [][]float64{b.x, b.xcf} {
		v = binary.AppendUvarint(v, uint64(len(xs)))
		for _, x := range xs {
			v = binary.LittleEndian.AppendUint64(v, math.Float64bits(x))
		}
	}
	v = binary.AppendUvarint(v, uint64(len(b.history)))
	for _, h := range b.history {
		v = binary.LittleEndian.AppendUint64(v, uint64(h.At.UnixNano()))
		v = append(v, byte(h.From), byte(h.To))
		v = binary.LittleEndian.AppendUint64(v, h.PosteriorVersion)
		p2 := math.NaN()
		if h.P2 != nil {
			p2 = *h.P2
		}
		for _, f := range []float64{h.KL, h.Bound, h.VarBound, p2} {
			v = binary.LittleEndian.AppendUint64(v, math.Float64bits(f))
		}
	}
	return v
}

// decodeBody parses a body payload; withHistory = false skips the history (Monte-Carlo needs
// only XCF).
func decodeBody(v []byte, withHistory bool) (body, error) {
	var b body
	bad := func(what string) (body, error) { return body{}, corruptf("body (%d bytes): %s", len(v), what) }
	if len(v) < 9 || v[0] != bodyFormat {
		return bad("short or unknown format")
	}
	b.created = int64(binary.LittleEndian.Uint64(v[1:]))
	p := 9
	for _, dst := range []*[]float64{&b.x, &b.xcf} {
		n, k := uvarint(v[p:])
		if k <= 0 || n > maxVectorLen || n > uint64(len(v)-p-k)/8 {
			return bad("vector length")
		}
		p += k
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = f64(v, p)
			p += 8
		}
		*dst = xs
	}
	n, k := uvarint(v[p:])
	if k <= 0 || n > maxHistoryRecs || uint64(len(v)-p-k) != n*histSize {
		return bad("history length")
	}
	p += k
	if !withHistory {
		return b, nil
	}
	if n > 0 {
		b.history = make([]StatusChange, n)
	}
	for i := range b.history {
		h := &b.history[i]
		h.At = time.Unix(0, int64(binary.LittleEndian.Uint64(v[p:]))).UTC()
		h.From, h.To = certify.Status(v[p+8]), certify.Status(v[p+9])
		if !h.From.Valid() || !h.To.Valid() {
			return bad("history entry status")
		}
		h.PosteriorVersion = binary.LittleEndian.Uint64(v[p+10:])
		h.KL, h.Bound, h.VarBound = f64(v, p+18), f64(v, p+26), f64(v, p+34)
		if p2 := f64(v, p+42); !math.IsNaN(p2) {
			h.P2 = &p2
		} else if math.Float64bits(p2) != math.Float64bits(math.NaN()) {
			return bad("history entry p2")
		}
		p += histSize
	}
	return b, nil
}

// uvarint is binary.Uvarint accepting only the shortest encoding (what AppendUvarint writes),
// so that every accepted record has one byte representation.
func uvarint(b []byte) (uint64, int) {
	n, k := binary.Uvarint(b)
	if k > 1 && b[k-1] == 0 {
		return 0, 0
	}
	return n, k
}

// appendHistory adds c to h, keeping the last MaxHistory entries.
func appendHistory(h []StatusChange, c StatusChange) []StatusChange {
	c.ID = ""
	h = append(h, c)
	if len(h) > MaxHistory {
		h = h[len(h)-MaxHistory:]
	}
	return h
}

// anchorMeta is the small record kept per anchor posterior in bucket anchors (the model bytes
// are in anchor_models under the same key):
//
//	refs u64 (CEs holding a certificate under it), kl f64 = KL(q_now || q_anchor),
//	klVersion u64 (the current version kl was computed against), created unix ns i64
type anchorMeta struct {
	refs      uint64
	kl        float64
	klVersion uint64
	created   int64
}

func decodeAnchor(v []byte) (anchorMeta, error) {
	if len(v) != 32 {
		return anchorMeta{}, corruptf("record of %d bytes, want 32", len(v))
	}
	a := anchorMeta{refs: binary.BigEndian.Uint64(v), kl: math.Float64frombits(binary.BigEndian.Uint64(v[8:])),
		klVersion: binary.BigEndian.Uint64(v[16:]), created: int64(binary.BigEndian.Uint64(v[24:]))}
	if !(a.kl >= 0) || math.IsInf(a.kl, 0) {
		return anchorMeta{}, corruptf("kl %v", a.kl)
	}
	return a, nil
}

func (a anchorMeta) encode() []byte {
	v := make([]byte, 0, 32)
	v = binary.BigEndian.AppendUint64(v, a.refs)
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(a.kl))
	v = binary.BigEndian.AppendUint64(v, a.klVersion)
	return binary.BigEndian.AppendUint64(v, uint64(a.created))
}

// KLEntry is one entry of the KL history: one update, promoted or not.
type KLEntry struct {
	Seq              uint64    `json:"seq"`
	At               time.Time `json:"at"`
	PosteriorVersion uint64    `json:"posterior_version"`
	// KL is the update KL, KL(q_new || q_prev); MaxAnchorKL the largest KL(q_now || q_anchor)
	// over live anchors after the checkpoint (0 when it carried no re-certification).
	KL          float64         `json:"kl"`
	MaxAnchorKL float64         `json:"max_anchor_kl"`
	Outcome     certify.Outcome `json:"outcome"`
}

// Breached says whether the update breached budget: its KL is over it, or it was clipped (a
// clipped update is recorded with the KL of the scaled-back step, at most the budget; it is
// clipped only when the step it scaled back was over).
func (s KLEntry) Breached(budget float64) bool {
	return s.KL > budget || s.Outcome == certify.OutcomeClipped
}

func (s KLEntry) encode() []byte {
	v := make([]byte, 0, 33+len(s.Outcome))
	v = binary.BigEndian.AppendUint64(v, uint64(s.At.UnixNano()))
	v = binary.BigEndian.AppendUint64(v, s.PosteriorVersion)
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(s.KL))
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(s.MaxAnchorKL))
	v = append(v, byte(len(s.Outcome)))
	return append(v, s.Outcome...)
}

func decodeKLEntry(k, v []byte) (KLEntry, error) {
	if len(k) != 8 || len(v) < 33 || len(v) != 33+int(v[32]) {
		return KLEntry{}, corruptf("record of %d bytes", len(v))
	}
	o, err := certify.ParseOutcome(string(v[33:]))
	if err != nil {
		return KLEntry{}, corruptf("%v", err)
	}
	return KLEntry{Seq: binary.BigEndian.Uint64(k), At: time.Unix(0, int64(binary.BigEndian.Uint64(v))).UTC(),
		PosteriorVersion: binary.BigEndian.Uint64(v[8:]), KL: math.Float64frombits(binary.BigEndian.Uint64(v[16:])),
		MaxAnchorKL: math.Float64frombits(binary.BigEndian.Uint64(v[24:])), Outcome: o}, nil
}

// OutboxEntry is one message waiting to be published: a message key and value, the stream it
// goes to, and the sequence number the ledger gave it (increasing, never reused).
type OutboxEntry struct {
	Seq    uint64 `json:"seq"`
	Stream Stream `json:"stream,omitempty"`
	Key    string `json:"key"`
	Value  []byte `json:"value"`
}

// Stream is where an outbox entry is published.
type Stream uint8

const (
	// StreamEvents: the events topic (status changes, posterior events).
	StreamEvents Stream = 0
	// StreamStates: the CE state topic of a replica (Options.EncodeState).
	StreamStates Stream = 1
)

// maxOutboxKey bounds an outbox entry's key.
const maxOutboxKey = 1 << 12

// An outbox entry's payload is uvarint(len(key) | stream << 32), the key, the value. Entries
// of StreamEvents read as before streams existed (the stream bits are 0); a cfguard that
// predates streams refuses a StreamStates entry ("key length").
func (e *OutboxEntry) encode() []byte {
	v := binary.AppendUvarint(make([]byte, 0, binary.MaxVarintLen64+len(e.Key)+len(e.Value)), uint64(len(e.Key))|uint64(e.Stream)<<32)
	return append(append(v, e.Key...), e.Value...)
}

func decodeOutboxEntry(k, v []byte) (OutboxEntry, error) {
	if len(k) != 8 {
		return OutboxEntry{}, corruptf("key of %d bytes", len(k))
	}
	n, p := uvarint(v)
	stream := n >> 32
	if n &= 1<<32 - 1; p <= 0 || n > maxOutboxKey || n > uint64(len(v)-p) {
		return OutboxEntry{}, corruptf("key length")
	}
	if stream > uint64(StreamStates) {
		return OutboxEntry{}, corruptf("stream %d", stream)
	}
	return OutboxEntry{Seq: binary.BigEndian.Uint64(k), Stream: Stream(stream), Key: string(v[p : p+int(n)]),
		Value: append([]byte{}, v[p+int(n):]...)}, nil
}

// counts are the per-status CE counts kept in meta, indexed by status - 1.
// counts are the CEs per status (index status - 1) and, last, the certified CEs whose bound
// has lapsed (the renewal backlog). A ledger written before lapses existed stores the four
// status counts only; its lapsed count is 0.
type counts [5]int64

func decodeCounts(v []byte) (counts, error) {
	var c counts
	if v == nil {
		return c, nil
	}
	if len(v) != 8*len(c) && len(v) != 8*(len(c)-1) {
		return c, corruptf("status counts of %d bytes", len(v))
	}
	for i := range len(v) / 8 {
		c[i] = int64(binary.BigEndian.Uint64(v[8*i:]))
		if c[i] < 0 {
			return c, corruptf("negative status count")
		}
	}
	return c, nil
}

func (c *counts) add(s certify.Status, d int64) { c[s-1] += d }

// lapsedSlot is the index of the lapsed count in counts.
const lapsedSlot = 4

// addHeader adds d times h's contribution: its status, and the lapsed count when it is a
// certified CE whose bound fails at its anchor's KL (lapsed).
func (c *counts) addHeader(h *header, lapsed bool, d int64) {
	c.add(h.status, d)
	if lapsed && h.status == certify.Certified {
		c[lapsedSlot] += d
	}
}

func (c counts) encode() ([]byte, error) {
	v := make([]byte, 0, 8*len(c))
	for _, n := range c {
		if n < 0 {
			return nil, corruptf("a status count would become negative (%v)", c)
		}
		v = binary.BigEndian.AppendUint64(v, uint64(n))
	}
	return v, nil
}

func (c counts) asMap() map[certify.Status]int {
	m := make(map[certify.Status]int, len(c))
	for _, s := range certify.Statuses() {
		m[s] = int(c[s-1])
	}
	return m
}
