package postlog

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/cfguard/cfguard/internal/clusterkey"
)

// Head is the last accepted entry, all a replica needs to judge the next record. It is stored
// with the replica's state (Marshal), so that a restart resumes the chain where it was.
type Head struct {
	Seq     uint64        `json:"seq"`
	Hash    string        `json:"hash"`   // hex SHA-256 of the entry's value bytes
	Offset  int64         `json:"offset"` // the entry's offset in the log's partition
	Term    uint64        `json:"term"`
	Writer  string        `json:"writer"` // the writer of the term's claim ("" in term 0)
	Version uint64        `json:"version"`
	Covers  map[int]int64 `json:"covers,omitempty"`
	// PosteriorSHA256 is the posterior's hash at this entry.
	PosteriorSHA256 string `json:"posterior_sha256"`
	// GenesisOffset and GenesisHash locate the genesis the chain started from, whose settings
	// a replica checks at every start. GenesisHash is empty in heads stored before they were
	// kept: the genesis is then found by playing the log from its start.
	GenesisOffset int64  `json:"genesis_offset,omitempty"`
	GenesisHash   string `json:"genesis_hash,omitempty"`
	// Epoch is the epoch of the genesis the head descends from (0: the first).
	Epoch uint64 `json:"epoch,omitempty"`
	// Unpublished are the posterior events of accepted increments that no later increment says
	// are published (Entry.EventsThrough), oldest first: what the next claimant publishes again.
	// At most MaxUnpublished entries are kept.
	Unpublished []Unpublished `json:"unpublished,omitempty"`
	// Marks are the latest mark of each input partition the chain's increments read
	// (Entry.Marks): what the next updater checks before it reads on from Covers.
	Marks map[int]Mark `json:"marks,omitempty"`
	// Points are the versions the chain's increments marked as confirmation points
	// (Entry.Point), ascending, the latest MaxPoints of them: every point after PointsAfter is
	// here. PointsKept is false in heads stored before they were kept; the chain then keeps the
	// points after that head's version.
	Points      []uint64 `json:"points,omitempty"`
	PointsAfter uint64   `json:"points_after,omitempty"`
	PointsKept  bool     `json:"points_kept,omitempty"`
}

// MaxPoints bounds Head.Points: with a point every few versions, more versions than the
// posteriors a replica keeps in memory.
const MaxPoints = 256

// PointsIn returns the confirmation points p with after < p <= through, ascending; known is
// false when the head does not know every one of them (after is before PointsAfter).
func (h *Head) PointsIn(after, through uint64) (points []uint64, known bool) {
	if h == nil || !h.PointsKept || after < h.PointsAfter {
		return nil, false
	}
	i, _ := slices.BinarySearch(h.Points, after+1)
	for _, p := range h.Points[i:] {
		if p > through {
			break
		}
		points = append(points, p)
	}
	return points, true
}

// KnownAfter is the version after which the head knows every confirmation point: PointsAfter, or
// the head's version when it keeps no points (a head stored before heads kept them).
func (h *Head) KnownAfter() uint64 {
	switch {
	case h == nil:
		return 0
	case !h.PointsKept:
		return h.Version
	}
	return h.PointsAfter
}

// LatestPoint returns the latest confirmation point at or before through that the head keeps.
func (h *Head) LatestPoint(through uint64) (uint64, bool) {
	if h == nil {
		return 0, false
	}
	i, found := slices.BinarySearch(h.Points, through)
	if found {
		return through, true
	}
	if i == 0 {
		return 0, false
	}
	return h.Points[i-1], true
}

// IsPoint reports whether version v is a confirmation point the head keeps.
func (h *Head) IsPoint(v uint64) bool {
	_, found := slices.BinarySearch(h.pointList(), v)
	return found
}

func (h *Head) pointList() []uint64 {
	if h == nil {
		return nil
	}
	return h.Points
}

