package ledger

import (
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/cfguard/cfguard/certify"
)

// CE is a stored counterfactual: the instance X, its counterfactual XCF with target class Target,
// and the certificate measured under the anchor posterior (AnchorVersion): P1 = E_q1[f],
// Var1 = Var_q1[f] from Samples Monte-Carlo draws, f(w) = p(Target | XCF, w), admitted to the
// <Delta, Epsilon>-set.
//
// Bound, VarBound and KLFromAnchor are not stored per record: they are derived on read from the
// anchor's KL(q_now || q_anchor) as of the last checkpoint, so that a re-certification that changes
// no status writes nothing per CE. They are 0 for uncertified CEs, which hold no certificate.
type CE struct {
	ID            string         `json:"id"`
	X             []float64      `json:"x"`
	XCF           []float64      `json:"x_cf"`
	Target        int            `json:"target"`
	AnchorVersion uint64         `json:"anchor_version"`
	P1            float64        `json:"p1"`
	Var1          float64        `json:"var1"`
	Samples       int            `json:"samples"`
	Delta         float64        `json:"delta"`
	Epsilon       float64        `json:"epsilon"`
	Status        certify.Status `json:"status"`
	Bound         float64        `json:"bound"`
	VarBound      float64        `json:"var_bound"`
	KLFromAnchor  float64        `json:"kl_from_anchor"`
	CreatedAt     time.Time      `json:"created_at"`
	UpdatedAt     time.Time      `json:"updated_at"`
	// History holds the last MaxHistory status changes, oldest first.
	History []StatusChange `json:"history,omitempty"`
}

// Certificate is the CE's certificate in certify's terms.
func (c *CE) Certificate() certify.Certificate {
	return certify.Certificate{P1: c.P1, Var1: c.Var1, Samples: c.Samples, Delta: c.Delta, Epsilon: c.Epsilon}
}

// StatusChange records one transition of a CE's status. KL is KL(q_now || q_anchor) and Bound,
// VarBound are Theorems 1 and 2 at that KL; P2 is the Monte-Carlo estimate of p(Target | XCF)
// under q_now when one was taken (nil when the bound alone decided).
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
}

// MaxHistory is how many status changes a CE keeps; older ones are dropped.
const MaxHistory = 32

// Record layout. A CE is two values under the same key (its ID): a fixed-size header in bucket
// ce_hdr holding everything re-certification by bound reads, and a body in ce_body with the
// vectors and the history. The bound pass reads headers only, at fixed offsets, without decoding
// or allocating; the body is read only for the Monte-Carlo fallback, Get and List.
//
//	header (64 bytes, little endian)
//	  0 format (1)   1 status   2..3 reserved   4 target u32   8 anchor version u64
//	 16 p1 f64      24 var1 f64   32 delta f64   40 epsilon f64   48 samples u32   52 reserved
//	 56 updated-at unix ns i64
//
//	body
//	  format (1), created-at unix ns i64, uvarint n, n x f64 (X), uvarint n, n x f64 (XCF),
//	  uvarint h, h x 50-byte history entries:
//	  at i64, from u8, to u8, posterior version u64, kl f64, bound f64, var bound f64, p2 f64 (NaN = none)
const (
	headerSize   = 64
	recordFormat = 1
	histSize     = 50

	hStatus  = 1
	hTarget  = 4
	hAnchor  = 8
	hP1      = 16
	hVar1    = 24
	hDelta   = 32
	hEps     = 40
	hSamples = 48
	hUpdated = 56
)

// header is the decoded fixed-size part of a record.
type header struct {
	status         certify.Status
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

func f64(b []byte, off int) float64 { return math.Float64frombits(binary.LittleEndian.Uint64(b[off:])) }

func putF64(b []byte, off int, v float64) {
	binary.LittleEndian.PutUint64(b[off:], math.Float64bits(v))
}

func decodeHeader(v []byte) (header, error) {
	if len(v) != headerSize || v[0] != recordFormat {
		return header{}, fmt.Errorf("%w: header of %d bytes, format %d", ErrCorrupt, len(v), firstByte(v))
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
		return header{}, fmt.Errorf("%w: header status %d", ErrCorrupt, v[hStatus])
	}
	return h, nil
}

func firstByte(v []byte) int {
	if len(v) == 0 {
		return -1
	}
	return int(v[0])
}

func (h *header) encode() []byte {
	v := make([]byte, headerSize)
	v[0] = recordFormat
	v[hStatus] = byte(h.status)
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
	v = append(v, recordFormat)
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

// decodeBody parses a body; withHistory = false skips the history (the Monte-Carlo pass needs
// only XCF).
func decodeBody(v []byte, withHistory bool) (body, error) {
	var b body
	bad := func(what string) (body, error) {
		return body{}, fmt.Errorf("%w: body (%d bytes): %s", ErrCorrupt, len(v), what)
	}
	if len(v) < 9 || v[0] != recordFormat {
		return bad("short or unknown format")
	}
	b.created = int64(binary.LittleEndian.Uint64(v[1:]))
	p := 9
	for _, dst := range []*[]float64{&b.x, &b.xcf} {
		n, k := binary.Uvarint(v[p:])
		if k <= 0 || n > uint64(len(v)-p-k)/8 {
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
	n, k := binary.Uvarint(v[p:])
	if k <= 0 || n > uint64(len(v)-p-k)/histSize || uint64(len(v)-p-k) != n*histSize {
		return bad("history length")
	}
	p += k
	if !withHistory {
		return b, nil
	}
	b.history = make([]StatusChange, n)
	for i := range b.history {
		h := &b.history[i]
		h.At = time.Unix(0, int64(binary.LittleEndian.Uint64(v[p:]))).UTC()
		h.From, h.To = certify.Status(v[p+8]), certify.Status(v[p+9])
		h.PosteriorVersion = binary.LittleEndian.Uint64(v[p+10:])
		h.KL, h.Bound, h.VarBound = f64(v, p+18), f64(v, p+26), f64(v, p+34)
		if p2 := f64(v, p+42); !math.IsNaN(p2) {
			h.P2 = &p2
		}
		p += histSize
	}
	return b, nil
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
