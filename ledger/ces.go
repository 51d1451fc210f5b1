package ledger

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// MaxIDLen bounds a CE's ID.
const MaxIDLen = 128

func validID(id string) error {
	if len(id) == 0 || len(id) > MaxIDLen {
		return fmt.Errorf("%w: id %q: want 1 to %d characters", ErrInvalid, id, MaxIDLen)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return fmt.Errorf("%w: id %q: character %q not in [A-Za-z0-9._:-]", ErrInvalid, id, c)
		}
	}
	return nil
}

// newID is time-ordered (so List pages in registration order) with 32 random bits.
func newID(now time.Time) string {
	return fmt.Sprintf("%016x%08x", uint64(now.UnixNano()), rand.Uint32())
}

// validate checks a CE to be registered against the current posterior.
func validate(ce *CE, m *bnn.Model) error {
	if ce == nil {
		return fmt.Errorf("%w: nil counterfactual", ErrInvalid)
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
			return fmt.Errorf("%w: %s has %d features, the posterior takes %d", ErrInvalid, v.name, len(v.x), d)
		}
		for j, x := range v.x {
			if math.IsNaN(x) || math.IsInf(x, 0) {
				return fmt.Errorf("%w: %s[%d] = %v", ErrInvalid, v.name, j, x)
			}
		}
	}
	if ce.Target < 0 || ce.Target >= m.NumClasses() {
		return fmt.Errorf("%w: target = %d, the posterior has %d classes", ErrInvalid, ce.Target, m.NumClasses())
	}
	if ce.Samples > math.MaxUint32 {
		return fmt.Errorf("%w: samples = %d too large", ErrInvalid, ce.Samples)
	}
	if err := ce.Certificate().Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// Put registers counterfactuals, all or none, in one transaction. Each CE's certificate