// pointsAfter is the points of a head that follows h with the entry e: h's, with e's version
// when e (an increment or a claim) marks it (Entry.Point), the oldest going past MaxPoints.
func pointsAfter(h *Head, next *Head, e *Entry) {
	switch {
	case h == nil:
		next.PointsKept, next.PointsAfter = true, e.Version // a first genesis: no CE is due at it
	case !h.PointsKept:
		next.PointsKept, next.PointsAfter = true, h.Version
	default:
		next.PointsKept, next.PointsAfter, next.Points = true, h.PointsAfter, h.Points
	}
	if e.Kind == Genesis || !e.Point || next.IsPoint(e.Version) {
		return
	}
	if e.Version == next.PointsAfter && e.Version > 0 {
		// The version after which the points are known is the one e marks (a head stored
		// without points, or the first genesis, at e's version): the only version in
		// (e.Version-1, e.Version] is a point, and so known.
		next.PointsAfter = e.Version - 1
	}
	ps := append(slices.Clone(next.Points), e.Version)
	if len(ps) > MaxPoints {
		next.PointsAfter = ps[0]
		ps = ps[1:]
	}
	next.Points = ps
}

// Lineage sets the Genesis and Epoch of e, a claim or an increment to append on h, to those of the
// genesis h descends from; it leaves them unset when h does not know its genesis (a head stored
// before heads kept it).
func (h *Head) Lineage(e *Entry) {
	if h.GenesisHash != "" {
		e.Genesis, e.Epoch = h.GenesisHash, h.Epoch
	}
}

// Unpublished is an accepted increment's posterior events, by the increment's seq.
type Unpublished struct {
	Seq    uint64  `json:"seq"`
	Events []Event `json:"events"`
}

// MaxUnpublished bounds Head.Unpublished. Every writer of this package says what it published in
// each increment, so the list holds at most the entries of the last writer after its last
// increment; the bound keeps a head small on a log whose writers never say it.
const MaxUnpublished = 64

// owed is Head.Unpublished after the increment e on a head that owed u: the entries e says are
// published dropped, e's own events added.
func owed(u []Unpublished, e *Entry) []Unpublished {
	var out []Unpublished
	for _, x := range u {
		if e.EventsThrough == 0 || x.Seq > e.EventsThrough {
			out = append(out, x)
		}
	}
	if len(e.Events) > 0 {
		out = append(out, Unpublished{Seq: e.Seq, Events: e.Events})
	}
	if len(out) > MaxUnpublished {
		out = out[len(out)-MaxUnpublished:]
	}
	return out
}

// Reason says why a record was not accepted (or that it was).
type Reason string

// Reasons of Chain.Offer, also the label values of the ignored-records counter.
const (
	Accepted Reason = "accepted"
	// NotSuccessor: the record does not name the head as its parent. Losing appends, duplicates
	// of accepted entries and late retries all end here.
	NotSuccessor Reason = "not_successor"
	// StaleTerm: the record names the head but belongs to another term or writer (a fenced
	// writer), or a claim skips a term.
	StaleTerm Reason = "stale_term"
	// Invalid: the record names the head but does not follow from it (version, coverage).
	Invalid Reason = "invalid"
	// Malformed: not an entry.
	Malformed Reason = "malformed"
	// UnknownFormat: an entry of a newer format read after the chain stopped at an earlier one
	// (the first one stops the chain: Offer returns ErrUnknownFormat).
	UnknownFormat Reason = "unknown_format"
	// Unauthenticated: the record's authenticator is missing or does not verify under the
	// cluster's keys; it was not written by a replica, and is not even decoded.
	Unauthenticated Reason = "unauthenticated"
	// OtherLog: a claim or an increment numbered past the head's successor that names another
	// genesis (Entry.Genesis) of an epoch no later than the head's: an entry signed with the
	// cluster's key for another log, or for an epoch this log moved past, copied in. No writer
	// of this log appends one, and it does not stop the chain as a diverged entry would.
	OtherLog Reason = "other_log"
	// PastEnd: an increment that covers offsets of the input topic that do not exist
	// (CheckCoverage). The chain does not know the input topic: its reader checks this.
	PastEnd Reason = "coverage_past_end"
)

// ErrPastEnd is wrapped by CheckCoverage's errors.
var ErrPastEnd = errors.New("postlog: the entry covers offsets past the input topic's end")

