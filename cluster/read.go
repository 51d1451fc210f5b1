package cluster

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// Find returns the CE id from its owner: this ledger when it owns id's partition, else the
// owner's API (forwarding the request's Authorization). replica names who answered.
func (s *Share) Find(ctx context.Context, id, authorization string) (ce *ledger.CE, replica string, err error) {
	p := ceshare.Partition(id, s.partitions)
	if slices.Contains(s.member.Owned(), p) {
		ce, err := s.Local(id)
		return ce, s.id, err
	}
	owner, err := s.dir.Owner(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if owner.Replica == s.id {
		ce, err := s.Local(id)
		return ce, s.id, err
	}
	a, err := s.ask(ctx, owner, http.MethodGet, "/v1/counterfactuals/"+url.PathEscape(id), nil, authorization)
	if err != nil {
		return nil, "", err
	}
	if a.code == http.StatusNotFound {
		return nil, owner.Replica, fmt.Errorf("%w: %q", ledger.ErrNotFound, id)
	}
	var got ledger.CE
	if err := decodePeer(owner, a, &got); err != nil {
		return nil, owner.Replica, fmt.Errorf("the owner of partition %d: %w", p, err)
	}
	return &got, owner.Replica, nil
}

// ErrRebuilding is the error of a read of an id in a partition this replica is still rebuilding
// from the CE topic (acquired, not caught up) or is blocked in, held here or not: the CE may be
// among the registrations still to replay, or a copy that requests still to replay delete or
// replace, so the answer is not known yet (503, not 404 nor the copy).
var ErrRebuilding = errors.New("CE partition being rebuilt by its owner")

// Local reads CE id from this replica's ledger, as the owner of its partition: ErrRebuilding
// when the partition is not caught up here (being rebuilt, or not acquired yet: the group,
// which the directory described, gave it to this replica and the member has not taken it; or
// a forwarding replica read the group before a rebalance), whether the ledger holds the id or
// not: a copy the ledger kept from an earlier hold of the partition (a restart, a pause past
// the session) may be one that requests still to replay delete or replace.
//
// Between two generations of the CE group (a member evicted after a pause past its session
// learns it when its generation ends) it answers ErrRebuilding too, as HoldsWhole does for a
// list: the group may have given the partition to another member, which applied requests this
// ledger has not read.
func (s *Share) Local(id string) (*ledger.CE, error) {
	if s.member.Generation() == 0 {
		return nil, fmt.Errorf("%w: this replica is between two generations of the CE group of %s; retry", ErrRebuilding, s.topic)
	}
	if p := ceshare.Partition(id, s.partitions); !s.member.Ready(p) {
		return nil, s.rebuildingErr(p)
	}
	return s.ledger.Get(id)
}

// rebuilding is ErrRebuilding for the first partition this replica holds or was assigned that
// it has not caught up with, a blocked one first (it will not pass on its own), nil when there
// is none: a list of this ledger's CEs misses some.
func (s *Share) rebuilding() error {
	if p, ok := firstNotCaughtUp(s.NotCaughtUp(), s.member.Blocked()); ok {
		return s.rebuildingErr(p)
	}
	return nil
}

// firstNotCaughtUp is the partition a replica names when it has not caught up with some: the
// first one blocked (it will not pass on its own), else the first not caught up; false when
// there is none.
func firstNotCaughtUp(notCaughtUp []int, blocked []ceshare.Blocked) (int, bool) {
	if len(blocked) > 0 {
		return blocked[0].Partition, true
	}
	if len(notCaughtUp) > 0 {
		return notCaughtUp[0], true
	}
	return 0, false
}

// HoldsWhole says why this replica's ledger may not hold every CE of the partitions expect (the
// ones the CE group gives it, as a listing replica read them from the group) and of those it
// holds or was assigned: one it has not caught up with, or does not hold yet (its member has
// not taken up the group's latest assignment), or a member between two generations, which does
// not know its partitions; nil when there is none. The directory a listing replica reads the
// assignment from sees a new generation as soon as the group does, before each member takes it
// up.
func (s *Share) HoldsWhole(expect []int) error {
	if s.member.Generation() == 0 {
		return fmt.Errorf("%w: this replica is between two generations of the CE group of %s; retry", ErrRebuilding, s.topic)
	}
	var waiting []int
	for _, p := range expect {
		if !s.member.Ready(p) {
			waiting = append(waiting, p)
		}
	}
	if p, ok := firstNotCaughtUp(append(waiting, s.NotCaughtUp()...), s.member.Blocked()); ok {
		return s.rebuildingErr(p)
	}
	return nil
}

// NotCaughtUp are the partitions this replica holds or was assigned and has not caught up with
// since it acquired them, sorted (cfguard_counterfactuals_partitions_rebuilding counts them).
func (s *Share) NotCaughtUp() []int {
	ps := []int{}
	for _, p := range slices.Concat(s.member.Owned(), s.member.Assigned()) {
		if !s.member.Ready(p) && !slices.Contains(ps, p) {
			ps = append(ps, p)
		}
	}
	slices.Sort(ps)
	return ps
}

// CaughtUp waits until the share has settled (Settled), this replica holds every CE of its
// partitions (HoldsWhole) and no CE of another's (no release runs: ceshare.Member.Releasing), at
// most wait; after that, or when ctx ends, it returns why not (an ErrRebuilding); a blocked
// partition (ErrBlocked), which does not pass while an audit waits, ends the wait at once. An
// audit waits so: it covers this replica's share, no less and no more. Until the share has
// settled, the partitions the member holds may be another replica's: after a pause of this
// process past its session, the member still holds the partitions of a generation it has not
// seen end, ready and not blocked, while the group may have given them to others, which judged
// and published their CEs meanwhile; an audit would re-anchor the stale copies and publish
// their status changes and states again.
func (s *Share) CaughtUp(ctx context.Context, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		applied := s.applied.wait()
		settled := s.member.Settled()
		err := s.caughtUp(settled)
		if err == nil || errors.Is(err, ErrBlocked) { // a block does not pass while the audit waits
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-settled: // the next generation released what the member lost, or its own went on
		case <-applied: // a partition catches up after an Apply, once the member saw its end
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// caughtUp is why an audit cannot cover this replica's share yet (CaughtUp), nil when it can;
// settled is the member's Settled channel. An unsettled share comes first: until it settles,
// the partitions the member holds, and any block among them, may be another replica's.
func (s *Share) caughtUp(settled <-chan struct{}) error {
	select {
	case <-settled:
	default:
		return fmt.Errorf("%w: this replica was paused past the session of the CE group of %s, or has just started: the group "+
			"may have given some of its partitions to other replicas; retry", ErrRebuilding, s.topic)
	}
	if err := s.HoldsWhole(nil); err != nil {
		return err
	}
	if ps := s.member.Releasing(); len(ps) > 0 {
		return fmt.Errorf("%w: partitions %v of %s still being released by this replica; retry", ErrRebuilding, ps, s.topic)
	}
	return nil
}

func (s *Share) rebuildingErr(p int) error {
	for _, b := range s.member.Blocked() {
		if b.Partition == p {
			writer := "a request that names no replica"
			if b.Writer != "" {
				writer = fmt.Sprintf("replica %q", b.Writer)
			}
			return blockedError(fmt.Sprintf("CE partition %d of %s blocked at offset %d by a request this build of cfguard cannot read "+
				"(written by %s; %s): upgrade the partition's owner, replica %q, or skip the request (replication.skip_ce_requests)", p, s.topic, b.Offset, writer, b.Reason, s.id))
		}
	}
	next, _ := s.member.Next(p)
	return fmt.Errorf("%w: partition %d of %s, its requests replayed up to offset %d; retry", ErrRebuilding, p, s.topic, next)
}

// ErrBlocked is the ErrRebuilding (errors.Is) of a partition blocked at a request its owner's
// build cannot read (ceshare.Blocked): the answer is not known until a build that reads it
// applies it, or the request is skipped, which takes an operator, not a moment.
var ErrBlocked error = errBlocked{}

type errBlocked struct{}

func (errBlocked) Error() string {
	return "CE partition blocked at a request its owner's build cannot read"
}
func (errBlocked) Is(target error) bool { return target == ErrRebuilding }

// blockedError is an ErrBlocked that says which partition, where and why.
type blockedError string

func (e blockedError) Error() string { return string(e) }
func (e blockedError) Unwrap() error { return ErrBlocked }

// HeaderForwarded marks a request one replica forwards to another, naming the sender; the
// owner answers from its ledger and never forwards it again.
const HeaderForwarded = "Cfguard-Forwarded-By"

// ParamPartitions names, on a list request one replica forwards to another, the partitions the
// CE group gives the owner as the sender read them (Share.listAt).
const ParamPartitions = "partitions"