// (P1, Var1, Samples) must have been measured under posterior AnchorVersion, which must be the
// current posterior or a live anchor (else ErrUnknownAnchor: measure again under the current
// one). A CE outside its <Delta, Epsilon>-set is stored as uncertified. Otherwise its status
// is judged at KL(q_now || q_anchor), with a Monte-Carlo check under q_now if the bound fails
// (only possible for an older anchor, or with Hoeffding p1 at S small).
//
// Put fills in ID (if empty), Status, Bound, VarBound, KLFromAnchor, CreatedAt (if zero) and
// UpdatedAt of the given CEs. Registering under the current posterior stores its snapshot as an
// anchor. X and XCF are raw features (the posterior's scaler applies).
func (l *Ledger) Put(ces ...*CE) error {
	if len(ces) == 0 {
		return nil
	}
	now := l.opts.Now().UTC()
	pol := l.opts.Policy
	l.wmu.Lock()
	defer l.wmu.Unlock()

	var (
		c       cur
		current *bnn.Model
		anchorK = map[uint64]float64{} // KL(q_now || q_anchor) for the anchors used
		needMC  []int
	)
	err := l.db.View(func(tx *bolt.Tx) error {
		if c = readCur(tx); !c.ok {
			return ErrNoPosterior
		}
		var err error
		if current, err = l.model(tx, c.version); err != nil {
			return err
		}
		seen := make(map[string]bool, len(ces))
		hdrs := tx.Bucket(bHeaders)
		for i, ce := range ces {
			if err := validate(ce, current); err != nil {
				return fmt.Errorf("counterfactual %d (id %q): %w", i, ce.ID, err)
			}
			if ce.ID == "" {
				ce.ID = newID(now)
			}
			if seen[ce.ID] || hdrs.Get([]byte(ce.ID)) != nil {
				return fmt.Errorf("counterfactual %d: %w: %q", i, ErrExists, ce.ID)
			}
			seen[ce.ID] = true
			if ce.CreatedAt.IsZero() {
				ce.CreatedAt = now
			}
			ce.UpdatedAt, ce.History = now, nil
			cert := ce.Certificate()
			if !cert.InSet() {
				ce.Status, ce.Bound, ce.VarBound, ce.KLFromAnchor = certify.Uncertified, 0, 0, 0
				continue
			}
			kl, ok := anchorK[ce.AnchorVersion]
			if !ok {
				if ce.AnchorVersion != c.version {
					a, err := l.model(tx, ce.AnchorVersion)
					if err != nil {
						return fmt.Errorf("counterfactual %q: %w", ce.ID, err)
					}
					if kl, _, err = certify.KL(current, a); err != nil {
						return fmt.Errorf("counterfactual %q: anchor %d: %w", ce.ID, ce.AnchorVersion, err)
					}
				}
				anchorK[ce.AnchorVersion] = kl
			}
			b := pol.Bounds(cert, kl)
			ce.Bound, ce.VarBound, ce.KLFromAnchor = b.ProbLower, b.VarUpper, kl
			s, mc := pol.Judge(cert, b)
			switch {
			case !mc:
				ce.Status = s
			case ce.AnchorVersion == c.version:
				// p1 was measured under q_now itself and p1 >= 1 - delta > 1/2, so the target is
				// the argmax: Monte-Carlo would only repeat the measurement.
				ce.Status = certify.Observed(ce.P1, ce.Target, ce.Target)
			default:
				needMC = append(needMC, i)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger: put: %w", err)
	}
	if len(needMC) > 0 {
		xs := make([][]float64, len(needMC))
		for k, i := range needMC {
			xs[k] = ces[i].XCF
		}
		pred, err := l.predict(context.Background(), current, xs, l.opts.MCSamples, c.version)
		if err != nil {
			return fmt.Errorf("ledger: put: %w", err)
		}
		for k, i := range needMC {
			ces[i].Status = certify.Observed(pred.P(k, ces[i].Target), pred.Argmax(k), ces[i].Target)
		}
	}
	err = l.db.Update(func(tx *bolt.Tx) error {
		if readCur(tx) != c {
			return ErrStale
		}
		hdrs, bodies := tx.Bucket(bHeaders), tx.Bucket(bBodies)
		hdrs.FillPercent, bodies.FillPercent = 0.9, 0.9 // IDs are mostly appended in order
		cnt := readCounts(tx)
		refs := map[uint64]uint64{}
		for _, ce := range ces {
			h := header{status: ce.Status, target: ce.Target, anchor: ce.AnchorVersion, p1: ce.P1, var1: ce.Var1,
				delta: ce.Delta, epsilon: ce.Epsilon, samples: ce.Samples, updated: ce.UpdatedAt.UnixNano()}
			bd := body{created: ce.CreatedAt.UnixNano(), x: ce.X, xcf: ce.XCF}
			if err := hdrs.Put([]byte(ce.ID), h.encode()); err != nil {
				return err
			}
			if err := bodies.Put([]byte(ce.ID), bd.encode()); err != nil {
				return err
			}
			cnt.add(ce.Status, 1)
			if ce.Status != certify.Uncertified {
				refs[ce.AnchorVersion]++
			}
		}
		for v, n := range refs {
			if err := l.ref(tx, c, v, int64(n), anchorK[v], now); err != nil {
				return err
			}
		}
		if err := cnt.put(tx); err != nil {
			return err
		}
		return bumpGen(tx)
	})
	if err != nil {
		return fmt.Errorf("ledger: put: %w", err)
	}
	return nil
}

// ref adds n (may be negative) references to anchor v, creating its snapshot from the current
// posterior if v is current and not yet an anchor. kl is KL(q_now || q_v), recorded when the
// anchor's stored KL is not already relative to the current posterior.
func (l *Ledger) ref(tx *bolt.Tx, c cur, v uint64, n int64, kl float64, now time.Time) error {
	anchors, key := tx.Bucket(bAnchors), u64bytes(v)
	var a anchorMeta
	if raw := anchors.Get(key); raw != nil {
		var err error
		if a, err = decodeAnchor(raw); err != nil {
			return err
		}
	} else {
		if n < 0 || v != c.version {
			return fmt.Errorf("%w: anchor %d has no record", ErrCorrupt, v)
		}
		if err := tx.Bucket(bAnchorModels).Put(key, tx.Bucket(bMeta).Get(kCurrent)); err != nil {
			return err
		}
		a = anchorMeta{kl: 0, klVersion: c.version, created: now.UnixNano()}
	}
	if int64(a.refs)+n < 0 {
		return fmt.Errorf("%w: anchor %d would have %d references", ErrCorrupt, v, int64(a.refs)+n)
	}
	a.refs = uint64(int64(a.refs) + n)
	if n > 0 && a.klVersion != c.version {
		a.kl, a.klVersion = kl, c.version
	}
	return anchors.Put(key, a.encode())
}

// gcAnchors deletes every anchor no CE refers to, except the current posterior's.
func (l *Ledger) gcAnchors(tx *bolt.Tx, currentVersion uint64) error {
	var dead [][]byte
	err := tx.Bucket(bAnchors).ForEach(func(k, v []byte) error {
		a, err := decodeAnchor(v)
		if err != nil {
			return err
		}
		if a.refs == 0 && binary.BigEndian.Uint64(k) != currentVersion {
			dead = append(dead, append([]byte(nil), k...))
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, k := range dead {
		if err := tx.Bucket(bAnchors).Delete(k); err != nil {
			return err
		}
		if err := tx.Bucket(bAnchorModels).Delete(k); err != nil {
			return err
		}
		l.log.Debug("anchor posterior released", "version", binary.BigEndian.Uint64(k))
	}
	return nil
}

// Delete removes a CE and releases its anchor reference.
func (l *Ledger) Delete(id string) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.db.Update(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bHeaders).Get([]byte(id))
		if raw == nil {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		h, err := decodeHeader(raw)
		if err != nil {
			return fmt.Errorf("counterfactual %q: %w", id, err)
		}
		c := readCur(tx)
		if h.status != certify.Uncertified {
			if err := l.ref(tx, c, h.anchor, -1, 0, time.Time{}); err != nil {
				return err
			}
		}
		if err := tx.Bucket(bHeaders).Delete([]byte(id)); err != nil {
			return err
		}
		if err := tx.Bucket(bBodies).Delete([]byte(id)); err != nil {
			return err
		}
		cnt := readCounts(tx)
		cnt.add(h.status, -1)
		if err := cnt.put(tx); err != nil {
			return err
		}
		if err := l.gcAnchors(tx, c.version); err != nil {
			return err
		}
		return bumpGen(tx)
	})
	if err != nil {
		return fmt.Errorf("ledger: delete: %w", err)
	}
	return nil
}

// load decodes the CE stored under id, with its derived bounds from the anchor's KL.
func (l *Ledger) load(tx *bolt.Tx, id, rawHdr []byte) (*CE, error) {
	h, err := decodeHeader(rawHdr)
	if err != nil {
		return nil, fmt.Errorf("counterfactual %q: %w", id, err)
	}
	bd, err := decodeBody(tx.Bucket(bBodies).Get(id), true)
	if err != nil {
		return nil, fmt.Errorf("counterfactual %q: %w", id, err)
	}
	ce := &CE{ID: string(id), X: bd.x, XCF: bd.xcf, Target: h.target, AnchorVersion: h.anchor, P1: h.p1, Var1: h.var1,
		Samples: h.samples, Delta: h.delta, Epsilon: h.epsilon, Status: h.status,
		CreatedAt: time.Unix(0, bd.created).UTC(), UpdatedAt: time.Unix(0, h.updated).UTC(), History: bd.history}
	for i := range ce.History {
		ce.History[i].ID = ce.ID
	}
	if h.status != certify.Uncertified {
		raw := tx.Bucket(bAnchors).Get(u64bytes(h.anchor))
		if raw == nil {
			return nil, fmt.Errorf("%w: counterfactual %q refers to anchor %d, which is not stored", ErrCorrupt, id, h.anchor)
		}
		a, err := decodeAnchor(raw)
		if err != nil {
			return nil, err
		}
		b := l.opts.Policy.Bounds(h.certificate(), a.kl)
		ce.Bound, ce.VarBound, ce.KLFromAnchor = b.ProbLower, b.VarUpper, a.kl
	}
	return ce, nil
}

// Get returns the CE stored under id, or ErrNotFound.
func (l *Ledger) Get(id string) (*CE, error) {
	var ce *CE
	err := l.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bHeaders).Get([]byte(id))
		if raw == nil {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		var err error
		ce, err = l.load(tx, []byte(id), raw)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: get: %w", err)
	}
	return ce, nil
}

// List pages through CEs in ID order: up to limit (default 100, at most 10000) CEs with IDs
// after `after` ("" = from the start) and, if status is not 0, that status. The next page
// starts after the last ID returned.
func (l *Ledger) List(status certify.Status, limit int, after string) ([]*CE, error) {
	if status != 0 && !status.Valid() {
		return nil, fmt.Errorf("ledger: list: %w: status %d", ErrInvalid, status)
	}
	if limit <= 0 {
		limit = 100
	}
	limit = min(limit, 10000)
	var out []*CE
	err := l.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bHeaders).Cursor()
		k, v := c.First()
		if after != "" {
			k, v = c.Seek([]byte(after))
			if k != nil && string(k) == after {
				k, v = c.Next()
			}
		}
		for ; k != nil && len(out) < limit; k, v = c.Next() {
			if status != 0 && (len(v) != headerSize || certify.Status(v[hStatus]) != status) {
				continue
			}
			ce, err := l.load(tx, k, v)
			if err != nil {
				return err
			}
			out = append(out, ce)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: list: %w", err)
	}
	return out, nil
}

// predict runs the posterior predictive for xs in batches of MCBatch. Every batch uses the same
// seed, so with bnn's shared weight draws the result does not depend on the batch size.
func (l *Ledger) predict(ctx context.Context, m *bnn.Model, xs [][]float64, samples int, seed uint64) (*bnn.Predictive, error) {
	out := &bnn.Predictive{N: len(xs), C: m.NumClasses(), S: samples}
	for lo := 0; lo < len(xs); lo += l.opts.MCBatch {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		hi := min(lo+l.opts.MCBatch, len(xs))
		p, err := m.Predict(xs[lo:hi], samples, seed)
		if err != nil {
			return nil, fmt.Errorf("monte-carlo: %w", err)
		}
		out.Mean = append(out.Mean, p.Mean...)
		out.Var = append(out.Var, p.Var...)
	}
	return out, nil
}