// CheckCoverage checks that coverage (an entry's Covers) claims no offset past ends, the input
// topic's end offsets by partition: an increment may only cover records that exist.
func CheckCoverage(covers, ends map[int]int64) error {
	for _, p := range slices.Sorted(maps.Keys(covers)) {
		end, ok := ends[p]
		switch {
		case !ok && covers[p] > 0:
			return fmt.Errorf("%w: it covers partition %d to offset %d, and the input topic has no partition %d", ErrPastEnd, p, covers[p], p)
		case covers[p] > end:
			return fmt.Errorf("%w: it covers partition %d to offset %d, and the partition ends at %d", ErrPastEnd, p, covers[p], end)
		}
	}
	return nil
}

// Domain separates the posterior log's authenticators from those of other records
// (clusterkey): an authenticator of a CE request never verifies as an entry's.
const Domain = "cfguard posterior log entry v1"

// Sign is the authenticator of an entry's value bytes under keys' signing key, the value of
// its record's clusterkey.Header header.
func Sign(keys *clusterkey.Keyring, value []byte) []byte { return keys.Sign(Domain, value) }

// Authenticate checks a record's authenticator under keys; its error says why it fails.
func Authenticate(keys *clusterkey.Keyring, rec Record) error {
	return keys.Verify(Domain, rec.Value, rec.Auth)
}

// Chain applies the acceptance rule. A chain from NewChain expects a genesis.
type Chain struct {
	head *Head
	keys *clusterkey.Keyring
	// stuck is the record the chain stopped at (Block), nil while it follows: only a new epoch
	// that moves past it is accepted then.
	stuck *Past
}

// NewChain returns a chain before the genesis that accepts records authenticated under keys
// (nil keys: none).
func NewChain(keys *clusterkey.Keyring) *Chain { return &Chain{keys: keys} }

// Resume returns a chain whose head is h (nil: before the genesis) that accepts records
// authenticated under keys.
func Resume(h *Head, keys *clusterkey.Keyring) *Chain {
	if h == nil {
		return NewChain(keys)
	}
	c := *h
	c.Covers = maps.Clone(h.Covers)
	c.Unpublished = slices.Clone(h.Unpublished)
	c.Marks = maps.Clone(h.Marks)
	c.Points = slices.Clone(h.Points)
	return &Chain{head: &c, keys: keys}
}

// Fork is a copy of c that Offer can move without moving c.
func (c *Chain) Fork() *Chain {
	f := Resume(c.head, c.keys)
	f.stuck = c.stuck
	return f
}

// Block stops the chain at rec, an authenticated record its reader cannot apply (an unknown
// format, a posterior that does not hash to its entry): from then on it accepts only a new
// epoch that names rec as the record it moves past (Entry.Past). Offer blocks the chain itself
// on an entry of an unknown format.
func (c *Chain) Block(rec Record) {
	h := Hash(rec.Value)
	c.stuck = &Past{Offset: rec.Offset, SHA256: hex.EncodeToString(h[:])}
}

// Halt stops the chain after its head, as Block does at a record: from then on it accepts only a
// new epoch that moves past the head. A replica halts its chain when the log no longer holds
// what it applied (a recreated topic).
func (c *Chain) Halt() {
	if c.head != nil {
		c.stuck = &Past{Offset: c.head.Offset, SHA256: c.head.Hash}
	}
}

// Stuck is the record the chain stopped at, nil while it follows.
func (c *Chain) Stuck() *Past { return c.stuck }

// ErrDiverged is wrapped by Diverged's errors.
var ErrDiverged = errors.New("postlog: the log extends an entry this chain does not have")

// Diverged reports, with an error wrapping ErrDiverged, whether e, the authenticated entry of rec
// that the chain did not accept, comes after an entry the chain does not have: e.Seq > head.Seq +
// 1, while the chain follows; it then blocks the chain at rec (Block), so that only a new epoch
// moving past rec is accepted. A writer appends only on the head it accepted, after reading the
// log up to it, so the writer of e accepted an entry after the head that this chain's reader read
// and judged otherwise. The acceptance rule is a function of the log, so such a split comes from
// the one judgement that is not: the coverage check (CheckCoverage), which asks the input topic's
// ends as each reader sees them. A reader that went on would ignore every later entry of the log.
// A nil e (a record that is not an entry) never diverges.
func (c *Chain) Diverged(rec Record, e *Entry) error {
	if e == nil || c.head == nil || c.stuck != nil || e.Seq <= c.head.Seq+1 || c.otherLog(e) {
		return nil
	}
	c.Block(rec)
	return fmt.Errorf("%w: entry %d (term %d, writer %s) follows an entry after this reader's head, entry %d, that the reader "+
		"judged otherwise (a reader refuses an increment whose coverage passes the input topic's end as it sees it, and logs it)",
		ErrDiverged, e.Seq, e.Term, e.Writer, c.head.Seq)
}

// otherGenesis reports whether e names a genesis other than the one the head descends from (a
// genesis names none: Decode). Entries and heads written before entries named their genesis
// name none, and are judged without it.
func (c *Chain) otherGenesis(e *Entry) bool {
	return c.head != nil && e.Genesis != "" && c.head.GenesisHash != "" && e.Genesis != c.head.GenesisHash
}

// otherLog reports whether e is OtherLog: numbered past the head's successor, naming another
// genesis of an epoch no later than the head's. One of a later epoch is this log's: the reader
// missed the new epoch it descends from, and diverged (Diverged).
func (c *Chain) otherLog(e *Entry) bool {
	return c.otherGenesis(e) && e.Seq > c.head.Seq+1 && e.Epoch <= c.head.Epoch
}

// Head is the last accepted entry, nil before the genesis. The caller must not modify it.
func (c *Chain) Head() *Head { return c.head }

// Offer judges a record. A record whose authenticator does not verify under the chain's keys
// is Unauthenticated, whatever its value holds. Otherwise it returns the decoded entry and
// Accepted when the entry is the first valid successor of the head, which it then becomes;
// otherwise the reason, and the head stays. An authenticated entry of an unknown format
// returns ErrUnknownFormat: the caller must stop. The rule depends only on the bytes of the
// records offered before, in order, and on the keys.
func (c *Chain) Offer(rec Record) (*Entry, Reason, error) {
	if Authenticate(c.keys, rec) != nil {
		return nil, Unauthenticated, nil
	}
	return c.offer(rec.Offset, rec.Value)
}

// offer is Offer after the authentication.
func (c *Chain) offer(offset int64, value []byte) (*Entry, Reason, error) {
	e, err := Decode(value)
	if errors.Is(err, ErrUnknownFormat) {
		if c.stuck != nil {
			return nil, UnknownFormat, nil // stopped already, at an earlier record
		}
		c.Block(Record{Offset: offset, Value: value})
		return nil, UnknownFormat, err
	}
	if err != nil {
		return nil, Malformed, nil
	}
	r := c.judge(e)
	if r != Accepted {
		return e, r, nil
	}
	h := Hash(value)
	next := &Head{Seq: e.Seq, Hash: hex.EncodeToString(h[:]), Offset: offset, Term: e.Term, Version: e.Version,
		Covers: maps.Clone(e.Covers), PosteriorSHA256: e.PosteriorSHA256}
	switch e.Kind {
	case Genesis:
		next.GenesisOffset, next.GenesisHash, next.Epoch = offset, next.Hash, e.Epoch
		c.stuck = nil
	case Claim:
		next.Writer = e.Writer
	case Increment:
		next.Writer = c.head.Writer // the term's claimant
	}
	// What is owed outlives terms and epochs: the next claimant publishes it.
	if c.head != nil {
		next.Unpublished, next.Marks = c.head.Unpublished, c.head.Marks
	}
	if e.Kind == Increment {
		next.Unpublished = owed(next.Unpublished, e)
		if len(e.Marks) > 0 {
			next.Marks = maps.Clone(next.Marks)
			if next.Marks == nil {
				next.Marks = map[int]Mark{}
			}
			maps.Copy(next.Marks, e.Marks)
		}
	}
	if e.Kind != Genesis {
		next.GenesisOffset, next.GenesisHash, next.Epoch = c.head.GenesisOffset, c.head.GenesisHash, c.head.Epoch
	}
	pointsAfter(c.head, next, e)
	// A genesis opens no term: term 0 has no claimant, and nobody writes increments in it.
	c.head = next
	return e, Accepted, nil
}

// judge is the acceptance rule (docs/DESIGN.md, "The acceptance rule").
func (c *Chain) judge(e *Entry) Reason {
	h := c.head
	if h == nil {
		switch {
		case e.Kind != Genesis || e.Version != e.ParentVersion:
			return NotSuccessor
		case c.stuck != nil:
			// Stopped at a record before any head (the log's first entry, of an unknown format):
			// as after a head, only a new epoch that moves past that record.
			if e.Epoch > 0 && e.Past != nil && *e.Past == *c.stuck && e.Seq > 0 && e.Parent != "" {
				return Accepted
			}
			return NotSuccessor
		case e.Epoch == 0 && e.Past == nil && e.Seq == 0 && e.Term == 0 && e.Parent == "" && len(e.Covers) == 0:
			return Accepted
		case e.Epoch > 0 && e.Past != nil && e.Seq > 0 && e.Parent != "":
			// A later epoch, first in a log that lost its start (its records deleted, or the
			// topic recreated and the epoch written from a replica's head): it carries the whole
			// posterior and its coverage, so a reader starts from it as from a first genesis.
			return Accepted
		}
		return NotSuccessor
	}
	if c.otherLog(e) {
		return OtherLog
	}
	if e.Seq != h.Seq+1 || e.Parent != h.Hash {
		return NotSuccessor
	}
	if e.Kind == Genesis {
		return c.judgeEpoch(e)
	}
	if c.otherGenesis(e) || e.Genesis != "" && h.GenesisHash != "" && e.Epoch != h.Epoch {
		return Invalid // it names the head, and not the genesis or the epoch the head descends from
	}
	if c.stuck != nil {
		return NotSuccessor // nothing follows a record the chain cannot apply but a new epoch
	}
	switch e.Kind {
	case Claim:
		if e.Term != h.Term+1 {
			return StaleTerm
		}
		if e.Version != h.Version || e.ParentVersion != h.Version || e.PosteriorSHA256 != h.PosteriorSHA256 || !maps.Equal(e.Covers, h.Covers) {
			return Invalid
		}
		return Accepted
	}
	// An increment.
	if e.Term != h.Term || e.Writer != h.Writer || h.Term == 0 {
		return StaleTerm
	}
	if e.ParentVersion != h.Version {
		return Invalid
	}
	moves := e.Outcome == Promoted || e.Outcome == Clipped
	switch {
	case moves && (e.Version != h.Version+1 || e.LastLayer == nil):
		return Invalid
	case !moves && (e.Version != h.Version || e.LastLayer != nil || e.PosteriorSHA256 != h.PosteriorSHA256):
		return Invalid
	}
	for p, to := range h.Covers {
		if e.Covers[p] < to {
			return Invalid
		}
	}
	return Accepted
}

// judgeEpoch is the rule for a new epoch e on a head h (its parent): the next epoch, moving
// past the record the chain stopped at (or, when it did not, past the head itself: an epoch
// forced on a log that follows), in the head's term with no claimant, carrying the head's
// posterior and coverage unchanged, so that the epoch neither skips a record nor applies one
// twice: the records an unreadable entry covered are the next updater's to apply.
func (c *Chain) judgeEpoch(e *Entry) Reason {
	h := c.head
	past := c.stuck
	if past == nil {
		past = &Past{Offset: h.Offset, SHA256: h.Hash}
	}
	switch {
	case e.Epoch != h.Epoch+1 || e.Past == nil || *e.Past != *past:
		return NotSuccessor
	case e.Term != h.Term || e.Version != h.Version || e.ParentVersion != h.Version || e.PosteriorSHA256 != h.PosteriorSHA256 ||
		!maps.Equal(e.Covers, h.Covers):
		return Invalid
	}
	return Accepted
}

// Range is what an increment covers in one partition: [From, To).
type Range struct{ From, To int64 }

// Covered is, per partition, the input range the entry e covers after head h (its parent).
func Covered(h *Head, e *Entry) map[int]Range {
	out := map[int]Range{}
	for p, to := range e.Covers {
		from := int64(0)
		if h != nil {
			from = h.Covers[p]
		}
		if to > from {
			out[p] = Range{From: from, To: to}
		}
	}
	return out
}

// MarshalHead and UnmarshalHead store a head with the replica's state.
func MarshalHead(h *Head) ([]byte, error) { return json.Marshal(h) }

// UnmarshalHead is MarshalHead's inverse; empty input is no head.
func UnmarshalHead(b []byte) (*Head, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var h Head
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("postlog: stored head: %w", err)
	}
	return &h, nil
}
